"""Fuzz harness (hypothesis): generated command lines for ``generate``/``search``/``export``, generated profiles
(valid ones mutated: types, ranges, depth, size) and generated search spaces, each run through the real entry
point in-process (``viasd_tune.cli.main``) on the tiny test models.

The property, for every example: exit 0, or exit 2 with exactly one line on stderr; never another exception
(a traceback), never more than a few seconds (hypothesis ``deadline``) or a few hundred MB (peak RSS growth).

Example counts (``max_examples``): generate 120, search 80, export 40, profile 100, search space 120: 460 in
all, about two minutes on 2 CPU cores. ``search`` stops once the calibration references are decoded (the
replay cache is stubbed to stop there): everything a user types is checked before that point, and the trials
themselves are covered by test_search.py. Each failure it found is kept as a regression test in
test_bad_input_round2.py.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import io
import json
import re
import resource
import tempfile
from pathlib import Path

import optuna
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_profile import make_profile

from viasd_tune import models, runtime
from viasd_tune.cli import main
from viasd_tune.errors import UserError
from viasd_tune.search import params, replay, workers
from viasd_tune.search import space as spaces

FUZZ = settings(
    deadline=10_000,  # ms per example; the models are tiny, so anything slower is a hang
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    derandomize=True,  # CI runs the same examples every time; failures found are kept as regression tests
    database=None,
)
MAX_RSS_GROWTH_MB = 400


OUTCOMES: collections.Counter = collections.Counter()  # (command, exit code) over the run, see the last test


class Reached(Exception):
    """A stub raised where the fuzzed input has been accepted and only expensive work remains."""


@pytest.fixture(scope="module")
def stubbed(tiny_dirs):
    """Model loads come from a cache of the tiny models (loaded once); a search stops before its trials; no
    worker processes are started."""
    cache: dict = {}
    real_load = models.load

    def load(spec, dtype="auto", device="auto", trust_remote_code=False):
        key = (spec, dtype)
        if key not in cache:
            cache[key] = real_load(spec, dtype, "cpu", trust_remote_code)
        return cache[key]

    def stop(*args, **kwargs):
        raise Reached

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "load", load)
        mp.setattr(replay, "ReplayCache", stop)
        mp.setattr(workers, "run_workers", stop)
        mp.setenv("VIASD_TUNE_CACHE", tempfile.mkdtemp(prefix="viasd-fuzz-cache-"))
        yield tiny_dirs


def run_cli(argv: list[str]) -> None:
    """Run ``main(argv)`` and check the property."""
    out, err = io.StringIO(), io.StringIO()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2)
            rc = e.code
        except Reached:
            rc = 0
    OUTCOMES[argv[0] if argv else "", rc] += 1
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    text = err.getvalue()
    assert grown_mb < MAX_RSS_GROWTH_MB, f"{argv}: peak memory grew {grown_mb:.0f} MB"
    assert "Traceback" not in text, (argv, text)
    assert rc in (0, 2), (argv, rc, text)
    if rc == 2:
        assert text.count("\n") == 1 and "error: " in text, (argv, text)


# ------------------------------------------------------------------ values a user might type

NUMBERS = st.sampled_from(
    ["0", "1", "-1", "2", "5", "64", "65", "0.5", "1e9", "1e400", "-0", "nan", "inf", "-inf", "1000000000",
     "99999999999999999999", "", "x", "3,5", "0x10", "1_000"]
)  # fmt: skip
INDICES = st.sampled_from(
    ["", "0", "1", "1,2", "0-3", "1-2", "5-3", "0-1000000000", "-1", "-1-3", "3-", "a", "1,,2", "0-9999",
     "10000", "1-2-3", " 1 , 2 ", "2,1", "0-0"]
)  # fmt: skip


def _flag(name: str, values) -> st.SearchStrategy[list[str]]:
    return values.map(lambda v: [name, v])


def _command(required: list[str], optional: list[st.SearchStrategy[list[str]]]) -> st.SearchStrategy:
    """The required arguments plus a random subset of optional flags, in random order."""
    return st.lists(st.sampled_from(range(len(optional))), max_size=6, unique=True).flatmap(
        lambda picks: st.tuples(*[optional[i] for i in picks]).map(
            lambda parts: required + [tok for part in parts for tok in part]
        )
    )


def _generate_args(target: str, draft: str) -> st.SearchStrategy[list[str]]:
    optional = [
        _flag("--mode", st.sampled_from(["ar", "sd", "viasd", "bogus"])),
        _flag("--drafter", st.sampled_from(["model", "self", "lookup", "lookup+model", "lookup+self", "nope"])),
        _flag("--gamma", NUMBERS),
        _flag("--skip-attn", INDICES),
        _flag("--skip-mlp", INDICES),
        _flag("--draft-skip-attn", INDICES),
        _flag("--draft-skip-mlp", INDICES),
        _flag("--tau-accept", NUMBERS),
        _flag("--tau-escalate", NUMBERS),
        _flag("--kl", st.sampled_from(["forward", "reverse", "js", "kl"])),
        st.just(["--recheck"]),
        _flag("--draft-confidence", NUMBERS),
        _flag("--lookup-min", NUMBERS),
        _flag("--max-new-tokens", st.sampled_from(["1", "4", "0", "-3", "600", "1e3", "x", "100000000000"])),
        _flag("--temperature", NUMBERS),
        _flag("--top-p", NUMBERS),
        _flag("--seed", NUMBERS),
        _flag("--draft", st.sampled_from([draft, "/no/such/dir", target])),
        _flag("--prompt", st.text(max_size=40) | st.just("x" * 600)),
        st.just(["--chat"]),
        st.just(["--json"]),
        _flag("--profile", st.sampled_from(["/no/such.json", "/dev/null"])),
    ]
    base = ["generate", "--model", target, "--dtype", "float32", "--device", "cpu", "--prompt", "hi",
            "--max-new-tokens", "3"]  # fmt: skip
    return _command(base, optional)


@settings(FUZZ, max_examples=120)
@given(data=st.data())
def test_fuzz_generate(stubbed, data):
    target, draft = stubbed
    run_cli(data.draw(_generate_args(target, draft)))


@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_fuzz_search(stubbed, data):
    target, draft = stubbed
    root = Path(tempfile.mkdtemp(prefix="viasd-fuzz-"))
    (root / "afile").write_text("x")
    (root / "data.jsonl").write_text('{"prompt": "a"}\n{"prompt": 5}\n')
    optional = [
        _flag("--trials", NUMBERS),
        _flag("--n-jobs", st.sampled_from(["0", "1", "-2", "2", "257", "x"])),
        _flag("--timeout", NUMBERS),
        _flag("--max-new-tokens", NUMBERS),
        _flag("--prompts", NUMBERS),
        _flag("--held-out", NUMBERS),
        _flag("--min-fidelity", NUMBERS),
        _flag("--seed", NUMBERS),
        _flag("--chat", st.sampled_from(["auto", "on", "off", "maybe"])),
        _flag("--space", st.sampled_from(["smoke", "default", "nope", str(root / "afile"), "/no/such.yaml"])),
        _flag("--out", st.sampled_from([str(root / "out"), str(root / "afile"), str(root / "afile" / "sub")])),
        _flag("--storage", st.sampled_from(["notaurl", f"sqlite:///{root}/s.db", "sqlite:///", "://"])),
        _flag("--study-name", st.sampled_from(["s", " ", "a/b"])),
        _flag("--data", st.sampled_from(["builtin", str(root / "data.jsonl"), str(root / "afile"), "/no"])),
        _flag("--data-field", st.sampled_from(["prompt", "nope"])),
        _flag("--categories", st.sampled_from(["math", "nope", ","])),
        _flag("--draft", st.sampled_from([draft, "/no/such/dir"])),
    ]
    base = ["search", "--model", target, "--dtype", "float32", "--device", "cpu", "--space", "smoke",
            "--trials", "1", "--prompts", "2", "--max-new-tokens", "2", "--no-progress", "--out", str(root / "o")]  # fmt: skip
    run_cli(data.draw(_command(base, optional)))


# ------------------------------------------------------------------ mode / flag combinations

# Where each routing flag has an effect, written out here from the docs (config.DecodeConfig's docstring, the
# flags' help), independently of the table the code derives from DecodeConfig's field metadata: ``modes`` and,
# where it matters, the drafters that read it.
ANY = ("model", "self", "lookup", "lookup+model", "lookup+self")
MODEL_BASED = ("model", "self", "lookup+model", "lookup+self")
WHERE = {
    "--gamma": (("sd", "viasd"), ANY),
    "--drafter": (("sd", "viasd"), ANY),
    "--skip": (("viasd",), ANY),
    "--draft-skip": (("sd", "viasd"), MODEL_BASED),
    "--tau": (("viasd",), ANY),
    "--kl": (("viasd",), ANY),
    "--recheck": (("viasd",), ANY),
    "--draft-confidence": (("sd", "viasd"), MODEL_BASED),
    "--lookup-min": (("sd", "viasd"), ("lookup+model", "lookup+self")),
    "--draft": (("sd", "viasd"), ("model", "lookup+model")),
}
FLAG_VALUES = {  # valid values, so a refusal can only be about where a flag applies
    "--gamma": ["--gamma", "3"],
    "--skip": ["--skip-attn", "1", "--skip-mlp", "2"],
    "--draft-skip": ["--draft-skip-attn", "1", "--draft-skip-mlp", "2"],
    "--tau": ["--tau-accept", "0.1", "--tau-escalate", "0.5"],
    "--kl": ["--kl", "js"],
    "--recheck": ["--recheck"],
    "--draft-confidence": ["--draft-confidence", "0.3"],
    "--lookup-min": ["--lookup-min", "2"],
}


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_fuzz_mode_and_flag_combinations(stubbed, data):
    """Generated modes, drafters and routing flags (each with a valid value): a combination with a flag that does
    nothing there is refused in one line that says so; any other runs, or is refused for what it lacks (a
    self-draft without a skip set, a model drafter without --draft)."""
    target, draft = stubbed
    mode = data.draw(st.sampled_from([None, "ar", "sd", "viasd"]))
    drafter = data.draw(st.sampled_from([None, *ANY]))
    flags = data.draw(st.lists(st.sampled_from([*FLAG_VALUES, "--draft"]), unique=True, max_size=5))
    argv = ["generate", "--model", target, "--dtype", "float32", "--device", "cpu", "--prompt", "abab",
            "--max-new-tokens", "2"]  # fmt: skip
    argv += ["--mode", mode] if mode else []
    argv += ["--drafter", drafter] if drafter else []
    for flag in flags:
        argv += ["--draft", draft] if flag == "--draft" else FLAG_VALUES[flag]
    # What the CLI runs when --mode/--drafter are left out (its documented defaults).
    run_mode = mode or "viasd"
    run_drafter = drafter or ("model" if "--draft" in flags else "self" if "--draft-skip" in flags else "lookup")
    given_flags = [*flags, *(["--drafter"] if drafter else [])]
    idle = [
        f
        for f in given_flags
        if run_mode not in WHERE[f][0] or (run_mode != "ar" and run_drafter not in WHERE[f][1])
    ]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    text = err.getvalue()
    OUTCOMES["generate-combination", rc] += 1
    assert "Traceback" not in text, (argv, text)
    if idle:
        assert rc == 2 and text.count("\n") == 1 and re.search(r"\b(does|do) nothing in mode", text), (argv, idle, text)
    else:
        needs = ("needs a draft model", "the self-draft needs a skip set")
        assert rc == 0 or (rc == 2 and any(n in text for n in needs)), (argv, text)


@pytest.fixture(scope="module")
def export_root(tmp_path_factory):
    """A study with one exportable trial ("s") and an empty one ("empty"), a file and a folder."""
    from test_config import _study_with_trial

    from viasd_tune.config import DecodeConfig

    root = tmp_path_factory.mktemp("fuzz-export")
    storage = f"sqlite:///{root / 'study.db'}"
    source, trial = _study_with_trial(DecodeConfig(gamma=4, drafter="lookup").to_dict())
    study = optuna.create_study(storage=storage, study_name="s", directions=["maximize", "maximize"])
    for k, v in {**source.user_attrs, "min_fidelity": 0.9}.items():
        study.set_user_attr(k, v)
    study.add_trial(trial)
    optuna.create_study(storage=storage, study_name="empty")
    (root / "afile").write_text("x")
    (root / "adir").mkdir()
    return root


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_fuzz_export(export_root, data):
    root = export_root
    argv = ["export"]
    argv += ["--storage", data.draw(st.sampled_from(
        [f"sqlite:///{root / 'study.db'}"] * 3 + [f"sqlite:///{root / 'missing.db'}", "notaurl", "sqlite:///", ""]))]  # fmt: skip
    argv += ["--study-name", data.draw(st.sampled_from(["s", "s", "s", "empty", "nope", ""]))]
    argv += ["--pick", data.draw(st.sampled_from(
        ["knee", "fastest", "most-faithful", "trial:0", "trial:-1", "trial:x", "trial:", "bogus"]))]  # fmt: skip
    argv += ["--out", data.draw(st.sampled_from(
        [str(root / "p.json")] * 3 + [str(root / "adir"), str(root / "afile" / "p.json"), ""]))]  # fmt: skip
    run_cli(argv)


# ------------------------------------------------------------------ profiles


@pytest.fixture(scope="module")
def valid_profile(stubbed):
    """A profile that serves on the tiny models: prompt lookup on the tiny target, its real fingerprint."""
    target = models.load(stubbed[0], "float32")
    profile = make_profile()
    profile["target"] = {"name": stubbed[0], "fingerprint": target.fingerprint}
    profile.update(drafter="lookup", draft={"kind": "lookup", "name": None, "fingerprint": None}, dtype="float32")
    profile["routing"] = {"skip_attn": [1], "skip_mlp": []}
    runtime.load(profile)  # valid as it stands
    return profile


def _paths(value, path=()):
    yield path
    if len(path) > 8:  # inside a value an earlier mutation nested deep
        return
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*path, i))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
    | st.sampled_from([0, -1, 1, 64, 65, 10**9, 0.5, 1e308, -0.0, "", "model", "js", [], {}]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)  # fmt: skip


@st.composite
def mutated_profiles(draw, profile):
    p = copy.deepcopy(profile)
    for _ in range(draw(st.integers(1, 3))):
        paths = [q for q in _paths(p) if q]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = p
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["set", "delete", "deep", "big"]))
        if op == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif op == "deep":
            nested = 0
            for _ in range(draw(st.sampled_from([10, 40, 1000, 50_000]))):
                nested = [nested]
            parent[path[-1]] = nested
        elif op == "big":
            parent[path[-1]] = "x" * draw(st.sampled_from([1000, 2_000_000]))
        else:
            parent[path[-1]] = draw(JSON_VALUES)
    return p


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_fuzz_profile(valid_profile, stubbed, data):
    _served_or_refused(data.draw(mutated_profiles(valid_profile)))


def _served_or_refused(profile) -> None:
    try:
        text = json.dumps(profile)
    except (RecursionError, ValueError):
        text = "[" * 100_000 + "]" * 100_000  # too deep for json.dumps: write such a file by hand
    path = Path(tempfile.mkdtemp(prefix="viasd-fuzz-")) / "p.json"
    path.write_text(text)
    run_cli(["generate", "--profile", str(path), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"])
    try:  # the Python API: a decoder, or a UserError in one line
        runtime.load(profile, device="cpu")
    except UserError as e:
        assert "\n" not in str(e)


@pytest.fixture(scope="module")
def valid_routed_profile(valid_profile):
    """The valid profile with routes: plain decoding, prompt lookup and VIA-SD, picked by length and category."""
    from viasd_tune.config import DecodeConfig
    from viasd_tune.routing import SkipSet

    profile = copy.deepcopy(valid_profile)
    confs = {
        "ar": DecodeConfig(mode="ar", drafter="lookup"),
        "lookup": DecodeConfig(mode="sd", drafter="lookup", gamma=3),
        "viasd": DecodeConfig(mode="viasd", drafter="lookup", skip=SkipSet.of([1], []), tau_escalate=0.5),
    }
    nodes = [
        {"feature": "prompt_tokens", "threshold": 1.5, "left": 1, "right": 2},
        {"config": 0},
        {"feature": "category", "in": ["qa"], "left": 3, "right": 4},
        {"feature": "copy_share", "threshold": 0.25, "left": 5, "right": 6},
        {"config": 2},
        {"config": 0},
        {"config": 1},
    ]
    configurations = [{"name": n, **c.to_profile()} for n, c in confs.items()]
    profile["routes"] = {"configurations": configurations, "rule": {"nodes": nodes}}
    runtime.load(profile)  # valid as it stands
    return profile


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_fuzz_routed_profile(valid_routed_profile, stubbed, data):
    """Mutations anywhere in a routed profile, its rule and configurations included: served, or refused in one line."""
    _served_or_refused(data.draw(mutated_profiles(valid_routed_profile)))


# ------------------------------------------------------------------ search spaces

SMOKE = yaml.safe_load(spaces.shipped_space_file("smoke").read_text())
# The smoke space with the optional keys too, so mutations reach them.
SMOKE_ALL_KEYS = SMOKE | {
    "recheck": [False, True],
    "draft_confidence": {"low": 0.0, "high": 0.6},
    "draft_model": {"skip_fraction": {"low": 0.0, "high": 0.5}},
}
SPACE_TEXTS = st.sampled_from(
    [
        "", "{}", "[]", "version: 1", ":\n:", "a: &a [*a]", "!!python/object/apply:os.system ['true']",
        "kl: &k [forward]\n" + "x: &x [*k, *k, *k, *k, *k, *k, *k, *k, *k, *k]\n" * 1, "\t", "a: b: c",
    ]
)  # fmt: skip


@st.composite
def mutated_spaces(draw):
    space = copy.deepcopy(draw(st.sampled_from([SMOKE, SMOKE_ALL_KEYS])))
    if draw(st.booleans()):  # the hybrid drafters and their searchable lookup_min
        space.update(drafter=["lookup+model", "lookup"], lookup_min={"low": 1, "high": 3})
    for _ in range(draw(st.integers(1, 3))):
        paths = [q for q in _paths(space) if q]
        path = draw(st.sampled_from(paths))
        parent = space
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(
                JSON_VALUES
                | st.sampled_from([float("nan"), float("inf"), 0, 10**6, ["self"], ["model"], ["lookup+self"]])
            )
    return yaml.safe_dump(space)


def _alias_bomb(levels: int) -> str:
    lines = ["kl: &a0 [forward, js]"]
    for i in range(1, levels):
        lines.append(f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


@settings(FUZZ, max_examples=120)
@given(text=mutated_spaces() | SPACE_TEXTS | st.integers(2, 12).map(_alias_bomb) | st.text(max_size=60))
def test_fuzz_search_space(stubbed, text):
    target, _ = stubbed
    root = Path(tempfile.mkdtemp(prefix="viasd-fuzz-"))
    path = root / "space.yaml"
    path.write_text(text)
    argv = ["search", "--model", target, "--dtype", "float32", "--device", "cpu", "--space", str(path),
            "--trials", "1", "--prompts", "2", "--max-new-tokens", "2", "--no-progress", "--out", str(root / "o")]  # fmt: skip
    run_cli(argv)
    try:  # a space that loads also suggests configurations on the 4-layer tiny model, or refuses in one line
        space = spaces.load_space(str(path))
        study = optuna.create_study(directions=["maximize", "maximize"])
        drafters = ["self", "lookup", "model", "lookup+model", "lookup+self"]
        params.enqueue_known_points(study, space, 4, drafters)
        for _ in range(3):
            trial = study.ask()
            params.suggest(trial, space, 4, drafters, draft_layers=3)
    except UserError as e:
        assert "\n" not in str(e)


def test_fuzz_reached_both_outcomes():
    """The generated inputs are not all refused: every command fuzzed above also ran through (exit 0)."""
    commands = {command for command, _ in OUTCOMES}
    if not commands:
        pytest.skip("run with the fuzz tests above")
    print(dict(OUTCOMES))
    for command in commands:
        assert OUTCOMES[command, 0] > 0 and OUTCOMES[command, 2] > 0, (command, dict(OUTCOMES))

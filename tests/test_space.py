"""Search-space loading, validation and trial decoding (fast: optuna in-memory studies only).

The behaviour is tested on a space document this file owns (``DOC``); the shipped spaces are only checked to
load and to make valid trials, so tuning a shipped space never breaks a test."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import yaml

from viasd_tune.config import DecodeConfig, model_drafter
from viasd_tune.errors import UserError
from viasd_tune.routing import SkipSet
from viasd_tune.search.params import enqueue_known_points, evenly_spaced_skip, known_points, suggest
from viasd_tune.search.space import FloatRange, load_space, shipped_space_file, space_signature

optuna.logging.set_verbosity(optuna.logging.WARNING)
ALL = ["model", "self", "lookup"]
ROOT = Path(__file__).parents[1]
SHIPPED = ("default", "smoke", "model-draft", "lookup")
DOC = {  # a full space: every key, the three drafters, VIA-SD and plain SD (layers 0 and N-1 protected)
    "version": 1,
    "skip": {
        "encoding": "budget",
        "sublayers": ["attn", "mlp"],
        "protect_first": 1,
        "protect_last": 1,
        "budget": {"min": 0.0, "max": 0.4},
    },
    "tau_escalate": {"low": 0.05, "high": 20.0, "log": True},
    "tau_accept_ratio": {"low": 0.001, "high": 1.0, "log": True},
    "kl": ["forward", "reverse", "js"],
    "gamma": [3, 4, 5, 6, 8],
    "drafter": ["model", "self", "lookup"],
    "self_draft": {"skip_fraction": {"low": 0.3, "high": 0.6}},
    "recheck": [False, True],
    "draft_confidence": {"low": 0.0, "high": 0.6},
    "draft_model": {"skip_fraction": {"low": 0.0, "high": 0.3}},
}


def write(tmp_path: Path, data: object, name: str = "space.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def edited(**changes: object) -> dict:
    """``DOC`` with top-level keys replaced (None removes a key)."""
    doc = yaml.safe_load(yaml.safe_dump(DOC))
    for key, value in changes.items():
        if value is None:
            doc.pop(key)
        else:
            doc[key] = value
    return doc


SMOKE_LIKE = {  # a small space: two γ, model and lookup drafting, none of the optional keys
    "gamma": [2, 3],
    "drafter": ["model", "lookup"],
    "self_draft": None,
    "recheck": None,
    "draft_confidence": None,
    "draft_model": None,
}


def doc_space(tmp_path: Path, **changes: object):
    """``DOC`` with ``changes`` (see :func:`edited`), loaded."""
    return load_space(write(tmp_path, edited(**changes), f"space-{len(list(tmp_path.iterdir()))}.yaml"))


def with_skip(**changes: object) -> dict:
    skip = dict(DOC["skip"])
    for key, value in changes.items():
        if value is None:
            skip.pop(key)
        else:
            skip[key] = value
    return edited(skip=skip)


# ---------------------------------------------------------------- loading


def reference_configs(space, num_layers: int, drafters: list[str], draft_layers: int | None = None) -> list:
    """The configurations the space's reference points decode to, as a study runs them."""
    study = optuna.create_study()
    enqueue_known_points(study, space, num_layers, drafters)
    n = len(study.trials)
    assert n == len(known_points(space, num_layers, drafters))
    return [suggest(study.ask(), space, num_layers, drafters, draft_layers) for _ in range(n)]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spaces_load_and_make_valid_trials(name: str) -> None:
    """Each shipped space loads from its file, and its reference points and sampled trials are valid
    configurations for a 28-layer target with a 24-layer draft model (the Qwen pair)."""
    space = load_space(name)
    assert space.source == str(shipped_space_file(name))
    assert space_signature(load_space(str(shipped_space_file(name))), 28) == space_signature(space, 28)
    drafters = list(space.drafter)
    references = reference_configs(space, 28, drafters, draft_layers=24)
    assert references and len(set(references)) == len(references)  # each reference point is its own
    study, configs = run_study(space, 28, drafters, n_trials=20, draft_layers=24)
    for trial, cfg in zip(study.trials, configs, strict=True):
        check_config(cfg, trial, space, 28, draft_layers=24)


def test_one_drafter_variants_search_the_default_routing() -> None:
    """model-draft and lookup draft one way only; what they search for the slim tier is the default's."""
    default = load_space("default")
    routing = ("skip", "tau_escalate", "tau_accept_ratio", "kl", "gamma", "recheck")
    for name in ("model-draft", "lookup"):
        variant = load_space(name)
        assert len(variant.drafter) == 1 and variant.drafter[0] in default.drafter
        assert [getattr(variant, k) for k in routing] == [getattr(default, k) for k in routing]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "benchmarks" / "spaces").glob("*.yaml")), ids=lambda p: p.stem
)
def test_benchmark_spaces_load(path: Path) -> None:
    """The README's measured commands pass these files to --space: each loads, and its reference points are
    distinct configurations (a plain-SD one, without a slim tier, decodes only plain SD)."""
    space = load_space(str(path))
    references = reference_configs(space, 28, list(space.drafter), draft_layers=24)
    assert references and len(set(references)) == len(references)
    if not space.slim_tier:
        assert {c.mode for c in references} == {"sd"}


def test_search_spaces_is_the_one_source(tmp_path: Path) -> None:
    """A checkout reads search_spaces/ itself (no copy in the package); a built wheel carries exactly those
    files as viasd_tune/spaces/ (setup.py's build step, run on a copy of the tree) and loads them from there."""
    assert sorted(p.stem for p in (ROOT / "search_spaces").glob("*.yaml")) == sorted(SHIPPED)
    assert not (ROOT / "viasd_tune" / "spaces").exists()
    for name in SHIPPED:
        assert load_space(name).source == str((ROOT / "search_spaces" / f"{name}.yaml").resolve())

    tree, lib = tmp_path / "tree", tmp_path / "lib"
    tree.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, tree / name)
    for name in ("viasd_tune", "search_spaces"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)]
    subprocess.run(build, cwd=tree, check=True, capture_output=True)
    shipped = {p.name: p.read_bytes() for p in (ROOT / "search_spaces").glob("*.yaml")}
    assert {p.name: p.read_bytes() for p in (lib / "viasd_tune" / "spaces").iterdir()} == shipped

    load = "from viasd_tune.search.space import load_space\nfor n in {!r}: print(load_space(n).source)"
    out = subprocess.run(
        [sys.executable, "-c", load.format(SHIPPED)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(lib)},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out == [str(lib / "viasd_tune" / "spaces" / f"{name}.yaml") for name in SHIPPED]


def test_path_loads_same_content_as_name(tmp_path: Path) -> None:
    shipped = shipped_space_file("default")
    space = load_space(write(tmp_path, shipped.read_text()))
    assert space.source == str(tmp_path / "space.yaml")
    assert space_signature(space, 30) == space_signature(load_space("default"), 30)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (edited(kl=["forward", "kl2"]), "$.kl[1]: 'kl2' is not one of"),
        (edited(drafter=["medusa"]), "$.drafter[0]: 'medusa' is not one of"),
        (edited(gamma=[0, 3]), "$.gamma[0]: 0 is less than the minimum of 1"),
        (edited(gamma=[2.5]), "$.gamma[0]: 2.5 is not of type 'integer'"),
        (edited(gamma=[]), "$.gamma: [] should be non-empty"),
        (edited(gamma=[3, 3]), "$.gamma: [3, 3] has non-unique elements"),
        (edited(version=2), "$.version: 1 was expected"),
        (edited(extra=1), "$: unknown key 'extra'; remove or rename it"),
        (edited(kl=None), "$: missing key 'kl'; add it"),
        (
            edited(self_draft=None),
            "$: missing key 'self_draft' (needed because drafter lists 'self' or 'lookup+self')",
        ),
        (edited(tau_escalate={"low": 5.0, "high": 1.0}), "$.tau_escalate: low 5.0 > high 1.0"),
        (edited(tau_escalate={"low": 0.0, "high": 1.0, "log": True}), "$.tau_escalate.low: must be > 0"),
        (edited(tau_escalate={"low": -1, "high": 1}), "$.tau_escalate.low: -1 is less than the minimum of 0"),
        (edited(tau_escalate={"low": 1, "high": 2, "step": 1}), "$.tau_escalate: unknown key 'step'"),
        (edited(tau_accept_ratio={"low": 0.1, "high": 2.0}), "$.tau_accept_ratio.high: 2.0 is greater than"),
        (edited(self_draft={"skip_fraction": {"low": 0.3, "high": 1.5}}), "$.self_draft.skip_fraction.high"),
        (with_skip(encoding="dense"), "$.skip.encoding: 'dense' is not one of"),
        (with_skip(sublayers=["attn", "ffn"]), "$.skip.sublayers[1]: 'ffn' is not one of"),
        (with_skip(protect_first=-1), "$.skip.protect_first: -1 is less than the minimum of 0"),
        (with_skip(protect_last=True), "$.skip.protect_last: True is not of type 'integer'"),
        (with_skip(budget=None), "$.skip: missing key 'budget' (needed by skip.encoding: budget)"),
        (
            with_skip(budget={"min": 0.0, "max": 1.2}),
            "$.skip.budget.max: 1.2 is greater than the maximum of 1",
        ),
        (with_skip(budget={"min": 0.3, "max": 0.1}), "$.skip.budget: min 0.3 > max 0.1"),
        (
            with_skip(budget={"low": 0.0, "high": 0.4}),
            "$.skip.budget: unknown keys 'high', 'low'; remove or rename it (allowed: min, max)",
        ),
        ([1, 2], "$: [1, 2] is not of type 'object'"),
        ("", "$: the file is empty"),
        ("skip: [unclosed\n", "invalid YAML at line 2 column 1"),
        ("a: !!python/object:os.system x\n", "invalid YAML"),
    ],
)
def test_invalid_space_is_one_line_user_error(tmp_path: Path, doc: object, expected: str) -> None:
    path = write(tmp_path, doc)
    with pytest.raises(UserError) as info:
        load_space(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"search space {path}: ")
    assert expected in message


def test_missing_file_and_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"nope\.yaml: file not found"):
        load_space(str(tmp_path / "nope.yaml"))
    with pytest.raises(UserError, match="not a shipped space"):
        load_space("fancy")


def test_optional_sections_when_unused(tmp_path: Path) -> None:
    # per_sublayer needs no budget; a space without the self drafter needs no self_draft.
    doc = edited(drafter=["model", "lookup"], self_draft=None)
    doc["skip"] = {k: v for k, v in doc["skip"].items() if k != "budget"} | {"encoding": "per_sublayer"}
    space = load_space(write(tmp_path, doc))
    assert space.skip.budget is None and space.self_draft_skip_fraction is None


# ---------------------------------------------------------------- suggest


def check_config(
    cfg: DecodeConfig,
    trial: optuna.trial.FrozenTrial,
    space,
    num_layers: int,
    draft_layers: int | None = None,
) -> None:
    eligible = set(range(space.skip.protect_first, num_layers - space.skip.protect_last))
    plain = trial.params.get("escalate_all") or cfg.is_tree  # token trees are plain SD
    assert cfg.mode == ("sd" if plain else "viasd") and cfg.recheck in space.recheck
    confidence = space.draft_confidence
    if model_drafter(cfg.drafter) is None:
        assert cfg.draft_confidence == 0.0 and "draft_confidence" not in trial.params
    elif isinstance(confidence, FloatRange):
        assert confidence.low <= cfg.draft_confidence <= confidence.high
    else:
        assert cfg.draft_confidence in confidence
    assert cfg.skip.attn <= eligible and cfg.skip.mlp <= eligible
    assert 0.0 <= cfg.tau_accept <= cfg.tau_escalate
    assert cfg.kl in space.kl and cfg.gamma in space.gamma and cfg.drafter in space.drafter
    assert trial.user_attrs["config"] == cfg.to_dict()
    assert DecodeConfig.from_dict(trial.user_attrs["config"]) == cfg
    params = trial.params
    if plain:
        assert cfg.mode == "sd" and cfg.tau_escalate == 0.0 and cfg.skip.is_empty and not cfg.recheck
        assert "tau_escalate" not in params and "kl" not in params and "recheck" not in params
    else:
        assert space.tau_escalate.low <= cfg.tau_escalate <= space.tau_escalate.high
        assert cfg.kl == params["kl"]
    if cfg.drafter == "self":
        n = len(eligible)
        assert len(cfg.draft_skip.attn) == round(params["self_skip_frac"] * n)
        assert cfg.draft_skip.attn == cfg.draft_skip.mlp and cfg.draft_skip.attn <= eligible
    elif cfg.drafter == "model" and space.draft_model_skip_fraction is not None and draft_layers is not None:
        n = draft_layers - space.skip.protect_first - space.skip.protect_last
        assert len(cfg.draft_skip.attn) == round(params["draft_model_skip_frac"] * n)
        assert cfg.draft_skip.attn == cfg.draft_skip.mlp
        assert cfg.draft_skip.attn <= set(
            range(space.skip.protect_first, draft_layers - space.skip.protect_last)
        )
        DecodeConfig.validate(cfg, num_layers, draft_layers)
    else:
        assert cfg.draft_skip.is_empty


def run_study(
    space,
    num_layers: int,
    drafters: list[str],
    n_trials: int = 50,
    seed: int = 0,
    draft_layers: int | None = None,
):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    configs: list[DecodeConfig] = []

    def objective(trial: optuna.Trial) -> float:
        configs.append(suggest(trial, space, num_layers, drafters, draft_layers))
        return 0.0

    study.optimize(objective, n_trials=n_trials)
    return study, configs


@pytest.mark.parametrize("num_layers", [4, 30])
@pytest.mark.parametrize("changes", [{}, SMOKE_LIKE], ids=["full", "small"])
def test_suggest_budget_invariants(tmp_path: Path, changes: dict, num_layers: int) -> None:
    space = doc_space(tmp_path, **changes)
    study, configs = run_study(space, num_layers, ALL)
    n_slots = len(space.skip.sublayers) * (num_layers - space.skip.protect_first - space.skip.protect_last)
    for trial, cfg in zip(study.trials, configs, strict=True):
        check_config(cfg, trial, space, num_layers)
        if not trial.params.get("escalate_all"):
            assert len(cfg.skip.attn) + len(cfg.skip.mlp) == round(trial.params["skip_frac"] * n_slots)
            scores = {}
            for key, value in trial.params.items():
                if key.startswith("score_"):
                    _, kind, layer = key.split("_")
                    scores[kind, int(layer)] = value
            assert len(scores) == n_slots
            skipped = {("attn", i) for i in cfg.skip.attn} | {("mlp", i) for i in cfg.skip.mlp}
            kept = scores.keys() - skipped
            if skipped and kept:
                assert min(scores[s] for s in skipped) >= max(scores[s] for s in kept)
    assert {c.drafter for c in configs} == set(space.drafter)
    assert all(c.tau_escalate > 0 for c in configs)  # plain SD is only ever enqueued, never sampled
    assert any(not c.skip.is_empty for c in configs)


def test_suggest_per_sublayer_and_attn_only(tmp_path: Path) -> None:
    doc = with_skip(encoding="per_sublayer", sublayers=["attn"], protect_first=2)
    space = load_space(write(tmp_path, doc))
    study, configs = run_study(space, 10, ALL)
    for trial, cfg in zip(study.trials, configs, strict=True):
        check_config(cfg, trial, space, 10)
        assert cfg.skip.mlp == frozenset()
        if not trial.params.get("escalate_all"):
            switches = {k: v for k, v in trial.params.items() if k.startswith("skip_")}
            assert set(switches) == {f"skip_attn_{i}" for i in range(2, 9)}
            assert cfg.skip.attn == {i for i in range(2, 9) if switches[f"skip_attn_{i}"]}


def test_budget_ties_broken_by_index(tmp_path: Path) -> None:
    space = doc_space(tmp_path, **SMOKE_LIKE)
    params = {"drafter": "model", "gamma": 2, "escalate_all": False, "kl": "js", "tau_escalate": 1.0}
    params |= {"tau_accept_ratio": 0.5, "skip_frac": 0.25}
    params |= {f"score_{k}_{i}": 0.5 for i in range(1, 5) for k in ("attn", "mlp")}
    cfg = suggest(optuna.trial.FixedTrial(params), space, 6, ALL)  # 8 slots, k = 2
    assert cfg.skip == SkipSet.of([1], [1])
    assert cfg.tau_accept == 0.5 and cfg.kl == "js"


def test_drafters_intersection_and_errors(tmp_path: Path) -> None:
    space = doc_space(tmp_path)
    _, configs = run_study(space, 8, ["lookup", "self"], n_trials=20)
    assert {c.drafter for c in configs} <= {"self", "lookup"}
    with pytest.raises(UserError, match=r"\$\.drafter: none of .* is available"):
        suggest(optuna.trial.FixedTrial({}), doc_space(tmp_path, **SMOKE_LIKE), 8, ["self"])
    with pytest.raises(UserError, match="leave no skippable layer in this 2-layer model"):
        suggest(optuna.trial.FixedTrial({}), space, 2, ALL)


# ---------------------------------------------------------------- known points, helpers, signature


@pytest.mark.parametrize(
    ("changes", "drafters", "gamma", "plain_drafters"),
    [
        ({}, ALL, 4, ["model", "self", "lookup"]),  # the mid γ: the least γ >= 4 ...
        ({}, ["self", "lookup"], 4, ["self", "lookup"]),
        (SMOKE_LIKE, ["lookup"], 3, ["lookup"]),  # ... else the largest
    ],
)
def test_enqueue_known_points_end_to_end(
    tmp_path: Path, changes: dict, drafters: list[str], gamma: int, plain_drafters: list[str]
) -> None:
    space = doc_space(tmp_path, **changes)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=1, n_startup_trials=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no out-of-range fixed-param warnings
        enqueue_known_points(study, space, 12, drafters)
        enqueue_known_points(study, space, 12, drafters)  # resumed study: not enqueued twice
        assisted = "model" in plain_drafters  # the draft model as HF assisted generation runs it
        n_known = 1 + len(plain_drafters) + assisted
        assert len(study.trials) == n_known
        configs: list[DecodeConfig] = []
        study.optimize(lambda t: configs.append(suggest(t, space, 12, drafters)) or 0.0, n_trials=n_known + 4)
    no_skip, plains = configs[0], configs[1 : 1 + len(plain_drafters)]

    def draft_skip(drafter: str) -> SkipSet:
        layers = evenly_spaced_skip(12, round(0.45 * 10), 1, 1) if drafter == "self" else []
        return SkipSet.of(layers, layers)

    def confidence(drafter: str) -> float:  # the mid of the space's range; prompt lookup has none
        c = space.draft_confidence
        return 0.0 if drafter == "lookup" else c.mid() if isinstance(c, FloatRange) else c[0]

    drafter = plain_drafters[0]
    assert no_skip == DecodeConfig(
        mode="viasd",
        gamma=gamma,
        drafter=drafter,
        draft_skip=draft_skip(drafter),
        tau_accept=math.sqrt(0.001 * 1.0) * math.sqrt(0.05 * 20.0),  # geometric mids
        tau_escalate=math.sqrt(0.05 * 20.0),
        kl=space.kl[0],
        recheck=space.recheck[0],
        draft_confidence=confidence(drafter),
    )
    assert plains == [
        DecodeConfig(
            mode="sd",
            gamma=gamma,
            drafter=d,
            draft_skip=draft_skip(d),
            draft_confidence=confidence(d),
        )
        for d in plain_drafters
    ]
    if assisted:  # the space's longest γ, cut at HF's default confidence 0.4
        assert configs[n_known - 1] == DecodeConfig(
            mode="sd", gamma=max(space.gamma), drafter="model", draft_confidence=0.4
        )
    escalate_all = [t.params.get("escalate_all", False) for t in study.trials[:n_known]]
    assert escalate_all == [False] + [True] * (n_known - 1)
    for trial, cfg in zip(study.trials, configs, strict=True):
        check_config(cfg, trial, space, 12)


def test_known_points_per_sublayer(tmp_path: Path) -> None:
    space = load_space(write(tmp_path, with_skip(encoding="per_sublayer", budget=None)))
    study = optuna.create_study()
    enqueue_known_points(study, space, 6, ALL)
    first = study.ask()
    cfg = suggest(first, space, 6, ALL)
    assert (
        first.params["skip_attn_1"] is False and len([k for k in first.params if k.startswith("skip_")]) == 8
    )
    assert (cfg.skip, cfg.gamma, cfg.drafter) == (SkipSet(), 4, "model")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((10, 0, 1, 1), []),
        ((10, 1, 1, 1), [5]),
        ((10, 2, 1, 1), [3, 7]),
        ((10, 4, 1, 1), [2, 4, 6, 8]),
        ((10, 8, 1, 1), list(range(1, 9))),
        ((10, 99, 1, 1), list(range(1, 9))),
        ((10, 3, 0, 0), [1, 5, 8]),
        ((3, 1, 2, 2), []),
    ],
)
def test_evenly_spaced_skip(args: tuple[int, int, int, int], expected: list[int]) -> None:
    assert evenly_spaced_skip(*args) == expected


def test_evenly_spaced_skip_properties() -> None:
    for layers in range(1, 40):
        for count in range(layers):
            got = evenly_spaced_skip(layers + 2, count, 1, 1)
            assert len(got) == count and got == sorted(set(got)) and all(1 <= i <= layers for i in got)


def test_space_signature() -> None:
    space = load_space("default")
    sig = space_signature(space, 30)
    assert len(sig) == 64 and sig == space_signature(load_space("default"), 30)
    assert sig == space_signature(replace(space, source="elsewhere.yaml"), 30)
    assert sig != space_signature(space, 31)
    assert sig != space_signature(replace(space, gamma=(3, 4)), 30)
    assert sig != space_signature(replace(space, skip=replace(space.skip, protect_last=2)), 30)
    assert sig != space_signature(load_space("smoke"), 30)


# ---------------------------------------------------------------- recheck, draft_confidence, draft-model skip set


def test_optional_keys_left_out_give_every_trial_what_it_had_before_they_existed(tmp_path: Path) -> None:
    space = doc_space(tmp_path, recheck=None, draft_confidence=None, draft_model=None)
    assert (space.recheck, space.draft_confidence, space.draft_model_skip_fraction) == (
        (False,),
        (0.0,),
        None,
    )
    study, configs = run_study(space, 8, ALL, n_trials=30, draft_layers=6)
    assert not any(c.recheck or c.draft_confidence for c in configs)
    assert all(c.draft_skip.is_empty for c in configs if c.drafter == "model")
    assert not {"recheck", "draft_confidence", "draft_model_skip_frac"} & {
        k for t in study.trials for k in t.params
    }


@pytest.mark.parametrize(
    ("value", "expected"),
    [({"low": 0.1, "high": 0.5}, FloatRange(0.1, 0.5)), ([0.0, 0.4], (0.0, 0.4)), (0, (0.0,)), (0.4, (0.4,))],
)
def test_draft_confidence_forms(tmp_path: Path, value: object, expected: object) -> None:
    space = load_space(write(tmp_path, edited(draft_confidence=value)))
    assert space.draft_confidence == expected
    study, configs = run_study(space, 8, ALL, n_trials=30)
    for trial, cfg in zip(study.trials, configs, strict=True):
        check_config(cfg, trial, space, 8)
    model_drafted = [c.draft_confidence for c in configs if c.drafter != "lookup"]
    searched = isinstance(expected, FloatRange) or len(expected) > 1
    assert model_drafted and (len(set(model_drafted)) > 1) == searched  # one value: not a param at all
    assert ("draft_confidence" in study.trials[0].params) == (searched and configs[0].drafter != "lookup")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"recheck": [True, "yes"]}, r"\$\.recheck\[1\]: 'yes' is not of type 'boolean'"),
        ({"recheck": []}, r"\$\.recheck: \[\] should be non-empty"),
        ({"draft_confidence": 1.0}, r"\$\.draft_confidence"),
        ({"draft_confidence": {"low": 0.5, "high": 0.2}}, r"\$\.draft_confidence: low 0.5 > high 0.2"),
        ({"draft_confidence": [-0.1]}, r"\$\.draft_confidence"),
        (
            {"draft_model": {"skip_fraction": {"low": 0.0, "high": 1.5}}},
            r"\$\.draft_model\.skip_fraction\.high",
        ),
        ({"draft_model": {}}, r"missing key 'skip_fraction'"),
    ],
)
def test_new_keys_bad_values(tmp_path: Path, changes: dict, expected: str) -> None:
    with pytest.raises(UserError, match=expected) as err:
        load_space(write(tmp_path, edited(**changes)))
    assert "\n" not in str(err.value)


def test_recheck_and_draft_model_skip_suggested(tmp_path: Path) -> None:
    space = doc_space(tmp_path)
    study, configs = run_study(space, 8, ALL, n_trials=60, draft_layers=6)
    for trial, cfg in zip(study.trials, configs, strict=True):
        check_config(cfg, trial, space, 8, draft_layers=6)
    assert {c.recheck for c in configs} == {False, True}
    model = [c for c in configs if c.drafter == "model"]
    assert any(not c.draft_skip.is_empty for c in model) and any(c.draft_skip.is_empty for c in model)
    for c in model:  # protected ends of the 6-layer draft model stay
        assert not ({0, 5} & (c.draft_skip.attn | c.draft_skip.mlp))
    # Without a draft model's layer count (no draft model in the run) no draft-model skip set is applied.
    _, configs = run_study(space, 8, ALL, n_trials=20)
    assert all(c.draft_skip.is_empty for c in configs if c.drafter == "model")


def test_known_points_take_new_keys(tmp_path: Path) -> None:
    space = doc_space(tmp_path)
    study = optuna.create_study()
    enqueue_known_points(study, space, 8, ALL)
    configs = [suggest(study.ask(), space, 8, ALL, draft_layers=6) for _ in range(4)]
    no_skip, *plains = configs
    assert not no_skip.recheck and no_skip.draft_confidence == pytest.approx(0.3)
    assert [c.draft_confidence for c in plains] == [pytest.approx(0.3), pytest.approx(0.3), 0.0]
    assert all(c.draft_skip.is_empty for c in configs if c.drafter == "model")  # the draft model as it is


def test_signature_ignores_optional_keys_at_their_defaults(tmp_path: Path) -> None:
    """A space written before the optional keys existed keeps its signature, so its studies still resume."""
    base = edited(recheck=None, draft_confidence=None, draft_model=None)
    plain = load_space(write(tmp_path, base, "a.yaml"))
    explicit = load_space(write(tmp_path, base | {"recheck": [False], "draft_confidence": 0}, "b.yaml"))
    assert space_signature(plain, 8) == space_signature(explicit, 8)
    assert space_signature(plain, 8) != space_signature(doc_space(tmp_path), 8)


def test_space_without_skipping_searches_plain_sd_only(tmp_path: Path) -> None:
    """skip.budget.max 0: no slim tier to route through, so no VIA-SD reference point and every sampled trial
    is plain SD (a slim verifier that skips nothing is the full target run twice)."""
    no_slim = {**with_skip(budget={"min": 0.0, "max": 0.0}), "recheck": [False]}  # recheck needs a slim tier
    space = load_space(write(tmp_path, no_slim))
    assert not space.slim_tier and doc_space(tmp_path).slim_tier
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    enqueue_known_points(study, space, 8, ALL)
    known = [suggest(study.ask(), space, 8, ALL) for _ in range(len(study.get_trials()))]
    assert known and all(c.mode == "sd" for c in known)
    assert len({c.drafter for c in known}) == len(known) - 1  # plain SD per drafter, plus the HF-like draft
    _, sampled = run_study(space, 8, ALL, n_trials=30)
    assert {c.mode for c in sampled} == {"sd"} and len({c.drafter for c in sampled}) > 1
    assert all(c.skip.is_empty for c in sampled)


# ---------------------------------------------------------------- token trees (issue 33)

TREE = {
    "nodes": [1, 8, 16],
    "lookup": {"depth": {"low": 4, "high": 8}, "width": {"low": 1, "high": 4}},
    "recycle": {"depth": {"low": 2, "high": 5}, "width": {"low": 2, "high": 2}},
    "model": {"depth": {"low": 2, "high": 4}},
}
TREE_DRAFTERS = ["lookup", "recycle", "lookup+recycle", "model", "lookup+recycle+model", "self"]


def test_tree_params_searched_where_they_have_an_effect(tmp_path: Path) -> None:
    """Node budgets and each source's depth/width: trees and recycling drafters are plain SD (VIA-SD verifies
    chains), a source's shape is asked only when the drafter has that source, widths only for a tree, a fixed
    range is not a param, the self-draft never gets a tree; every configuration is valid."""
    space = doc_space(tmp_path, tree=TREE, drafter=TREE_DRAFTERS)
    assert (
        space.tree.nodes == (1, 8, 16)
        and space.tree.recycle_width == (2, 2)
        and space.tree.model_width is None
    )
    assert space.max_block == 17  # 16 nodes and the pending token: the cost curve is measured up to it
    study, configs = run_study(space, 8, TREE_DRAFTERS + ["lookup+self"], n_trials=150)
    seen = set()
    for trial, cfg in zip(study.trials, configs, strict=True):
        p, parts = trial.params, cfg.drafter.split("+")
        assert DecodeConfig.from_dict(trial.user_attrs["config"]) == cfg
        if cfg.drafter == "self":
            assert "tree_nodes" not in p and cfg.tree_nodes == 1
            continue
        assert cfg.tree_nodes == p["tree_nodes"] in (1, 8, 16)
        if cfg.is_tree:
            assert cfg.mode == "sd" and cfg.skip.is_empty and "kl" not in p and "tau_escalate" not in p
            seen.add((cfg.drafter, cfg.tree_nodes > 1))
        shaped = {k for k in p if k.startswith("tree_") and k != "tree_nodes"}
        expected = set()
        if cfg.is_tree:
            expected |= {f"tree_{s}_depth" for s in ("lookup", "recycle", "model") if s in parts}
            if cfg.tree_nodes > 1:
                expected |= {"tree_lookup_width"} if "lookup" in parts else set()
        assert shaped == expected, (cfg.drafter, cfg.tree_nodes, shaped)
        assert 4 <= cfg.tree_lookup_depth <= 8 if "tree_lookup_depth" in p else cfg.tree_lookup_depth == 8
        assert cfg.tree_recycle_width == (
            2 if "recycle" in parts and cfg.tree_nodes > 1 else 4
        )  # fixed: no param
        assert cfg.tree_model_width == DecodeConfig.tree_model_width  # no range: the default
    assert {("recycle", False), ("recycle", True), ("lookup", True), ("lookup+recycle+model", True)} <= seen
    assert any(c.mode == "viasd" and c.drafter == "lookup" for c in configs)  # chains still go through VIA-SD


def test_tree_reference_points_and_bad_tree_keys(tmp_path: Path) -> None:
    space = doc_space(
        tmp_path,
        tree={**TREE, "nodes": [16, 1]},
        drafter=["lookup+recycle", "lookup"],
        draft_confidence=None,  # no drafter here runs a model: the keys for one are refused
        self_draft=None,
        draft_model=None,
    )
    refs = reference_configs(space, 8, ["lookup", "lookup+recycle"])
    # VIA-SD: a chain drafter, a chain; plain SD: the recycling drafter's first tree, lookup's chain as before
    via, *plain = refs
    assert (via.mode, via.drafter, via.tree_nodes) == ("viasd", "lookup", 1)
    assert [(c.mode, c.drafter, c.tree_nodes) for c in plain] == [
        ("sd", "lookup+recycle", 16),
        ("sd", "lookup", 1),
    ]
    # Without a chain in the space, every reference point is a tree (and no VIA-SD point is possible).
    trees_only = reference_configs(
        doc_space(
            tmp_path,
            tree={"nodes": [4, 8]},
            drafter=["lookup"],
            draft_confidence=None,
            self_draft=None,
            draft_model=None,
        ),
        8,
        ["lookup"],
    )
    assert [(c.mode, c.tree_nodes) for c in trees_only] == [("sd", 4)]
    assert plain[0].tree_lookup_depth == 8 and plain[0].tree_recycle_depth == 4  # defaults, inside the ranges
    for bad, needle in (
        ({"nodes": [65]}, r"\$\.tree\.nodes\[0\]"),
        ({"nodes": []}, r"\$\.tree\.nodes"),
        (
            {"nodes": [4], "recycle": {"depth": {"low": 5, "high": 2}}},
            r"\$\.tree\.recycle\.depth: low 5 > high 2",
        ),
        ({"nodes": [4], "model": {"width": {"low": 0, "high": 2}}}, r"\$\.tree\.model\.width\.low"),
        ({"nodes": [4], "bushes": 3}, r"\$\.tree"),
    ):
        with pytest.raises(UserError, match=needle) as err:
            load_space(write(tmp_path, edited(tree=bad)))
        assert "\n" not in str(err.value)


def test_a_seeded_skip_set_stays_a_chain_where_the_space_has_trees(tmp_path: Path) -> None:
    """Seeded skip sets are for VIA-SD, which verifies chains: their params pin a chain, so a sampled tree budget
    never leaves the skip set unused."""
    from viasd_tune.search.params import skip_params

    space = doc_space(tmp_path, tree=TREE, drafter=["lookup", "model"], self_draft=None)
    skip = SkipSet.of([2, 3], [4])
    seeded = skip_params(space, 8, skip)
    assert seeded["tree_nodes"] == 1
    fixed = {
        "drafter": "lookup",
        "gamma": 4,
        "kl": "js",
        "tau_escalate": 1.0,
        "tau_accept_ratio": 0.5,
        "recheck": False,
    }
    cfg = suggest(optuna.trial.FixedTrial({**fixed, **seeded}), space, 8, ["lookup", "model"])
    assert (cfg.mode, cfg.tree_nodes, cfg.skip) == ("viasd", 1, skip)
    assert "tree_nodes" not in skip_params(doc_space(tmp_path), 8, skip)  # a space without trees: as before


def test_tree_sizing_is_searched_for_trees_only(tmp_path: Path) -> None:
    """``tree.sizing`` lists the choices; a budget above 1 asks for one, a chain never does (it has no tree to
    cut); a single choice is not a param; an unknown one is refused in one line."""
    no_model = {"draft_confidence": None, "self_draft": None, "draft_model": None}  # keys for a model drafter
    space = doc_space(
        tmp_path, tree={**TREE, "sizing": ["fixed", "cost"]}, drafter=["lookup", "lookup+recycle"], **no_model
    )
    assert space.tree.sizing == ("fixed", "cost")
    study, configs = run_study(space, 8, ["lookup", "lookup+recycle"], n_trials=60)
    sizings = set()
    for trial, cfg in zip(study.trials, configs, strict=True):
        assert ("tree_sizing" in trial.params) == (cfg.tree_nodes > 1)
        if cfg.tree_nodes > 1:
            sizings.add(cfg.tree_sizing)
        else:
            assert cfg.tree_sizing == "fixed"
    assert sizings == {"fixed", "cost"}
    only = doc_space(tmp_path, tree={**TREE, "sizing": ["cost"]}, drafter=["lookup+recycle"], **no_model)
    _, configs = run_study(only, 8, ["lookup+recycle"], n_trials=10)
    assert {c.tree_sizing for c in configs if c.tree_nodes > 1} == {"cost"}
    assert doc_space(tmp_path, tree=TREE, drafter=["lookup"], **no_model).tree.sizing == ("fixed",)  # left out
    with pytest.raises(UserError, match=r"\$\.tree\.sizing\[0\]") as err:
        load_space(write(tmp_path, edited(tree={"nodes": [4], "sizing": ["auto"]})))
    assert "\n" not in str(err.value)

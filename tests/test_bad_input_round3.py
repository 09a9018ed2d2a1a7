"""Issue 31, "bad input, round three": every reproduction as a test, by class (data destroyed, secrets printed,
flags that do nothing, non-finite numbers, a profile served where it was not tuned, memory, the rest), plus the
property tests: an output path equal to an input path is refused with the input's bytes unchanged, and a
generated password appears nowhere a command prints or stores.

Each refusal is exit code 2 with one line on stderr, and leaves the files and the study storage as they were.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from urllib.parse import quote

import optuna
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import fails_cleanly, gen, search
from test_config import _study_with_trial
from test_profile import make_profile

from viasd_tune import host, models, runtime
from viasd_tune.bench.settings import BenchSettings
from viasd_tune.cli import main
from viasd_tune.config import DecodeConfig
from viasd_tune.credentials import check_storage, redact
from viasd_tune.errors import UserError
from viasd_tune.profile import validate_profile
from viasd_tune.routing import SkipSet
from viasd_tune.search import replay
from viasd_tune.search import space as spaces
from viasd_tune.search.storage import make_storage

REPO = Path(__file__).resolve().parents[1]
PROPERTY = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links not followed) and a hash of its bytes: what "nothing changed" compares."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(root))] = "-> " + os.readlink(path)
        elif path.is_file():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[str(path.relative_to(root))] = "dir"
    return out


@pytest.fixture
def no_model_loads(monkeypatch):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))


@pytest.fixture
def study_db(tmp_path):
    """``tmp_path/s.db``: a SQLite study "run" with one exportable trial (prompt lookup)."""
    db = tmp_path / "s.db"
    source, trial = _study_with_trial(DecodeConfig(mode="sd", gamma=4, drafter="lookup").to_dict())
    study = optuna.create_study(
        storage=f"sqlite:///{db}", study_name="run", directions=["maximize", "maximize"]
    )
    for k, v in {**source.user_attrs, "min_fidelity": 0.9}.items():
        study.set_user_attr(k, v)
    study.add_trial(trial)
    return db


# ====================================================================================== 1. data destroyed


def _spellings(tmp_path: Path, target: Path) -> list[str]:
    """Other names of ``target``: relative, through ``..``, doubled slashes, a symlink, a hard link."""
    link, hard = tmp_path / "link", tmp_path / "hard"
    link.symlink_to(target)
    os.link(target, hard)
    rel = os.path.relpath(target)
    return [str(target), rel, f"./{rel}", f"{tmp_path}/sub/../{target.name}", f"{tmp_path}//{target.name}",
            str(link), str(hard)]  # fmt: skip


def test_export_out_is_the_study_database(study_db, tmp_path, capsys, monkeypatch):
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    for out in _spellings(tmp_path, study_db):
        before = snapshot(tmp_path)
        argv = ["export", "--storage", "sqlite:///s.db", "--study-name", "run", "--out", out]
        fails_cleanly(capsys, argv, "is the same file as --storage", "would destroy that input")
        assert snapshot(tmp_path) == before, out
    assert optuna.load_study(study_name="run", storage="sqlite:///s.db").trials  # the study is intact
    # the legitimate export still runs
    assert main(["export", "--storage", "sqlite:///s.db", "--study-name", "run", "--out", "p.json"]) == 0


def test_dashboard_out_is_an_input(study_db, tmp_path, capsys):
    before = snapshot(tmp_path)
    argv = ["dashboard", "--storage", f"sqlite:///{study_db}", "--study-name", "run", "--out", str(study_db)]
    fails_cleanly(capsys, argv, "is the same file as --storage")
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    shutil.copy(study_db, out_dir / "study.db")
    (out_dir / "profile.json").write_text("{}")
    before = snapshot(tmp_path)
    for name, role in (("study.db", "--out-dir's study.db"), ("profile.json", "--out-dir's profile.json")):
        argv = ["dashboard", "--out-dir", str(out_dir), "--out", str(out_dir / ".." / "o" / name)]
        fails_cleanly(capsys, argv, f"is the same file as {role}")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "flag, name",
    [
        (flag, name)
        for flag in ("--data", "--space", "--storage")
        for name in ("profile.json", "dashboard.html", "study.db", "pareto/trial-0001.json")
        if (flag, name) != ("--storage", "study.db")  # a search's own study.db is meant to be its storage
    ],
)
def test_search_outputs_never_overwrite_its_inputs(tiny_dirs, tmp_path, capsys, no_model_loads, flag, name):
    out = tmp_path / "out"
    victim = out / name
    victim.parent.mkdir(parents=True)
    victim.write_text('{"prompt": "keep me"}\n')
    spelled = str(tmp_path / "out" / ".." / "out" / name)
    value = {"--data": spelled, "--space": spelled, "--storage": f"sqlite:///{spelled}"}[flag]
    before = snapshot(tmp_path)
    fails_cleanly(
        capsys, search(tiny_dirs, out, flag, value), "destroy" if "pareto" not in name else "lies in"
    )
    assert snapshot(tmp_path) == before


def test_bench_outputs_never_overwrite_its_inputs(tiny_dirs, tmp_path, capsys, no_model_loads):
    out = tmp_path / "b"
    out.mkdir()
    (out / "bench.json").write_text('{"prompt": "keep me"}\n')
    before = snapshot(tmp_path)
    base = ["bench", "--model", tiny_dirs[0], "--out", str(out), "--data"]
    fails_cleanly(
        capsys, [*base, str(out / "bench.json")], "--out's bench.json", "is the same file as --data"
    )
    fails_cleanly(
        capsys, [*base, "builtin", "--profile", f"{out}/./bench.json"], "is the same file as --profile"
    )
    assert snapshot(tmp_path) == before


# The property: for generated commands, an output path that is an input path under any spelling is refused, and
# the input's bytes are unchanged afterwards.
COMMANDS = (
    "export",
    "dashboard",
    "dashboard-out-dir",
    "search-data",
    "search-space",
    "search-storage",
    "bench",
)


def _spell(root: Path, path: Path, how: str) -> str:
    rel = os.path.relpath(path, root)
    if how == "relative":
        return rel
    if how == "dotted":
        return f"./{rel}"
    if how == "parent":
        return str(path.parent / ".." / path.parent.name / path.name)
    if how == "slashes":
        return str(path).replace("/", "//")
    if how == "symlink":
        link = root / f"link-{len(list(root.glob('link-*')))}"
        link.symlink_to(path)
        return str(link)
    return str(path)


@PROPERTY
@given(command=st.sampled_from(COMMANDS), how=st.sampled_from(["plain", "relative", "dotted", "parent", "slashes", "symlink"]))  # fmt: skip
def test_property_an_output_that_is_an_input_is_refused(
    tiny_dirs, tmp_path_factory, monkeypatch, command, how
):
    root = tmp_path_factory.mktemp("clash")
    monkeypatch.chdir(root)
    study = root / "o" / "study.db"
    study.parent.mkdir()
    source, trial = _study_with_trial(DecodeConfig(mode="sd", drafter="lookup").to_dict())
    s = optuna.create_study(
        storage=f"sqlite:///{study}", study_name="run", directions=["maximize", "maximize"]
    )
    s.add_trial(trial)
    victim = {
        "export": study, "dashboard": study, "dashboard-out-dir": study, "search-storage": root / "o" / "profile.json",
        "search-data": root / "o" / "profile.json", "search-space": root / "o" / "dashboard.html",
        "bench": root / "o" / "bench.md",
    }[command]  # fmt: skip
    if not victim.exists():
        victim.write_text('{"prompt": "keep me"}\n')
    as_input, as_output = _spell(root, victim, how), _spell(root, victim, "plain")
    target = tiny_dirs[0]
    argv = {
        "export": ["export", "--storage", f"sqlite:///{as_input}", "--study-name", "run", "--out", as_output],
        "dashboard": ["dashboard", "--storage", f"sqlite:///{as_input}", "--study-name", "run", "--out", as_output],
        "dashboard-out-dir": ["dashboard", "--out-dir", "o", "--out", _spell(root, victim, how)],
        "search-data": search(tiny_dirs, root / "o", "--data", as_input),
        "search-space": search(tiny_dirs, root / "o", "--space", as_input),
        "search-storage": search(tiny_dirs, root / "o", "--storage", f"sqlite:///{as_input}"),
        "bench": ["bench", "--model", target, "--data", as_input, "--out", "o"],
    }[command]  # fmt: skip
    before = victim.read_bytes()
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model was loaded before the refusal"))
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2, argv
    assert victim.read_bytes() == before


# ====================================================================================== 2. secrets printed


PASSWORD = "secretpw-0123"
MALFORMED = [
    f"postgresql//u:{PASSWORD}@127.0.0.1:1/db",  # no ':' after the scheme
    f"tuner:{PASSWORD}@dbhost/optuna",  # no scheme
    f"postgresql:/u:{PASSWORD}@127.0.0.1:1/db",  # one slash
]


def _commands(storage: str, tmp_path: Path, tiny_dirs) -> dict[str, list[str]]:
    return {
        "search": search(tiny_dirs, tmp_path / "out", "--storage", storage),
        "export": ["export", "--storage", storage, "--study-name", "s", "--out", str(tmp_path / "p.json")],
        "dashboard": [
            "dashboard",
            "--storage",
            storage,
            "--study-name",
            "s",
            "--out",
            str(tmp_path / "d.html"),
        ],
    }


@pytest.mark.parametrize("storage", MALFORMED)
@pytest.mark.parametrize("command", ["search", "export", "dashboard"])
def test_a_malformed_storage_string_never_shows_its_password(
    tiny_dirs, tmp_path, capsys, no_model_loads, storage, command
):
    argv = _commands(storage, tmp_path, tiny_dirs)[command]
    err = fails_cleanly(capsys, argv, "is not a storage URL", "***@")
    assert PASSWORD not in err and "secretpw" not in err
    assert snapshot(tmp_path) == {}


@pytest.mark.parametrize("command", ["search", "export", "dashboard"])
def test_an_unescaped_at_or_slash_in_a_password_is_refused_before_any_driver(
    tiny_dirs, tmp_path, capsys, monkeypatch, command
):
    import sqlalchemy

    monkeypatch.setattr(sqlalchemy, "create_engine", lambda *a, **k: pytest.fail("a driver saw the URL"))
    storage = "postgresql://tuner:Sup3r@leakedSecretPart/rest@127.0.0.1:1/db"
    argv = _commands(storage, tmp_path, tiny_dirs)[command]
    err = fails_cleanly(capsys, argv, "unescaped '@' or '/'", "percent-encode it")
    assert (
        "Sup3r" not in err
        and "leakedSecretPart" not in err
        and "postgresql://tuner:***@127.0.0.1:1/db" in err
    )
    assert snapshot(tmp_path) == {}
    with pytest.raises(UserError, match="unescaped"):
        check_storage(storage)
    assert check_storage("postgresql://tuner:Sup3r%40leaked%2Fpart@127.0.0.1:1/db")  # percent-encoded: fine


def test_dashboard_on_postgresql_uses_the_same_driver_as_search_and_export(tmp_path, capsys):
    """It said "Failed to import DB access module" (its own RDBStorage, psycopg 3 assumed)."""
    url = f"postgresql://tuner:{PASSWORD}@127.0.0.1:1/optuna"  # nothing listens on port 1
    argv = ["dashboard", "--storage", url, "--study-name", "s", "--out", str(tmp_path / "d.html")]
    err = fails_cleanly(capsys, argv, "cannot open Optuna storage postgresql://tuner:***@127.0.0.1:1/optuna")
    assert "Failed to import" not in err and PASSWORD not in err and not (tmp_path / "d.html").exists()


@pytest.mark.parametrize(
    "storage, shown",
    [
        ("postgresql://u:pw-secret@h/db", "postgresql://u:***@h/db"),
        ("postgresql//u:pw-secret@h/db", "***@h/db"),
        ("u:pw-secret@h/db", "***@h/db"),
        ("postgresql:/u:pw-secret@h/db", "***@h/db"),
        ("postgresql://u:pw@sec/ret@h:1/db", "postgresql://u:***@h:1/db"),
        ("postgresql://h/db?password=pw-secret", "postgresql://h/db?password=***"),
        ("sqlite:////data/@work/study.db", "sqlite:////data/@work/study.db"),
    ],
)
def test_redact_whatever_the_spelling(storage, shown):
    assert redact(storage) == shown == redact(shown)  # and a redacted string stays as it is


PASSWORDS = st.text(
    alphabet=st.characters(codec="ascii", exclude_characters="\x00\r\n%"), min_size=8, max_size=24
).filter(lambda p: p.strip() == p and len(set(p)) > 3)


@st.composite
def storage_strings(draw, port: int = 1):
    """A storage string holding a generated password, in one of the spellings a user might type."""
    pw = draw(PASSWORDS)
    spelling = draw(st.sampled_from(["encoded", "raw", "no-colon", "no-scheme", "one-slash", "query"]))
    host = f"127.0.0.1:{port}/db"
    storage = {
        "encoded": f"postgresql://tuner:{quote(pw, safe='')}@{host}",
        "raw": f"postgresql://tuner:{pw}@{host}",
        "no-colon": f"postgresql//tuner:{pw}@{host}",
        "no-scheme": f"tuner:{pw}@{host}",
        "one-slash": f"postgresql:/tuner:{pw}@{host}",
        "query": f"postgresql://{host}?user=tuner&password={quote(pw, safe='')}",
    }[spelling]
    return pw, storage


def _leaks(pw: str, texts: list[str]) -> list[str]:
    """The texts that show ``pw`` (as typed, or percent-encoded)."""
    forms = {pw, quote(pw, safe="")}
    return [t for t in texts if any(f in t for f in forms)]


@settings(PROPERTY, max_examples=40)
@given(case=storage_strings(), command=st.sampled_from(["search", "export", "dashboard"]))
def test_property_a_password_never_shows_where_the_storage_is_refused(tiny_dirs, tmp_path_factory, capsys, caplog, monkeypatch, case, command):  # fmt: skip
    pw, storage = case
    root = tmp_path_factory.mktemp("pw")
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(
        "viasd_tune.search.storage.time.sleep", lambda s: None
    )  # no retry pause: nothing listens
    caplog.clear()
    capsys.readouterr()
    try:
        rc = main(_commands(storage, root, tiny_dirs)[command])
    except SystemExit as e:
        rc = e.code
    printed = capsys.readouterr()
    assert rc == 2
    stored = [p.read_text(errors="replace") for p in root.rglob("*") if p.is_file()]
    assert not _leaks(pw, [printed.out, printed.err, caplog.text, *stored])


# A real PostgreSQL server (trust authentication: any password gets in), so the commands succeed and write.
from test_reliability import postgres_url  # noqa: E402, F401  (the fixture)


@pytest.fixture(scope="module")
def pg_study(postgres_url):  # noqa: F811
    """A study on the server with one exportable trial; returns the URL's host part and the study name."""
    source, trial = _study_with_trial(DecodeConfig(mode="sd", gamma=4, drafter="lookup").to_dict())
    name = f"secrets-{os.getpid()}"
    study = optuna.create_study(
        storage=make_storage(postgres_url), study_name=name, directions=["maximize", "maximize"]
    )
    for k, v in {**source.user_attrs, "min_fidelity": 0.9}.items():
        study.set_user_attr(k, v)
    study.add_trial(trial)
    return postgres_url.rsplit("@", 1)[1], name


@pytest.mark.slow
@settings(PROPERTY, max_examples=12)
@given(pw=PASSWORDS, command=st.sampled_from(["export", "dashboard"]))
def test_property_a_password_never_shows_where_the_command_succeeds(pg_study, tmp_path_factory, capsys, caplog, pw, command):  # fmt: skip
    host_part, name = pg_study
    storage = f"postgresql://postgres:{quote(pw, safe='')}@{host_part}"
    root = tmp_path_factory.mktemp("pw-ok")
    out = root / ("p.json" if command == "export" else "d.html")
    caplog.clear()
    capsys.readouterr()
    assert main([command, "--storage", storage, "--study-name", name, "--out", str(out)]) == 0
    printed = capsys.readouterr()
    study = optuna.load_study(study_name=name, storage=make_storage(storage))
    attrs = json.dumps([study.user_attrs, *[t.user_attrs for t in study.trials]], default=str)
    assert not _leaks(pw, [printed.out, printed.err, caplog.text, out.read_text(), attrs])


@pytest.mark.slow
def test_a_search_stores_no_password(postgres_url, tiny_dirs, tmp_path, capsys, caplog, monkeypatch):  # noqa: F811
    """The search itself (study attributes, profile, dashboard, logs) with a password that needs encoding."""
    pw = "s3cr@t/pass-word"
    storage = f"postgresql://postgres:{quote(pw, safe='')}@{postgres_url.rsplit('@', 1)[1]}"
    monkeypatch.setattr(replay, "ReplayCache", _stop_after_the_study_exists)
    argv = search(
        tiny_dirs,
        tmp_path / "out",
        "--storage",
        storage,
        "--study-name",
        f"pw-{os.getpid()}",
        "--prompts",
        "4",
    )
    with pytest.raises(_Stop):
        main(argv)
    study = optuna.load_study(study_name=f"pw-{os.getpid()}", storage=make_storage(storage))
    assert study.user_attrs["storage"].startswith("postgresql://postgres:***@")
    printed = capsys.readouterr()
    assert not _leaks(pw, [printed.out, printed.err, caplog.text, json.dumps(study.user_attrs, default=str)])


class _Stop(Exception):
    pass


def _stop_after_the_study_exists(*args, **kwargs):
    raise _Stop


# ====================================================================================== 3. flags that do nothing


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--mode", "sd", "--recheck"], "recheck (--recheck) applies to mode viasd only"),
        (["--mode", "ar", "--recheck"], "recheck (--recheck) applies to mode viasd only"),
        (["--mode", "sd", "--skip-attn", "1-2", "--tau-escalate", "1"], "skip (--skip-attn/--skip-mlp) applies to mode viasd"),
        (["--mode", "ar", "--gamma", "7", "--drafter", "self", "--draft-skip-attn", "1-2"], "gamma (--gamma) applies to mode sd/viasd"),
        (["--mode", "sd", "--drafter", "lookup", "--draft-confidence", "0.5"], "draft_confidence (--draft-confidence) applies to drafter model/self"),
        (["--mode", "sd", "--drafter", "lookup", "--lookup-min", "5"], "lookup_min (--lookup-min) applies to drafter lookup+model/lookup+self"),
        (["--mode", "ar", "--gamma", "5"], "gamma (--gamma) applies"),  # given at its default value: still nothing
        (["--mode", "viasd", "--drafter", "self", "--draft-skip-attn", "1", "--recheck"], "--draft does nothing"),
        (["--category", "qa"], "--category does nothing here"),
        (["--strict-host"], "--strict-host does nothing without --profile"),
    ],
    ids=["sd-recheck", "ar-recheck", "sd-skip-tau", "ar-gamma-self", "lookup-confidence", "lookup-min", "ar-gamma-default",
         "draft-unused", "category-unrouted", "strict-host-alone"],
)  # fmt: skip
def test_a_flag_that_does_nothing_is_refused(tiny_dirs, capsys, no_model_loads, extra, needle):
    err = fails_cleanly(capsys, gen(tiny_dirs, *extra), needle)
    assert "drop" in err


@pytest.mark.parametrize("extra", [["--top-p", "0.9"], ["--seed", "3"]], ids=["top-p", "seed"])
def test_sampling_flags_at_temperature_zero(tiny_dirs, capsys, no_model_loads, extra):
    """Greedy decoding draws nothing: a top-p or a seed would do nothing there."""
    err = fails_cleanly(capsys, gen(tiny_dirs, *extra), "does nothing at temperature 0", "drop it")
    from viasd_tune.config import check_generation

    with pytest.raises(UserError) as exc:
        check_generation(8, 0.0, *((0.9, None) if extra[0] == "--top-p" else (1.0, 3)))
    assert str(exc.value) == err.removeprefix("viasd-tune: error: ").strip()
    check_generation(8, 0.7, 0.9, 3)  # sampling reads both


def test_the_python_api_and_profiles_refuse_the_same(tmp_path, capsys, no_model_loads):
    err = fails_cleanly(capsys, ["generate", "--model", "m", "--prompt", "hi", "--mode", "sd", "--recheck"])
    with pytest.raises(UserError) as exc:
        DecodeConfig(mode="sd", drafter="lookup", recheck=True)  # what the flags build without --draft
    assert str(exc.value) == err.removeprefix("viasd-tune: error: ").strip()
    profile = {**make_profile(), "mode": "sd"}  # its thresholds, kl and skip set do nothing in plain SD
    with pytest.raises(
        UserError, match=r"invalid profile: these do nothing in mode sd with drafter model: skip"
    ):
        validate_profile(profile)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    fails_cleanly(
        capsys,
        ["generate", "--profile", str(path), "--prompt", "hi"],
        "p.json: invalid profile",
        "tau_escalate",
    )


def test_search_data_field_on_a_named_prompt_set(tiny_dirs, tmp_path, capsys, no_model_loads):
    for data in ("builtin", "humaneval"):
        fails_cleanly(capsys, search(tiny_dirs, tmp_path / "out", "--data", data, "--data-field", "nope"),
                      f"--data-field 'nope' does nothing with --data {data}")  # fmt: skip
    assert snapshot(tmp_path) == {}
    with pytest.raises(UserError, match="does nothing"):
        BenchSettings(out=str(tmp_path / "b"), data="builtin", data_field="x").validate()


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("lookup_min", {"low": 1, "high": 3}, "$.lookup_min does nothing"),
        ("draft_confidence", [0.0, 0.4], "$.draft_confidence does nothing"),
        ("draft_model", {"skip_fraction": {"low": 0.0, "high": 0.3}}, "$.draft_model does nothing"),
        ("self_draft", {"skip_fraction": {"low": 0.3, "high": 0.6}}, "$.self_draft does nothing"),
    ],
)
def test_a_space_key_no_trial_uses_is_refused(tmp_path, key, value, needle):
    import yaml

    doc = yaml.safe_load(spaces.shipped_space_file("smoke").read_text())
    doc.update(drafter=["lookup"], **{key: value})
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(UserError, match=needle.replace("$", r"\$")):
        spaces.load_space(str(path))
    doc = {
        **doc,
        "skip": {**doc["skip"], "budget": {"min": 0.0, "max": 0.0}},
        "drafter": ["model"],
        "recheck": [True],
    }
    path.write_text(yaml.safe_dump({k: v for k, v in doc.items() if k != key}))
    with pytest.raises(UserError, match=r"\$\.recheck does nothing .* and no slim tier"):  # plain SD only
        spaces.load_space(str(path))


def test_search_categories_with_spaces_work_as_in_bench(tiny_dirs, tmp_path, monkeypatch):
    """Issue 32: the two commands built their settings apart, and only bench stripped the names."""
    import viasd_tune.bench.run as bench_run
    import viasd_tune.search.run as search_run

    seen = []
    monkeypatch.setattr(search_run, "run_search", lambda s, dashboard=None: seen.append(s) or {})
    monkeypatch.setattr(bench_run, "run_bench", lambda s, default_model=None: seen.append(s) or pytest.skip())
    assert main(search(tiny_dirs, tmp_path / "o", "--categories", "qa, math_reasoning")) == 0
    assert seen[0].categories == ["qa", "math_reasoning"]
    with pytest.raises(pytest.skip.Exception):
        main(
            ["bench", "--data", "builtin", "--categories", "qa, math_reasoning", "--out", str(tmp_path / "b")]
        )
    assert seen[1].categories == ["qa", "math_reasoning"]


# ====================================================================================== 4. non-finite numbers


@pytest.mark.parametrize("flag", ["--wait-idle", "--foreign-max", "--draft-confidence"])
def test_bench_non_finite_floats_are_refused_where_parsed(tmp_path, capsys, no_model_loads, flag):
    out = tmp_path / "b"
    for value in ("nan", "inf", "-inf"):
        argv = [
            "bench",
            "--data",
            "builtin",
            "--out",
            str(out),
            f"{flag}={value}",
        ]  # "-inf" alone reads as a flag
        fails_cleanly(capsys, argv, f"argument {flag}: {value!r} is not a finite number")
    assert not out.exists()
    with pytest.raises(UserError, match="must be a finite number"):
        BenchSettings(out=str(out), data="builtin", wait_idle=math.nan).validate()


# ====================================================================================== 5. where a profile is served


@pytest.fixture
def tiny_profile(tiny_dirs):
    target = models.load(tiny_dirs[0], "float32", "cpu")
    p = make_profile()
    p["target"] = {"name": tiny_dirs[0], "fingerprint": target.fingerprint}
    p.update(
        mode="sd",
        drafter="lookup",
        draft={"kind": "lookup", "name": None, "fingerprint": None},
        dtype="float32",
    )
    p.update(
        routing={"skip_attn": [], "skip_mlp": []},
        thresholds={"tau_accept": 0.0, "tau_escalate": 0.0, "kl": "forward"},
    )
    return p


@pytest.mark.parametrize("tuned, device", [("amx-bf16", "cpu"), (None, "cuda")], ids=["isa", "device"])
def test_a_profile_served_where_it_was_not_tuned(tiny_profile, tmp_path, capsys, monkeypatch, tuned, device):
    monkeypatch.setattr(host, "cpu_matrix_isa", lambda cpuinfo=None: "avx512-bf16")
    host.matrix_isa.cache_clear()
    p = {**tiny_profile, "device": device}
    if tuned:
        p["provenance"] = {**p["provenance"], "matrix_isa": tuned}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p))
    with pytest.warns(runtime.HostMismatchWarning, match="its tuned speed is not expected to hold here"):
        runtime.load(p)
    with pytest.raises(UserError, match="re-run the search on this host"):
        runtime.load(p, strict_host=True)
    argv = ["generate", "--profile", str(path), "--prompt", "hi", "--max-new-tokens", "2"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and warning[0].startswith("viasd-tune: warning: the profile was tuned on"), err
    assert (tuned or "device cuda") in warning[0]
    fails_cleanly(capsys, [*argv, "--strict-host"], "re-run the search on this host")
    host.matrix_isa.cache_clear()


def test_a_profile_served_where_it_was_tuned_says_nothing(tiny_profile, monkeypatch):
    monkeypatch.setattr(host, "cpu_matrix_isa", lambda cpuinfo=None: "amx-bf16")
    host.matrix_isa.cache_clear()
    p = {**tiny_profile, "provenance": {**tiny_profile["provenance"], "matrix_isa": "amx-bf16"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runtime.load(p, strict_host=True)
    host.matrix_isa.cache_clear()


# ====================================================================================== 6. memory


def test_a_model_larger_than_the_memory_left_is_refused_naming_the_need(tiny_dirs, capsys, monkeypatch):
    monkeypatch.setattr(models, "available_memory", lambda: [("memory", 10_000, False)])
    fails_cleanly(capsys, ["generate", "--model", tiny_dirs[0], "--prompt", "hi", "--dtype", "float32"],
                  "needs about", "GB of memory is available")  # fmt: skip
    files, loaded = models.weights_size(Path(tiny_dirs[0]), models.torch.float32)
    assert loaded > 10_000 and files > 0
    assert models.weights_size(Path(tiny_dirs[0]), models.torch.bfloat16)[1] * 2 == loaded


UNDER_A_LIMIT = r"""
import json, resource, sys
from pathlib import Path
import transformers  # imported before the limit, as a long-running process would have
from viasd_tune import models
from viasd_tune.errors import UserError
folder = Path(sys.argv[1])
# An address-space limit 1 GB above what this process maps now; the weights need 2.1 GB + 1.1 GB mapped.
used = models._proc_kb("/proc/self/status", "VmSize") * 1024
resource.setrlimit(resource.RLIMIT_AS, (used + 2**30, resource.RLIM_INFINITY))
try:
    models.load(str(folder), "float32", "cpu")
except UserError as e:
    print("refused:", e)
"""


def test_under_an_address_space_limit_the_load_is_refused_before_any_mmap(tiny_dirs, tmp_path):
    """The issue's ``ulimit -v 8G`` case, scaled: a 1 GB (sparse) bf16 weight file to load as fp32."""
    folder = tmp_path / "big"
    shutil.copytree(tiny_dirs[0], folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    n = 2**29  # bf16 values: 1.1 GB on disk, 2.1 GB as fp32
    header = json.dumps({"w": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
    with (folder / "model.safetensors").open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + 2 * n)  # sparse: no disk used
    done = subprocess.run([sys.executable, "-c", UNDER_A_LIMIT, str(folder)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)  # fmt: skip
    out = done.stdout + done.stderr
    assert "refused:" in out and "needs about 3.2 GB" in out and "address space (ulimit -v)" in out, out
    assert "Traceback" not in out and "mmap" not in out


@pytest.mark.integration
def test_the_converted_cache_is_bf16_and_versioned(tmp_path, monkeypatch):
    """A GGUF converts to bf16 safetensors (was fp32: 7.1 GB for the 1.5B Qwen) under converted/v2/."""
    monkeypatch.setenv("VIASD_TUNE_CACHE", str(tmp_path))
    lm = models.load("smollm2-135m", "float32", "cpu")
    (folder,) = (tmp_path / "converted").glob("v*/*")
    assert folder.parent.name == f"v{models.CONVERTED_VERSION}"
    dtypes = set()
    for f in folder.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        dtypes |= {t["dtype"] for k, t in header.items() if k != "__metadata__"}
    assert dtypes == {"BF16"}
    assert next(lm.model.parameters()).dtype == models.torch.float32  # loads as asked, upcast


# ====================================================================================== 7. the rest


def test_a_prompt_of_invalid_utf8(tiny_dirs, capsys, no_model_loads):
    raw = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv
    fails_cleanly(capsys, ["generate", "--model", tiny_dirs[0], "--prompt", raw], "not valid UTF-8 text")


def test_a_prompt_of_invalid_utf8_through_the_api(tiny_dirs):
    from viasd_tune.decoding.decoder import Decoder

    lm = models.load(tiny_dirs[0], "float32", "cpu")
    dec = Decoder(lm.model, lm.tokenizer, DecodeConfig(mode="ar"))
    with pytest.raises(UserError, match="not valid UTF-8"):
        dec.generate("a\udcff", max_new_tokens=2)


def test_an_empty_prompt_is_refused_with_or_without_the_chat_template(tiny_dirs, tmp_path, capsys):
    chatty = tmp_path / "chatty"
    shutil.copytree(tiny_dirs[0], chatty)
    config = json.loads((chatty / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"
    (chatty / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (chatty / "chat_template.jinja").write_text(template)
    base = ["generate", "--model", str(chatty), "--mode", "ar", "--max-new-tokens", "2"]
    for chat in ([], ["--chat"]):
        fails_cleanly(capsys, [*base, "--prompt", "", *chat], "the prompt is empty")
    assert main([*base, "--prompt", "hi", "--chat"]) == 0


def test_export_pick_a_negative_trial(study_db, tmp_path, capsys):
    out = tmp_path / "p.json"
    argv = [
        "export",
        "--storage",
        f"sqlite:///{study_db}",
        "--study-name",
        "run",
        "--out",
        str(out),
        "--pick",
    ]
    fails_cleanly(capsys, [*argv, "trial:-1"], "must be a trial number, 0 or more")
    fails_cleanly(capsys, [*argv, "trial:7"], "no trial 7")
    assert not out.exists()
    assert main([*argv, "trial:0"]) == 0 and json.loads(out.read_text())["provenance"]["trial"] == 0


def test_a_rule_on_a_raw_mt_bench_category(capsys):
    profile = make_profile()
    conf = {"name": "plain", **DecodeConfig(mode="ar", drafter="lookup").to_profile()}
    nodes = [{"feature": "category", "in": ["writing"], "left": 1, "right": 2}, {"config": 0}, {"config": 0}]
    profile["routes"] = {"configurations": [conf], "rule": {"nodes": nodes}}
    with pytest.raises(UserError, match="'writing', a raw MT-bench category; a rule reads task groups, where 'writing' is 'conversation'"):  # fmt: skip
        validate_profile(profile)
    nodes[0]["in"] = ["conversation"]
    validate_profile(profile)


def test_a_routed_decoder_refuses_a_category_that_is_not_text(tiny_profile):
    conf = {"name": "plain", **DecodeConfig(mode="ar", drafter="lookup").to_profile()}
    p = {**tiny_profile, "routes": {"configurations": [conf], "rule": {"nodes": [{"config": 0}]}}}
    dec = runtime.load(p)
    with pytest.raises(UserError, match="category must be text"):
        dec.generate("hi", max_new_tokens=2, category=5)
    assert dec.generate("hi", max_new_tokens=2, category="qa").token_ids


def test_a_search_refused_for_its_space_creates_no_study(tiny_dirs, tmp_path, capsys, monkeypatch):
    """The space fits the YAML schema but not this run (its only drafter needs --draft): refused before the
    folder and the study exist, so the corrected re-run with the same --out is not "a different space"."""
    import yaml

    doc = yaml.safe_load(spaces.shipped_space_file("smoke").read_text())
    bad, good = tmp_path / "bad.yaml", tmp_path / "good.yaml"
    bad.write_text(yaml.safe_dump({**doc, "drafter": ["model"]}))
    good.write_text(yaml.safe_dump({**doc, "drafter": ["lookup"]}))
    out = tmp_path / "out"
    argv = [a for a in search(tiny_dirs, out, "--prompts", "4") if a != "--draft" and a != tiny_dirs[1]]
    before = snapshot(tmp_path)
    fails_cleanly(capsys, [*argv, "--space", str(bad)], "none of ['model'] is available")
    assert snapshot(tmp_path) == before and not out.exists()
    monkeypatch.setattr(replay, "ReplayCache", _stop_after_the_study_exists)
    with pytest.raises(_Stop):  # got past the study's signature check, to its first trial's work
        main([*argv, "--space", str(good)])
    assert optuna.load_study(study_name="out", storage=f"sqlite:///{out / 'study.db'}").user_attrs[
        "signature"
    ]


def test_a_refusal_listing_a_too_long_tree_keeps_its_reason():
    profile = make_profile()
    conf = {"name": "plain", **DecodeConfig(mode="ar", drafter="lookup").to_profile()}
    profile["routes"] = {"configurations": [conf], "rule": {"nodes": [{"config": 0}] * 200}}
    with pytest.raises(UserError) as exc:
        validate_profile(profile)
    assert "a list of 200 items is too long (maxItems 127)" in str(exc.value), exc.value
    profile["routes"] = {"configurations": [conf] * 20, "rule": {"nodes": [{"config": 0}]}}
    with pytest.raises(UserError, match=r"a list of 20 items is too long \(maxItems 16\)"):
        validate_profile(profile)


def test_bench_draft_confidence_with_nothing_to_stop(tmp_path):
    with pytest.raises(UserError, match="draft_confidence .* applies to drafter model"):
        BenchSettings(out=str(tmp_path / "b"), data="builtin", draft_confidence=0.4).validate()  # no --draft
    with pytest.raises(UserError, match="applies to method sd only"):
        BenchSettings(
            out=str(tmp_path / "b"), data="builtin", draft="d", draft_confidence=0.4, methods=["ar"]
        ).validate()


def test_bench_gamma_with_no_method_that_reads_it(tmp_path):
    with pytest.raises(UserError, match="--gamma 4 does nothing here"):
        BenchSettings(out=str(tmp_path / "b"), data="builtin", gamma=4, methods=["ar", "hf"]).validate()
    BenchSettings(out=str(tmp_path / "b"), data="builtin", gamma=4, methods=["ar", "hf-lookup"]).validate()


def test_skip_sets_are_refused_where_they_do_nothing_in_the_api():
    with pytest.raises(UserError, match="draft_skip .* applies to drafter model/self"):
        DecodeConfig(mode="sd", drafter="lookup", draft_skip=SkipSet.of([1]))


# ====================================================================================== nothing on disk changed


def _refused(root: Path, tiny_dirs) -> list[list[str]]:
    """One refused command per class above, all pointed at ``root``'s study and files."""
    db, out = root / "s.db", root / "o"
    storage = f"sqlite:///{db}"
    return [
        ["export", "--storage", storage, "--study-name", "run", "--out", str(db)],
        [
            "export",
            "--storage",
            storage,
            "--study-name",
            "run",
            "--out",
            str(root / "p.json"),
            "--pick",
            "trial:-1",
        ],
        ["dashboard", "--storage", storage, "--study-name", "run", "--out", f"{root}/./s.db"],
        ["dashboard", "--storage", f"tuner:{PASSWORD}@h/db", "--study-name", "run"],
        search(tiny_dirs, out, "--storage", storage, "--data", "builtin", "--data-field", "x"),
        search(tiny_dirs, out, "--storage", storage, "--data", str(out / "profile.json")),
        search(tiny_dirs, out, "--storage", "postgresql://u:p@ss@127.0.0.1:1/db"),
        search(tiny_dirs, out, "--storage", storage, "--held-out", "nan"),
        ["bench", "--data", "builtin", "--out", str(out), "--foreign-max", "nan"],
        gen(tiny_dirs, "--mode", "sd", "--recheck"),
    ]


def test_every_refusal_leaves_files_and_storage_as_they_were(study_db, tiny_dirs, tmp_path, capsys):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "profile.json").write_text('{"prompt": "keep me"}\n')
    study = optuna.load_study(study_name="run", storage=f"sqlite:///{study_db}")
    stored = (study.user_attrs, [(t.state, t.params, t.user_attrs) for t in study.trials])
    before = snapshot(tmp_path)
    for argv in _refused(tmp_path, tiny_dirs):
        fails_cleanly(capsys, argv)
        assert snapshot(tmp_path) == before, argv
    assert optuna.get_all_study_names(f"sqlite:///{study_db}") == ["run"]
    study = optuna.load_study(study_name="run", storage=f"sqlite:///{study_db}")
    assert (study.user_attrs, [(t.state, t.params, t.user_attrs) for t in study.trials]) == stored

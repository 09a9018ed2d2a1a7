"""Issue 14, "bad input, round two": each of the 16 reproductions and the smaller ones, as regression tests.

Each refusal is exit code 2 with one line on stderr, before any model loads or any study (or output folder)
is created; the Python API raises the same :class:`UserError` with the same message.
"""

from __future__ import annotations

import json
import math
import shutil
import time

import optuna
import pytest
from test_bad_input import fails_cleanly, gen, search
from test_profile import make_profile

from viasd_tune import models, runtime
from viasd_tune.cli import main
from viasd_tune.config import DecodeConfig, check_generation
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.errors import UserError
from viasd_tune.routing import SkipSet
from viasd_tune.search import params
from viasd_tune.search import space as spaces
from viasd_tune.search.records import TrialRecord
from viasd_tune.search.run import SearchSettings

SMOKE = spaces.shipped_space_file("smoke")


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything loads a model: these refusals must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad value was refused")

    monkeypatch.setattr(models, "load", refuse)


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _line(err: str) -> str:
    return err.removeprefix("viasd-tune: error: ").rstrip("\n")


# ------------------------------------------------------------------ 1. a profile nested 100,000 levels deep


def test_01_deeply_nested_profile(tmp_path, capsys, no_model_loads):
    path = _write(tmp_path, "deep.json", "[" * 100_000 + "]" * 100_000)
    err = fails_cleanly(capsys, ["generate", "--profile", path, "--prompt", "hi"], "nests deeper than")
    with pytest.raises(UserError) as exc:
        runtime.load(path)
    assert str(exc.value) == _line(err)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(UserError, match="nests deeper than"):
        runtime.load({**make_profile(), "metrics": {"x": deep}})


def test_01_oversized_profile(tmp_path, capsys, no_model_loads):
    path = _write(tmp_path, "big.json", json.dumps({**make_profile(), "pad": "x" * (2 << 20)}))
    fails_cleanly(capsys, ["generate", "--profile", path, "--prompt", "hi"], "a profile is a few kB")


# ------------------------------------------------------------------ 2, 10, 8: numbers of generate


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--temperature", "nan"], "argument --temperature: 'nan' is not a finite number"),
        (["--temperature", "inf"], "argument --temperature: 'inf' is not a finite number"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "nan"], "argument --top-p: 'nan' is not a finite number"),
        (["--top-p", "0"], "top_p"),
        (["--max-new-tokens", "0"], "max_new_tokens (--max-new-tokens) must be from 1"),
        (["--max-new-tokens", "1000000000000"], "max_new_tokens"),
        (["--seed", "-1"], "seed (--seed)"),
        (["--tau-escalate", "nan"], "argument --tau-escalate: 'nan' is not a finite number"),
        (["--tau-accept", "inf", "--tau-escalate", "inf"], "argument --tau-accept: 'inf' is not a finite number"),
        (["--draft-confidence", "nan"], "argument --draft-confidence: 'nan' is not a finite number"),
        (
            ["--mode", "sd", "--drafter", "self", "--draft-skip-attn", "1-2", "--gamma", "1000000000"],
            "gamma must be from 1 to 64",
        ),
        (["--gamma", "0"], "gamma must be from 1 to 64"),
    ],
    ids=[
        "temperature-nan", "temperature-inf", "temperature-negative", "top-p-nan", "top-p-zero",
        "max-new-tokens-zero", "max-new-tokens-huge", "seed-negative", "tau-escalate-nan", "tau-inf",
        "draft-confidence-nan", "gamma-1e9", "gamma-zero",
    ],
)  # fmt: skip
def test_02_08_10_bad_numbers_before_any_model_loads(tiny_dirs, capsys, no_model_loads, extra, needle):
    fails_cleanly(capsys, gen(tiny_dirs, *extra), needle)


# ------------------------------------------------------------------ 3, 15: index ranges


def test_03_huge_range_is_refused_before_it_is_expanded(tiny_dirs, capsys, no_model_loads):
    start = time.perf_counter()
    fails_cleanly(capsys, gen(tiny_dirs, "--skip-attn", "0-1000000000"), "--skip-attn", "out of range")
    fails_cleanly(capsys, gen(tiny_dirs, "--draft-skip-mlp", "0-10000000"), "--draft-skip-mlp", "out of range")
    assert time.perf_counter() - start < 2


def test_15_reversed_range_is_an_error(tiny_dirs, capsys, no_model_loads):
    fails_cleanly(capsys, gen(tiny_dirs, "--skip-attn", "5-3"), "the range 5-3 is reversed")
    with pytest.raises(UserError, match="reversed"):
        SkipSet.parse("5-3", "")
    assert SkipSet.parse("3-5", "1,2").attn == {3, 4, 5}  # the legitimate form still works


# ------------------------------------------------------------------ 4, 5, 6: storage URL and output paths


def test_04_storage_that_is_not_a_url(tiny_dirs, tmp_path, capsys, no_model_loads):
    out = tmp_path / "out"
    fails_cleanly(capsys, search(tiny_dirs, out, "--storage", "notaurl"), "is not a storage URL")
    assert not out.exists()
    argv = ["export", "--storage", "notaurl", "--study-name", "s", "--out", str(tmp_path / "p.json")]
    fails_cleanly(capsys, argv, "is not a storage URL")


def test_05_search_out_is_a_file(tiny_dirs, tmp_path, capsys, no_model_loads):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    fails_cleanly(capsys, search(tiny_dirs, afile), "is a file, not a folder")
    assert afile.read_text() == "keep me"


def test_06_export_out_is_a_directory(tmp_path, capsys):
    db = tmp_path / "study.db"
    optuna.create_study(storage=f"sqlite:///{db}", study_name="s")
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    argv = ["export", "--storage", f"sqlite:///{db}", "--study-name", "s", "--out", str(outdir)]
    fails_cleanly(capsys, argv, "is a folder")
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv[-1] = str(afile / "p.json")
    fails_cleanly(capsys, argv, "is a file, not a folder")
    fails_cleanly(capsys, ["dashboard", "--out-dir", str(tmp_path), "--out", str(outdir)], "is a folder")


# ------------------------------------------------------------------ 7, 9: hostile search spaces


def _alias_bomb(levels: int = 10) -> str:
    smoke = SMOKE.read_text()
    lines = ["a0: &a0 [forward, forward, forward, forward, forward, forward, forward, forward, forward, forward]"]
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * 10)
        lines.append(f"a{i}: &a{i} [{refs}]")
    body = smoke.replace("kl: [forward, js]", f"kl: *a{levels - 1}")
    return "x_anchors:\n" + "\n".join("  " + line for line in lines) + "\n" + body


def test_07_yaml_alias_bomb(tiny_dirs, tmp_path, capsys, no_model_loads):
    path = _write(tmp_path, "bomb.yaml", _alias_bomb())
    assert len(_alias_bomb()) < 2000
    start = time.perf_counter()
    fails_cleanly(capsys, search(tiny_dirs, tmp_path / "out", "--space", path), "more than 10000 values")
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "out").exists()
    recursive = _write(tmp_path, "loop.yaml", "a: &a [*a]\n" + SMOKE.read_text())
    with pytest.raises(UserError, match="more than 10000 values"):
        spaces.load_space(recursive)


@pytest.mark.parametrize(
    "old, new",
    [
        ("tau_escalate: {low: 0.05,", "tau_escalate: {low: .nan,"),
        ("high: 20.0, log: true}", "high: .inf, log: true}"),
        ("budget: {min: 0.0, max: 0.3}", "budget: {min: .nan, max: 0.3}"),
    ],
    ids=["tau-nan", "tau-inf", "budget-nan"],
)
def test_09_nan_bounds_in_a_space(tiny_dirs, tmp_path, capsys, no_model_loads, old, new):
    text = SMOKE.read_text()
    assert old in text
    path = _write(tmp_path, "nan.yaml", text.replace(old, new))
    err = fails_cleanly(capsys, search(tiny_dirs, tmp_path / "out", "--space", path), "search space")
    assert "finite" in err or "must be" in err, err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ 11, 12, 13: search settings


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--n-jobs", "0"], "--n-jobs must be at least 1"),
        (["--n-jobs", "-2"], "--n-jobs must be at least 1"),
        (["--timeout", "-5"], "--timeout must be a number of seconds > 0"),
        (["--timeout", "nan"], "argument --timeout: 'nan' is not a finite number"),
        (["--max-new-tokens", "0"], "max_new_tokens (--max-new-tokens) must be from 1"),
        (["--trials", "0"], "trials (--trials) must be from 1"),
        (["--prompts", "0"], "prompts (--prompts) must be from 1"),
        (["--held-out", "nan"], "argument --held-out: 'nan' is not a finite number"),
        (["--held-out", "1"], "held_out (--held-out) must be in [0, 1)"),
        (["--min-fidelity", "nan"], "argument --min-fidelity: 'nan' is not a finite number"),
        (["--min-fidelity", "0"], "--min-fidelity must be in (0, 1]"),
        (["--seed", "-1"], "seed (--seed)"),
        (["--study-name", " "], "--study-name must be a non-empty name"),
    ],
    ids=[
        "n-jobs-0", "n-jobs-neg", "timeout-neg", "timeout-nan", "max-new-tokens-0", "trials-0", "prompts-0",
        "held-out-nan", "held-out-1", "min-fidelity-nan", "min-fidelity-0", "seed-neg", "study-name-blank",
    ],
)  # fmt: skip
def test_11_12_13_bad_search_settings_create_nothing(tiny_dirs, tmp_path, capsys, no_model_loads, extra, needle):
    out = tmp_path / "out"
    fails_cleanly(capsys, search(tiny_dirs, out, *extra), needle)
    assert not out.exists()  # no folder, no study: the corrected rerun is not refused


def test_13_corrected_rerun_after_a_refused_max_new_tokens(tiny_dirs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    fails_cleanly(capsys, search(tiny_dirs, out, "--max-new-tokens", "0"), "max_new_tokens")
    import viasd_tune.search.run as run

    seen = []
    monkeypatch.setattr(run, "run_search", lambda s, dashboard=None: seen.append(s) or {})
    assert main(search(tiny_dirs, out, "--max-new-tokens", "4")) == 0 and seen[0].max_new_tokens == 4


def test_search_settings_from_python_raise_the_same_message(tiny_dirs, tmp_path, capsys):
    err = fails_cleanly(capsys, search(tiny_dirs, tmp_path / "o", "--timeout", "-5"), "--timeout")
    with pytest.raises(UserError) as exc:
        SearchSettings(model=tiny_dirs[0], out=str(tmp_path / "o"), timeout=-5)
    assert str(exc.value) == _line(err)
    with pytest.raises(UserError, match="trials"):
        SearchSettings(model="m", trials="4")


# ------------------------------------------------------------------ 14: --profile plus routing flags


def test_14_profile_with_routing_flags_is_an_error(tmp_path, capsys, no_model_loads):
    path = _write(tmp_path, "p.json", json.dumps(make_profile()))
    argv = ["generate", "--profile", path, "--prompt", "hi", "--gamma", "0", "--skip-attn", "100",
            "--tau-escalate", "-1", "--mode", "ar"]  # fmt: skip
    err = fails_cleanly(capsys, argv, "--mode, --gamma, --skip-attn, --tau-escalate cannot be combined with --profile")
    assert err.count("\n") == 1
    for flag, value in [("--recheck", None), ("--kl", "js"), ("--drafter", "lookup"), ("--draft-confidence", "0")]:
        extra = [flag] if value is None else [flag, value]
        fails_cleanly(capsys, ["generate", "--profile", path, "--prompt", "hi", *extra], f"{flag} cannot be combined")


def test_14_flags_without_a_profile_keep_their_defaults(tiny_dirs, capsys):
    assert main(gen(tiny_dirs, "--json", "--max-new-tokens", "3")) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert config["gamma"] == 5 and config["mode"] == "viasd" and config["kl"] == "forward"
    assert config["tau_escalate"] == 0.0 and config["recheck"] is False and config["drafter"] == "model"


# ------------------------------------------------------------------ 16: Ctrl-C during a reference trial


def test_16_interrupted_reference_trial_is_enqueued_again_on_resume():
    space = spaces.load_space("smoke")
    drafters = ["self", "lookup"]
    study = optuna.create_study(directions=["maximize", "maximize"])
    params.enqueue_known_points(study, space, 4, drafters)
    known = params.known_points(space, 4, drafters)
    assert len(study.trials) == len(known)

    def interrupted(trial):
        params.suggest(trial, space, 4, drafters)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        study.optimize(interrupted, n_trials=1)
    TS = optuna.trial.TrialState
    assert study.trials[0].state == TS.FAIL
    params.enqueue_known_points(study, space, 4, drafters)  # the resume
    waiting = [TrialRecord.read(t).enqueued for t in study.trials if t.state == TS.WAITING]
    assert sorted(map(json.dumps, waiting)) == sorted(map(json.dumps, known))  # the failed one is back
    params.enqueue_known_points(study, space, 4, drafters)  # and a second resume adds nothing
    assert sum(t.state == TS.WAITING for t in study.trials) == len(known)


# ------------------------------------------------------------------ the smaller ones


def test_model_folder_without_a_tokenizer(tiny_dirs, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_dirs[0], bare)
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            f.unlink()
    err = fails_cleanly(capsys, ["generate", "--model", str(bare), "--prompt", "hi"], "has no tokenizer")
    assert "copy the tokenizer files" in err and not err.rstrip().endswith(":")


def test_fingerprint_mismatch_tells_cli_users_what_they_can_do(tiny_dirs, tmp_path, capsys):
    other = make_profile()
    other["target"]["name"] = tiny_dirs[0]
    other.update(drafter="lookup", draft={"kind": "lookup", "name": None, "fingerprint": None})
    path = _write(tmp_path, "p.json", json.dumps(other))
    err = fails_cleanly(capsys, ["generate", "--profile", path, "--prompt", "hi"], "--model/--draft")
    assert "pass strict=False" not in err


@pytest.mark.parametrize("value", [5, 1.5, {"a": 1}, True])
def test_non_string_prompt_in_a_data_file(tiny_dirs, tmp_path, capsys, no_model_loads, value):
    data = _write(tmp_path, "d.jsonl", json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": value}) + "\n")
    err = fails_cleanly(capsys, search(tiny_dirs, tmp_path / "out", "--data", data, "--prompts", "2"), "row 2")
    assert "not text" in err


@pytest.fixture(scope="module")
def tiny_decoder(tiny_dirs):
    target = models.load(tiny_dirs[0], "float32", "cpu")
    return Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar"))


@pytest.mark.parametrize(
    "prompt, kwargs, needle",
    [
        (None, {}, "the prompt must be text"),
        (5, {}, "the prompt must be text"),
        ([1, "a"], {}, "the prompt must be text"),
        ([10**9], {}, "token ids must be in"),
        ("hi", {"max_new_tokens": "4"}, "max_new_tokens (--max-new-tokens) must be a whole number"),
        ("hi", {"max_new_tokens": 4.0}, "max_new_tokens"),
        ("hi", {"temperature": math.nan}, "temperature"),
        ("hi", {"temperature": math.inf}, "temperature"),
        ("hi", {"top_p": math.nan}, "top_p"),
        ("hi", {"temperature": "0.5"}, "temperature must be a number"),
        ("hi", {"seed": 1.5}, "seed"),
    ],
)
def test_decoder_generate_raises_user_error(tiny_decoder, prompt, kwargs, needle):
    with pytest.raises(UserError) as exc:
        tiny_decoder.generate(prompt, **kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_python_api_and_cli_say_the_same(tiny_dirs, tiny_decoder, capsys, no_model_loads):
    err = fails_cleanly(capsys, gen(tiny_dirs, "--temperature", "-1"))
    with pytest.raises(UserError) as exc:
        tiny_decoder.generate("hi", temperature=-1.0)
    assert str(exc.value) == _line(err)
    with pytest.raises(UserError) as exc:
        check_generation(128, -1.0)
    assert str(exc.value) == _line(err)
    err = fails_cleanly(capsys, gen(tiny_dirs, "--gamma", "1000000000"))
    with pytest.raises(UserError) as exc:
        DecodeConfig(gamma=1_000_000_000)
    assert str(exc.value) == _line(err)


def test_usage_errors_are_one_line_too(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hi", "--gamma", "many"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--gamma" in err and "error" in err, err

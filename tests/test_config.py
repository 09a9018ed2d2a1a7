"""The one decoding configuration: validation where it is built, its profile and record mappings, and the CLI
refusing bad values before any model loads."""

from __future__ import annotations

import copy
import json
import math

import optuna
import pytest
from test_bad_input import fails_cleanly
from test_profile import make_profile

from viasd_tune import config as config_module
from viasd_tune import models, runtime
from viasd_tune.cli import main
from viasd_tune.config import DRAFTERS, GAMMA_MAX, KL_KINDS, MODES, DecodeConfig
from viasd_tune.errors import UserError
from viasd_tune.profile import validate_profile
from viasd_tune.routing import SkipSet
from viasd_tune.search.export import build_profile

# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        ({"mode": "warp"}, ["unknown mode 'warp'", "use one of ar, sd, viasd"]),
        ({"drafter": "oracle"}, ["unknown drafter 'oracle'", "model, self, lookup"]),
        ({"kl": "hellinger"}, ["unknown kl 'hellinger'", "forward, reverse, js", "--kl"]),
        ({"gamma": 0}, ["gamma must be from 1 to 64 (got 0)", "--gamma"]),
        ({"gamma": 1_000_000_000}, ["gamma must be from 1 to 64"]),
        ({"gamma": GAMMA_MAX + 1}, [f"(got {GAMMA_MAX + 1})"]),
        ({"gamma": 2.5}, ["gamma must be a whole number"]),
        ({"gamma": True}, ["gamma must be a whole number"]),
        ({"tau_escalate": math.nan}, ["thresholds must be >= 0 and finite", "tau_escalate (--tau-escalate) is nan"]),
        ({"tau_escalate": math.inf}, ["tau_escalate (--tau-escalate) is inf", "set it to a number"]),
        ({"tau_accept": -0.5, "tau_escalate": 1.0}, ["thresholds must be >= 0", "tau_accept (--tau-accept) is -0.5"]),
        ({"tau_accept": "0.1"}, ["tau_accept must be a number"]),
        ({"tau_accept": 2.0, "tau_escalate": 1.0}, ["tau_accept (2.0) is above tau_escalate (1.0)", "must be <="]),
        ({"draft_confidence": 1.0}, ["draft_confidence (--draft-confidence) must be in [0, 1) (got 1.0)", "0 turns it off"]),
        ({"draft_confidence": -0.1}, ["must be in [0, 1) (got -0.1)"]),
        ({"draft_confidence": math.nan}, ["must be in [0, 1) (got nan)"]),
        ({"recheck": "yes"}, ["recheck must be true or false (got 'yes')"]),
        ({"recheck": 1}, ["recheck must be true or false"]),
        ({"skip": [1, 2]}, ["skip must be a SkipSet", "SkipSet.of"]),
        ({"draft_skip": {"attn": [1]}}, ["draft_skip must be a SkipSet", "--draft-skip-attn"]),
    ],
)  # fmt: skip
def test_bad_fields_are_refused_where_the_config_is_built(kwargs, needles):
    with pytest.raises(UserError) as err:
        DecodeConfig(**kwargs)
    msg = str(err.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_every_mode_is_validated_and_values_are_normalised():
    with pytest.raises(UserError, match="gamma"):
        DecodeConfig(mode="ar", gamma=0)  # ignored by ar, but still a bad value
    cfg = DecodeConfig(gamma=3, tau_accept=0, tau_escalate=1, draft_confidence=0)
    assert (type(cfg.tau_accept), type(cfg.tau_escalate), type(cfg.draft_confidence)) == (float, float, float)
    assert DecodeConfig(draft_confidence=0.999).draft_confidence == 0.999


def test_constants_are_defined_once():
    from viasd_tune.decoding import decoder
    from viasd_tune.search import space

    assert decoder.DecodeConfig is DecodeConfig  # bench and older code import it from there
    assert (decoder.MODES, decoder.DRAFTERS, decoder.KL_KINDS) == (MODES, DRAFTERS, KL_KINDS)
    assert space.DRAFTERS is DRAFTERS and space.KL_KINDS is KL_KINDS
    assert not hasattr(space, "TrialConfig")


def test_validate_checks_the_models():
    # the target's layers index the slim verifier's and the self-draft's skip sets
    with pytest.raises(UserError, match="attention skip index 4 is out of range: the model has 4 layers"):
        DecodeConfig(skip=SkipSet.of([4]), drafter="lookup").validate(4, None)
    with pytest.raises(UserError, match="self-draft needs a skip set"):
        DecodeConfig(mode="sd", drafter="self").validate(4, None)
    with pytest.raises(UserError, match="MLP skip index 6"):
        DecodeConfig(mode="sd", drafter="self", draft_skip=SkipSet.of([], [6])).validate(4, None)
    # a skip set on the separate draft model is checked against the draft's layer count
    on_draft = DecodeConfig(mode="sd", drafter="model", draft_skip=SkipSet.of([3]))
    assert on_draft.validate(0, 4) is on_draft
    with pytest.raises(UserError, match="the model has 2 layers"):
        on_draft.validate(30, 2)
    with pytest.raises(UserError, match="drafter 'model' needs a draft model; pass --draft"):
        on_draft.validate(30, None)
    with pytest.raises(TypeError, match="not a bool"):
        on_draft.validate(30, True)
    assert DecodeConfig(mode="ar").validate(0, None).mode == "ar"  # ar needs no draft


def test_decoder_checks_the_draft_models_layers(llama_pair):
    from viasd_tune.decoding.decoder import Decoder

    target, draft = llama_pair  # 4 and 2 layers
    Decoder(
        target, None, DecodeConfig(mode="sd", gamma=2, draft_skip=SkipSet.of([1])), draft=draft, eos=set()
    )
    with pytest.raises(UserError, match="the model has 2 layers"):
        Decoder(target, None, DecodeConfig(mode="sd", draft_skip=SkipSet.of([3])), draft=draft, eos=set())


# ------------------------------------------------------------------------------------------------ profile


def _profile_of(cfg: DecodeConfig) -> dict:
    """make_profile()'s models and evidence with ``cfg``'s decoding fields (target 28 layers, draft 24)."""
    p = make_profile()
    fields = cfg.to_profile()
    draft = fields.pop("draft")
    p["draft"] = (
        {**p["draft"], **draft} if cfg.drafter == "model" else {"name": None, "fingerprint": None, **draft}
    )
    p.update(fields)
    return p


@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig(recheck=True, draft_confidence=0.4, skip=SkipSet.of([3], [5, 7]), tau_accept=0.1, tau_escalate=0.6),
        DecodeConfig(mode="sd", gamma=GAMMA_MAX, drafter="model", draft_skip=SkipSet.of([2, 20], [23])),
        DecodeConfig(mode="sd", drafter="self", draft_skip=SkipSet.of([1, 2], [3]), draft_confidence=0.0),
        DecodeConfig(mode="ar", drafter="lookup"),
        DecodeConfig(drafter="lookup", kl="js", tau_escalate=2.5, recheck=True),
    ],
    ids=["viasd-recheck", "sd-draft-model-skip", "sd-self", "ar", "viasd-lookup"],
)  # fmt: skip
def test_profile_round_trip(cfg, tmp_path):
    p = _profile_of(cfg)
    validate_profile(p)
    assert (p["mode"], p["recheck"], p["draft_confidence"]) == (cfg.mode, cfg.recheck, cfg.draft_confidence)
    assert DecodeConfig.from_profile(p) == cfg
    path = tmp_path / "p.json"
    path.write_text(json.dumps(p))
    assert DecodeConfig.from_profile(json.loads(path.read_text())) == cfg
    if cfg.drafter == "lookup":
        assert set(p["draft"]) == {"kind", "name", "fingerprint"}  # lookup has no skip set to write


def test_a_profile_from_before_the_new_fields_reads_as_today():
    p = make_profile()
    assert not {"mode", "recheck", "draft_confidence"} & set(p)
    validate_profile(p)
    cfg = DecodeConfig.from_profile(p)
    assert (cfg.mode, cfg.recheck, cfg.draft_confidence) == ("viasd", False, 0.0)
    assert cfg == DecodeConfig(
        gamma=4, skip=SkipSet.of([3, 7, 11], [5]), tau_accept=0.1, tau_escalate=0.6, kl="js"
    )


@pytest.mark.parametrize(
    "field, value, path",
    [
        ("mode", "warp", "$.mode"),
        ("recheck", "yes", "$.recheck"),
        ("draft_confidence", 1, "$.draft_confidence"),
        ("draft_confidence", -0.5, "$.draft_confidence"),
        ("gamma", GAMMA_MAX + 1, "$.gamma"),
    ],
)
def test_the_schema_refuses_bad_new_fields(field, value, path):
    p = make_profile()
    p[field] = value
    with pytest.raises(UserError, match=rf"invalid profile at \{path}:"):
        validate_profile(p)


def test_profile_draft_skip_sets_follow_the_drafter():
    p = make_profile()  # a draft model with 24 layers, a target with 28
    p["draft"]["skip_mlp"] = [23]
    validate_profile(p)
    p["draft"]["skip_mlp"] = [25]
    with pytest.raises(UserError, match=r"\$\.draft\.skip_mlp: layer 25 is out of range; the draft has 24"):
        validate_profile(p)
    p.update(drafter="lookup", draft={"kind": "lookup", "name": None, "fingerprint": None, "skip_attn": [1]})
    with pytest.raises(UserError, match=r"\$\.draft\.skip_attn: drafter .lookup. runs no model"):
        validate_profile(p)


def test_runtime_refuses_a_bad_profile_before_loading_models(monkeypatch):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    p = make_profile()
    p["drafter"], p["draft"] = "self", {"kind": "self", "name": None, "fingerprint": None}  # no skip set
    with pytest.raises(UserError, match="self-draft needs a skip set"):
        runtime.load(p)
    p = make_profile()
    p["routing"] = {"skip_attn": list(range(28)), "skip_mlp": list(range(28))}
    with pytest.raises(UserError, match="removes every sub-layer"):
        runtime.load(p)


# ------------------------------------------------------------------------------------------------ record


def test_record_round_trip_and_older_records():
    cfg = DecodeConfig(
        mode="sd",
        gamma=3,
        drafter="self",
        draft_skip=SkipSet.of([2], [1, 3]),
        draft_confidence=0.3,
    )
    record = cfg.to_dict()
    assert json.loads(json.dumps(record)) == record
    assert record["draft_skip_mlp"] == [1, 3] and record["skip_attn"] == []
    assert DecodeConfig.from_dict(record) == cfg
    # a trial recorded by an older search (the TrialConfig fields only) is VIA-SD with the new fields off
    old = {"skip_attn": [1], "skip_mlp": [], "tau_accept": 0.1, "tau_escalate": 0.5, "kl": "js", "gamma": 4,
           "drafter": "lookup", "draft_skip_attn": [], "draft_skip_mlp": []}  # fmt: skip
    assert DecodeConfig.from_dict(old) == DecodeConfig(
        gamma=4, drafter="lookup", skip=SkipSet.of([1]), tau_accept=0.1, tau_escalate=0.5, kl="js"
    )
    # an older search stored the space's first kl (and other idle values) on plain-SD trials: read, not refused
    old_sd = {**cfg.to_dict(), "kl": "js", "tau_escalate": 0.0, "recheck": True}
    assert DecodeConfig.from_dict(old_sd) == cfg


def _study_with_trial(config: dict) -> tuple[optuna.Study, optuna.trial.FrozenTrial]:
    p = make_profile()
    study = optuna.create_study(directions=["maximize", "maximize"])
    attrs = {
        "target": p["target"]["name"],
        "target_fingerprint": p["target"]["fingerprint"],
        "draft": p["draft"]["name"],
        "draft_fingerprint": p["draft"]["fingerprint"],
        "dtype": "float32",
        "device": "cpu",
        "calibration": {**p["calibration"], "held_out_ids": []},
        "storage": "sqlite:///study.db",
    }
    for k, v in attrs.items():
        study.set_user_attr(k, v)
    trial = optuna.trial.create_trial(
        values=[1.1, 2.0],
        user_attrs={"config": config, "fidelity": 1.0, "measured": True, "feasible": True},
    )
    study.add_trial(trial)
    return study, study.trials[0]


@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig(gamma=4, skip=SkipSet.of([2], [3]), tau_accept=0.1, tau_escalate=0.5, kl="reverse"),
        DecodeConfig(gamma=4, drafter="self", draft_skip=SkipSet.of([5, 9], [5, 9]), recheck=True),
        DecodeConfig(
            mode="sd", gamma=6, drafter="lookup+self", draft_skip=SkipSet.of([1]), draft_confidence=0.25
        ),
    ],
)
def test_export_writes_the_trials_configuration(cfg):
    study, trial = _study_with_trial(cfg.to_dict())
    profile = validate_profile(build_profile(study, trial))
    assert DecodeConfig.from_profile(profile) == cfg
    assert profile["draft"]["kind"] == cfg.drafter
    assert (profile["draft"]["name"] is None) == (cfg.drafter != "model")


def test_export_reads_an_older_trials_record():
    old = {"skip_attn": [], "skip_mlp": [4], "tau_accept": 0.0, "tau_escalate": 0.0, "kl": "forward",
           "gamma": 4, "drafter": "model", "draft_skip_attn": [], "draft_skip_mlp": []}  # fmt: skip
    study, trial = _study_with_trial(copy.deepcopy(old))
    profile = validate_profile(build_profile(study, trial))
    assert (profile["mode"], profile["recheck"], profile["draft_confidence"]) == ("viasd", False, 0.0)
    assert "skip_attn" not in profile["draft"]  # a draft model without a skip set writes none
    assert profile["routing"] == {"skip_attn": [], "skip_mlp": [4]}


# ------------------------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--gamma", "0"], "gamma must be from 1 to 64"),
        (["--gamma", "1000000000"], "gamma must be from 1 to 64"),
        (["--tau-escalate", "nan"], "argument --tau-escalate: 'nan' is not a finite number"),
        (
            ["--tau-accept", "inf", "--tau-escalate", "inf"],
            "argument --tau-accept: 'inf' is not a finite number",
        ),
        (["--tau-accept", "2", "--tau-escalate", "1"], "tau_accept (2.0) is above tau_escalate (1.0)"),
        (["--draft-confidence", "1"], "draft_confidence (--draft-confidence) must be in [0, 1)"),
        (["--draft-confidence", "nan"], "argument --draft-confidence: 'nan' is not a finite number"),
        (["--mode", "ar", "--gamma", "-3"], "gamma must be from 1 to 64"),
        (["--tree-nodes", "65"], "tree_nodes (--tree-nodes) must be a whole number from 0 to 64"),
        (["--mode", "viasd", "--tree-nodes", "8"], "mode viasd verifies chains only"),
        (["--mode", "viasd", "--drafter", "lookup+recycle"], "mode viasd verifies chains only"),
        (
            ["--mode", "sd", "--drafter", "lookup+self", "--draft-skip-mlp", "1", "--tree-nodes", "4"],
            "does not build token trees",
        ),
        (["--mode", "sd", "--drafter", "recycle", "--tree-recycle-width", "0"], "tree_recycle_width"),
    ],
)
def test_cli_refuses_bad_values_before_loading_a_model(flags, needle, capsys, monkeypatch):
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    fails_cleanly(capsys, ["generate", "--model", "/no/such/model", "--prompt", "hi", *flags], needle)


def test_cli_new_flags_reach_the_config_and_the_json(tiny_dirs, capsys):
    argv = ["generate", "--model", tiny_dirs[0], "--draft", tiny_dirs[1], "--dtype", "float32", "--prompt", "hi",
            "--mode", "viasd", "--gamma", "3", "--skip-attn", "2", "--tau-escalate", "0.5", "--recheck",
            "--draft-confidence", "0.4", "--draft-skip-mlp", "1", "--max-new-tokens", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == out["stats"]["new_tokens"] == 4
    assert out["config"] == DecodeConfig(
        gamma=3, drafter="model", skip=SkipSet.of([2]), draft_skip=SkipSet.of([], [1]), tau_escalate=0.5,
        recheck=True, draft_confidence=0.4,
    ).to_dict()  # fmt: skip
    assert DecodeConfig.from_dict(out["config"]).recheck is True


def test_config_module_stays_light():
    """config.py imports only what its docstring promises: errors and routing's SkipSet."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(config_module.__file__).read_text())
    imported = {
        (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    }
    assert imported <= {"__future__", "math", "numbers", "dataclasses", "typing", "errors", "routing"}, (
        imported
    )

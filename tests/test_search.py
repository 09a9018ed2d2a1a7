"""End to end on tiny models saved to disk: search → profile → schema → runtime.load → generate."""

from __future__ import annotations

import json

import optuna
import pytest

from viasd_tune import runtime
from viasd_tune.cli import main
from viasd_tune.errors import UserError
from viasd_tune.profile import load_profile
from viasd_tune.search.run import SearchSettings, run_search

TRIALS = 6


def settings(tiny_dirs, out, **kw) -> SearchSettings:
    target, draft = tiny_dirs
    base = dict(
        model=target,
        draft=draft,
        dtype="float32",
        device="cpu",
        data="builtin",
        prompts=8,
        trials=TRIALS,
        space="smoke",
        max_new_tokens=10,
        out=str(out),
        min_fidelity=0.5,
        progress=False,
    )
    return SearchSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def searched(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "tiny"
    summary = run_search(settings(tiny_dirs, out))
    return out, summary


def test_search_exports_a_valid_profile(searched):
    out, summary = searched
    profile = load_profile(out / "profile.json")  # validates against the shipped schema
    assert profile["provenance"]["trial"] == summary["trial"]
    assert profile["metrics"]["evaluated_on"] == "held_out" and profile["metrics"]["held_out_prompts"] == 2
    assert profile["metrics"]["fidelity"] >= 0 and profile["metrics"]["speedup_measured"] > 0
    assert sorted(p.name for p in (out / "pareto").iterdir())
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == TRIALS
    # the enqueued reference points ran first: no-skip VIA-SD, then plain SD
    assert study.trials[1].user_attrs["config"]["tau_escalate"] == 0.0
    for t in complete:
        assert {
            "config",
            "fidelity",
            "feasible",
            "tier_shares",
            "speedup_modelled",
            "measured",
        } <= t.user_attrs.keys()
        assert list(t.constraints.values()) == [pytest.approx(0.5 - t.user_attrs["fidelity"])]


def test_runtime_serves_the_profile(searched, tiny_dirs):
    out, _ = searched
    profile = load_profile(out / "profile.json")
    decoder = runtime.load(out / "profile.json", model=tiny_dirs[0], draft=tiny_dirs[1], device="cpu")
    cfg = decoder.config
    assert sorted(cfg.skip.attn) == profile["routing"]["skip_attn"] and cfg.gamma == profile["gamma"]
    assert cfg.tau_escalate == profile["thresholds"]["tau_escalate"]
    result = decoder.generate("Name three colours.", max_new_tokens=12)
    s = result.stats
    assert s.new_tokens == len(result.token_ids) > 0 and isinstance(result.text, str)
    assert s.tokens_direct + s.tokens_slim + s.tokens_full == s.new_tokens
    if profile["thresholds"]["tau_escalate"] > 0 and profile["drafter"] != "lookup":
        assert s.slim_calls > 0  # the routing is really in use


def test_runtime_refuses_a_different_model(searched, tiny_dirs, tmp_path):
    out, _ = searched
    profile = load_profile(out / "profile.json")
    profile["target"]["fingerprint"]["hidden_size"] += 1
    with pytest.raises(UserError, match="fingerprint"):
        runtime.load(profile, model=tiny_dirs[0], draft=tiny_dirs[1], device="cpu")
    with pytest.warns(UserWarning, match="fingerprint"):
        runtime.load(profile, model=tiny_dirs[0], draft=tiny_dirs[1], device="cpu", strict=False)


def test_resume_adds_no_trials_and_export_cli(searched, tiny_dirs, tmp_path, capsys):
    out, summary = searched
    again = run_search(settings(tiny_dirs, out))  # same study, same settings: resumes, nothing to do
    assert again["trial"] == summary["trial"]
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")
    assert len(study.trials) == TRIALS
    target = tmp_path / "fastest.json"
    rc = main(
        [
            "export",
            "--storage",
            f"sqlite:///{out / 'study.db'}",
            "--study-name",
            "tiny",
            "--pick",
            "fastest",
            "--out",
            str(target),
        ]
    )
    assert rc == 0 and load_profile(target)["schema_version"] == 1
    rc = main(
        ["export", "--storage", f"sqlite:///{out / 'study.db'}", "--study-name", "nope", "--out", str(target)]
    )
    assert rc == 2 and "no study 'nope'" in capsys.readouterr().err


def test_a_different_space_is_refused(searched, tiny_dirs):
    out, _ = searched
    with pytest.raises(UserError, match="different space"):
        run_search(settings(tiny_dirs, out, space="default"))


def test_two_workers_share_one_study(tiny_dirs, tmp_path):
    out = tmp_path / "pair"
    rc = main(
        [
            "search",
            "--model",
            tiny_dirs[0],
            "--draft",
            tiny_dirs[1],
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--prompts",
            "6",
            "--trials",
            "6",
            "--space",
            "smoke",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
            "--min-fidelity",
            "0.5",
            "--n-jobs",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0
    study = optuna.load_study(study_name="pair", storage=f"sqlite:///{out / 'study.db'}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert 6 <= len(done) <= 7  # each worker stops once the study holds 6 (one may be mid-trial then)
    assert len({t.number for t in done}) == len(done)
    assert len({json.dumps(t.params, sort_keys=True) for t in done}) >= 5


def test_generate_cli_json(tiny_dirs, capsys):
    rc = main(
        [
            "generate",
            "--model",
            tiny_dirs[0],
            "--draft",
            tiny_dirs[1],
            "--dtype",
            "float32",
            "--prompt",
            "hi",
            "--mode",
            "viasd",
            "--gamma",
            "3",
            "--skip-attn",
            "2",
            "--skip-mlp",
            "1",
            "--tau-accept",
            "0.01",
            "--tau-escalate",
            "1.0",
            "--max-new-tokens",
            "9",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == out["stats"]["new_tokens"] == 9 and isinstance(out["text"], str)
    assert sum(out["stats"][f"tokens_{k}"] for k in ("direct", "slim", "full")) == 9


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--skip-attn", "9"], "out of range"),
        (["--tau-accept", "2", "--tau-escalate", "1"], "tau_accept"),
        (["--gamma", "0"], "gamma"),
        (["--skip-attn", "x"], "not a list of layer indices"),
    ],
)
def test_generate_cli_bad_input_is_one_line(tiny_dirs, capsys, argv, message):
    rc = main(["generate", "--model", tiny_dirs[0], "--draft", tiny_dirs[1], "--prompt", "hi", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_missing_model_path_is_one_line(capsys):
    rc = main(["generate", "--model", "/no/such/model", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not exist" in err and err.count("\n") == 1


def test_presets_fill_model_and_draft_unless_given():
    from viasd_tune.cli import apply_preset, build_parser

    args = build_parser().parse_args(["search", "--preset", "qwen-coder"])
    apply_preset(args)
    assert (args.model, args.draft) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    args = build_parser().parse_args(["generate", "--preset", "qwen-coder", "--model", "m", "--prompt", "x"])
    apply_preset(args)
    assert (args.model, args.draft) == ("m", "qwen2.5-coder-0.5b")
    with pytest.raises(SystemExit):  # argparse: unknown choice, exit 2 with its usage line
        build_parser().parse_args(["bench", "--preset", "nope", "--out", "x"])


@pytest.mark.parametrize(
    "points, expected",
    [
        (
            [(0.94, 1.29), (0.65, 1.35), (0.56, 1.33)],
            0,
        ),  # a small acceptance gain does not buy a 30 % slowdown
        ([(1.0, 2.0), (0.95, 4.0), (0.5, 4.2)], 1),  # the balanced point
        ([(1.2, 3.0)], 0),
    ],
)
def test_knee_weighs_relative_shortfalls(points, expected):
    from viasd_tune.search.export import knee, pareto_front

    dist = {"a": optuna.distributions.FloatDistribution(0, 1)}
    trials = [
        optuna.trial.create_trial(values=list(v), params={"a": 0.5}, distributions=dist, user_attrs={"i": i})
        for i, v in enumerate(points)
    ]
    assert knee(pareto_front(trials)).user_attrs["i"] == expected


def test_acceptance_counts_slim_forwards_at_their_cost():
    from viasd_tune.search.replay import acceptance

    assert acceptance(30, full_calls=10, slim_calls=0, slim_cost=1.0) == 3.0  # plain SD: tokens per full call
    assert (
        acceptance(30, full_calls=2, slim_calls=8, slim_cost=1.0) == 3.0
    )  # a no-skip slim pass is a full one
    assert acceptance(30, full_calls=2, slim_calls=8, slim_cost=0.5) == 5.0
    assert acceptance(7, full_calls=0, slim_calls=0, slim_cost=1.0) == 7.0

"""End to end on tiny models saved to disk: search → profile → schema → runtime.load → generate."""

from __future__ import annotations

import dataclasses
import json
import statistics

import optuna
import pytest

from viasd_tune import host, models, runtime
from viasd_tune.cli import main
from viasd_tune.decoding.decoder import DecodeConfig, Decoder
from viasd_tune.errors import UserError
from viasd_tune.fidelity import agreement, greedy_agreement
from viasd_tune.profile import load_profile
from viasd_tune.prompts import encode_all, load_prompts
from viasd_tune.search.export import build_profile
from viasd_tune.search.records import StudyRecord, TrialRecord
from viasd_tune.search.run import SearchSettings, run_search

TRIALS = 6
MAX_NEW_TOKENS = 10


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
        max_new_tokens=MAX_NEW_TOKENS,
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


def test_search_exports_a_valid_profile(searched, tiny_dirs):
    out, summary = searched
    profile = load_profile(out / "profile.json")  # validates against the shipped schema
    assert profile["provenance"]["trial"] == summary["trial"]
    assert profile["provenance"]["matrix_isa"] == host.matrix_isa("cpu")  # the host it was measured on
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sum(bool(t.user_attrs["measured"]) for t in complete) == TRIALS  # --trials counts real decodes
    # pareto/ holds exactly the feasible, measured trials that no other one beats on both objectives.
    pool = [t for t in complete if t.user_attrs["feasible"] and t.user_attrs["measured"]]
    front = [
        t
        for t in pool
        if not any(
            o.values != t.values and all(b >= a for a, b in zip(t.values, o.values, strict=True))
            for o in pool
        )
    ]
    assert sorted(p.name for p in (out / "pareto").iterdir()) == [f"trial-{t.number:04d}.json" for t in front]
    assert summary["trial"] in [t.number for t in front]

    # The profile is the chosen trial's routing, or plain decoding when that ran slower than it on the held-out
    # prompts (timing decides which, so both are checked: the fallback below, the pick itself in either case) ...
    chosen = study.trials[summary["trial"]]
    held = study.user_attrs[f"held_out:{chosen.number}"]
    if profile["mode"] == "ar":
        assert held["speedup_measured"] < 1.0
        assert profile["metrics"]["best_speculative"] == {"trial": chosen.number, **held}
        profile = build_profile(study, chosen, held)
    else:
        assert held["speedup_measured"] >= 1.0
    config = chosen.user_attrs["config"]
    assert profile["routing"] == {
        "skip_attn": sorted(config["skip_attn"]),
        "skip_mlp": sorted(config["skip_mlp"]),
    }
    assert profile["thresholds"] == {k: config[k] for k in ("tau_accept", "tau_escalate", "kl")}
    assert (profile["gamma"], profile["drafter"]) == (config["gamma"], config["drafter"])
    # ... its metrics are the held-out run the study recorded (what the dashboard shows), self-consistent ...
    metrics = profile["metrics"]
    assert {k: metrics[k] for k in held} == held and metrics["evaluated_on"] == "held_out"
    assert metrics["speedup_modelled"] == chosen.user_attrs["speedup_modelled"]
    assert metrics["speedup_measured"] == pytest.approx(metrics["tokens_per_s"] / metrics["ar_tokens_per_s"])
    assert sum(metrics["tier_shares"].values()) == pytest.approx(1.0)
    # ... and they are this profile's on the held-out prompts: decoding them again (fp32 greedy, so exactly)
    # gives the same fidelity, and the same agreement and exact match with the target's own output.
    held_ids = study.user_attrs["calibration"]["held_out_ids"]
    assert metrics["held_out_prompts"] == len(held_ids) == 2
    assert not set(held_ids) & set(profile["calibration"]["prompt_ids"])
    target = models.load(tiny_dirs[0], "float32", "cpu")
    items = [p for p in load_prompts("builtin") if p.id in held_ids]
    ctx = models.context_length(target.model)
    decoder = runtime.load(profile, model=target, draft=tiny_dirs[1], device="cpu")
    ar = Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar"))
    fidelity, agree, exact = [], [], []
    for ids in encode_all(target.tokenizer, items, "auto", MAX_NEW_TOKENS, ctx, "cpu"):
        got = decoder.generate(ids, max_new_tokens=MAX_NEW_TOKENS).token_ids
        ref = ar.generate(ids, max_new_tokens=MAX_NEW_TOKENS).token_ids
        fidelity.append(greedy_agreement(target.model, ids, got))
        agree.append(agreement(got, ref))
        exact.append(float(got == ref))
    assert metrics["fidelity"] == pytest.approx(statistics.fmean(fidelity))
    assert metrics["agreement"] == pytest.approx(statistics.fmean(agree))
    assert metrics["exact_match"] == pytest.approx(statistics.fmean(exact))
    if config["tau_escalate"] == 0:  # plain SD is lossless
        assert metrics["fidelity"] == metrics["exact_match"] == 1.0 and metrics["tier_shares"]["full"] == 1.0
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
    # Everything the search stored is a field of its records: nothing is written under another name.
    trial_fields = {f.name for f in dataclasses.fields(TrialRecord)}
    assert all(set(t.user_attrs) <= trial_fields for t in study.trials)
    study_keys = {k.split(":")[0] if k.startswith("held_out:") else k for k in study.user_attrs}
    assert study_keys <= {f.name for f in dataclasses.fields(StudyRecord)}


def test_runtime_serves_the_profiles(searched, tiny_dirs):
    """The exported profile, every Pareto profile beside it, and the exported one turned into plain SD and into
    a VIA-SD profile whose slim tier decides everything (so both kinds are served, whichever the timing-based
    search exported): each decodes as its routing says."""
    out, _ = searched
    exported = load_profile(out / "profile.json")
    profiles = {"profile.json": exported} | {
        p.name: load_profile(p) for p in sorted((out / "pareto").iterdir())
    }
    profiles["plain SD"] = exported | {
        "mode": "viasd",
        "routing": {"skip_attn": [], "skip_mlp": []},
        "thresholds": {"tau_accept": 0.0, "tau_escalate": 0.0, "kl": "forward"},
    }
    profiles["slim decides"] = exported | {
        "mode": "viasd",
        "routing": {"skip_attn": [1], "skip_mlp": [2]},
        "thresholds": {"tau_accept": 0.0, "tau_escalate": 1e3, "kl": "js"},  # JS divergence is at most ln 2
    }
    target, draft = (models.load(d, "float32", "cpu") for d in tiny_dirs)
    prompt = "red green blue red green blue red green blue red"  # repeats, so prompt lookup drafts too
    reference = (
        Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar")).generate(prompt, 12).token_ids
    )
    for name, profile in profiles.items():
        decoder = runtime.load(profile, model=target, draft=draft, device="cpu")
        cfg = decoder.config
        assert sorted(cfg.skip.attn) == profile["routing"]["skip_attn"], name
        assert sorted(cfg.skip.mlp) == profile["routing"]["skip_mlp"], name
        assert (cfg.tau_accept, cfg.tau_escalate, cfg.kl) == tuple(profile["thresholds"].values()), name
        assert (cfg.gamma, cfg.drafter) == (profile["gamma"], profile["drafter"]), name
        result = decoder.generate(prompt, max_new_tokens=12)
        s = result.stats
        assert 0 < s.new_tokens == len(result.token_ids) <= 12, name  # EOS may end it early
        assert result.text == target.tokenizer.decode(result.token_ids, skip_special_tokens=True), name
        assert s.tokens_direct + s.tokens_slim + s.tokens_full == s.new_tokens, name
        if cfg.tau_escalate == 0:  # plain SD: every token the full target's, the slim tier never runs
            assert s.slim_calls == 0 and s.tokens_full == s.new_tokens, name
            assert result.token_ids == reference, name
        else:  # the routing is really in use
            assert s.slim_calls > 0 and s.slim_time_s > 0, name
    s = result.stats  # "slim decides": nothing escalates, nothing is accepted below τ_accept = 0
    assert s.tokens_full == s.full_calls == 0 and s.tokens_slim == s.new_tokens and s.tokens_direct == 0


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
    before = len(optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}").trials)
    again = run_search(settings(tiny_dirs, out))  # same study, same settings: resumes, nothing to do
    assert again["trial"] == summary["trial"]
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")
    assert len(study.trials) == before
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
    done = [
        t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs["measured"]
    ]
    assert 6 <= len(done) <= 7  # each worker stops once the study holds 6 decoded (one may be mid-trial then)
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


@pytest.mark.parametrize(
    "points, expected",
    [
        # The Qwen study: lookup+model 1.34x (acceptance 2.45) beats the draft model at γ 12 (1.14x, 4.33),
        # which the knee picked.
        ([(1.06, 2.64), (1.22, 3.30), (1.27, 1.33), (1.34, 2.45), (1.14, 4.33)], 3),
        ([(1.30, 1.5), (1.28, 3.0), (1.10, 5.0)], 1),  # within 3 % of the fastest: acceptance decides
        ([(1.30, 1.5), (1.20, 3.0)], 0),  # 8 % slower is not noise
    ],
)
def test_auto_pick_is_the_fastest_with_acceptance_breaking_near_ties(points, expected):
    from viasd_tune.search.export import auto

    dist = {"a": optuna.distributions.FloatDistribution(0, 1)}
    trials = [
        optuna.trial.create_trial(values=list(v), params={"a": 0.5}, distributions=dist, user_attrs={"i": i})
        for i, v in enumerate(points)
    ]
    assert auto(trials).user_attrs["i"] == expected


def test_acceptance_counts_slim_forwards_at_their_cost():
    from viasd_tune.search.replay import acceptance

    assert acceptance(30, full_calls=10, slim_calls=0, slim_cost=1.0) == 3.0  # plain SD: tokens per full call
    assert (
        acceptance(30, full_calls=2, slim_calls=8, slim_cost=1.0) == 3.0
    )  # a no-skip slim pass is a full one
    assert acceptance(30, full_calls=2, slim_calls=8, slim_cost=0.5) == 5.0
    assert acceptance(7, full_calls=0, slim_calls=0, slim_cost=1.0) == 7.0


def test_a_pick_slower_than_plain_decoding_is_exported_as_plain_decoding(searched, tiny_dirs, tmp_path):
    """The pick ran at 0.5x plain decoding on the held-out prompts: the export is ``mode: ar`` with its why."""
    import shutil

    from viasd_tune.search.export import export_study, pick_trial

    out, _ = searched
    shutil.copy(out / "study.db", tmp_path / "study.db")
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'study.db'}")
    knee = pick_trial(study, "auto")
    slow = {
        "speedup_measured": 0.5,
        "speedup_vs_sd": 0.7,
        "acceptance": 1.8,
        "fidelity": 1.0,
        "tier_shares": {"direct": 0.1, "slim": 0.2, "full": 0.7},
        "held_out_prompts": 3,
    }
    study.set_user_attr(f"held_out:{knee.number}", slow)
    summary = export_study(study, tmp_path / "export")
    profile = load_profile(tmp_path / "export" / "profile.json")
    assert profile["mode"] == "ar" and summary["config"]["mode"] == "ar"
    why = profile["metrics"]["plain_decoding_because"]
    assert f"trial #{knee.number}" in why and "0.50x plain decoding" in why and "3 held-out prompts" in why
    assert profile["metrics"]["best_speculative"]["trial"] == knee.number
    target, draft = (models.load(d, "float32", "cpu") for d in tiny_dirs)
    decoder = runtime.load(profile, model=target, draft=draft, device="cpu")
    assert decoder.config.mode == "ar"
    # Asked for by name, the same trial is exported as it is, marked slower than plain decoding.
    summary = export_study(study, tmp_path / "by-name", pick=f"trial:{knee.number}")
    assert summary["metrics"]["slower_than_ar"] is True and summary["config"]["mode"] != "ar"


def test_routed_export_from_a_search(searched, tiny_dirs, tmp_path, capsys):
    """Every measured trial keeps per-prompt times, the study the prompts' features; ``export --pick routed``
    writes a routed profile that serves."""
    out, _ = searched
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")
    n = len(study.user_attrs["calibration"]["prompt_ids"])
    assert len(study.user_attrs["calibration"]["features"]) == n
    measured = [t for t in study.trials if t.user_attrs.get("measured")]
    assert measured and all(len(t.user_attrs["prompt_s_per_token"]) == n for t in measured)
    assert all(len(t.user_attrs["ar_prompt_s_per_token"]) == n for t in measured)
    path = tmp_path / "routed.json"
    argv = [
        "export",
        "--storage",
        f"sqlite:///{out / 'study.db'}",
        "--study-name",
        "tiny",
        "--pick",
        "routed",
    ]
    assert main([*argv, "--out", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["rule"]["nodes"]
    profile = load_profile(path)
    target, draft = (models.load(d, "float32", "cpu") for d in tiny_dirs)
    decoder = runtime.load(profile, model=target, draft=draft, device="cpu")
    names = [c["name"] for c in profile["routes"]["configurations"]]
    assert decoder.generate("def f(x):", max_new_tokens=4).stats.routed_to in names


def test_the_study_starts_from_importance_seeds(searched):
    """The sub-layer scores are kept in the study, and the seed skip sets built from them were the first trials
    after the reference points, with the space's params decoding to exactly those sets."""
    from viasd_tune.search import importance, params
    from viasd_tune.search import space as spaces

    out, _ = searched
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")
    imp = importance.Importance.from_dict(StudyRecord.read(study).layer_importance)
    assert imp.positions > 0 and set(imp.drop) == {"attn", "mlp"}
    n_layers = study.user_attrs["num_layers"]
    assert imp.drop["attn"][0] is None and imp.drop["mlp"][n_layers - 1] is None  # smoke protects both ends
    seeds = importance.seed_skip_sets(imp, spaces.load_space("smoke"), n_layers)  # what the run enqueued
    seeded = [t for t in study.trials if (r := TrialRecord.read(t)).enqueued and not r.reference]
    assert seeds and len(seeded) == len(seeds)
    space = spaces.load_space("smoke")
    ran = 0
    for t, skip in zip(seeded, seeds, strict=True):
        assert TrialRecord.read(t).enqueued == params.skip_params(space, n_layers, skip)
        if t.state == optuna.trial.TrialState.COMPLETE:  # seeds after the last decode asked for stay WAITING
            ran += 1
            assert (t.user_attrs["config"]["skip_attn"], t.user_attrs["config"]["skip_mlp"]) == (
                sorted(skip.attn),
                sorted(skip.mlp),
            )
    assert ran >= 1


def test_the_study_records_how_replayed_tier_shares_matched_decoding(searched):
    """Each decoded trial keeps its replayed tier shares beside the measured ones; the study records the tolerance
    and how many decoded trials stayed within it. The replay runs the engine, so in fp32 it gives decoding's
    shares, lossy trials included."""
    from viasd_tune.search.records import TIERS
    from viasd_tune.search.screen import REPLAY_TOLERANCE

    out, _ = searched
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")
    # every finished trial records the process's memory after it (a long search's growth shows per trial)
    assert all(t.user_attrs["memory_gb"]["resident"] > 0 for t in study.trials if t.state.name == "COMPLETE")
    decoded = [r for r in map(TrialRecord.read, study.trials) if r.measured]
    assert decoded and all(r.replayed_tier_shares is not None for r in decoded)
    for r in decoded:
        replayed, measured = r.replayed_tier_shares, r.tier_shares
        assert sum(replayed.values()) == pytest.approx(1.0)
        assert r.replay_gap == pytest.approx(max(abs(replayed[k] - measured[k]) for k in TIERS))
        assert r.replay_gap == 0, r
    assert StudyRecord.read(study).replay_check == {
        "tolerance": REPLAY_TOLERANCE,
        "trials": len(decoded),
        "within": len(decoded),
        "max_gap": 0,
    }


def test_trials_counts_real_decodes(tiny_dirs, tmp_path, monkeypatch, capsys):
    """Trials the screen rejects are replayed only (measured False, with why); the study holds exactly --trials
    decoded ones, and the progress bar shows both counts."""
    from viasd_tune.search import screen

    calls = []

    def every_third(study, modelled, acceptance):
        calls.append(modelled)
        return len(calls) % 3 == 0

    monkeypatch.setattr(screen, "could_enter_front", every_third)
    out = tmp_path / "count"
    run_search(settings(tiny_dirs, out, trials=5, prompts=6, max_new_tokens=6, progress=True))
    study = optuna.load_study(study_name="count", storage=f"sqlite:///{out / 'study.db'}")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    decoded = [t for t in complete if t.user_attrs["measured"]]
    replayed = [t for t in complete if not t.user_attrs["measured"]]
    assert len(decoded) == 5
    assert len(replayed) >= len(calls) - len(calls) // 3 > 0
    assert {t.user_attrs["screened"] for t in replayed} <= {"dominated", "fidelity", "slow"}
    assert all("screened" not in t.user_attrs for t in decoded)
    err = capsys.readouterr().err
    assert "decoded" in err and f"replayed={len(complete)}" in err


def test_a_search_with_nothing_worth_decoding_stops(tiny_dirs, tmp_path, monkeypatch, caplog):
    """When the screen rejects every sampled trial, the search still ends: after REPLAYS_PER_DECODE replays
    per decode asked for (at least MIN_REPLAYS), with the reference points decoded and a warning saying so."""
    from viasd_tune.search import loop, screen

    monkeypatch.setattr(screen, "could_enter_front", lambda *a: False)
    monkeypatch.setattr(screen, "REFERENCE_MARGIN", float("inf"))  # tiny random models replay far below AR
    monkeypatch.setattr(loop, "MIN_REPLAYS", 9)
    monkeypatch.setattr(loop, "REPLAYS_PER_DECODE", 1)
    out = tmp_path / "capped"
    run_search(settings(tiny_dirs, out, trials=5, prompts=4, max_new_tokens=4))
    study = optuna.load_study(study_name="capped", storage=f"sqlite:///{out / 'study.db'}")
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * 9
    decoded = [t.number for t in study.trials if t.user_attrs["measured"]]
    assert decoded == [0, 1, 2]  # the reference points: no skip, plain SD with the model and with lookup
    assert "stopped after 9 replayed trials: only 3 were worth decoding for real (--trials 5)" in caplog.text


def test_a_search_stops_after_a_run_of_screened_out_trials(tiny_dirs, tmp_path, monkeypatch, caplog):
    """STALE_REPLAYS finished trials in a row screened out end the search (the default search on SmolLM2 once
    replayed 240 dominated trials for 40 min), with the decoded reference points and a warning saying so."""
    from viasd_tune.search import loop, screen

    monkeypatch.setattr(screen, "could_enter_front", lambda *a: False)
    monkeypatch.setattr(screen, "REFERENCE_MARGIN", float("inf"))  # tiny random models replay far below AR
    monkeypatch.setattr(loop, "STALE_REPLAYS", 4)
    out = tmp_path / "stale"
    run_search(settings(tiny_dirs, out, trials=5, prompts=4, max_new_tokens=4))
    study = optuna.load_study(study_name="stale", storage=f"sqlite:///{out / 'study.db'}")
    assert [t.user_attrs["measured"] for t in study.trials] == [True] * 3 + [False] * 4
    assert "stopped: the last 4 replayed trials could not enter the measured front" in caplog.text


def test_a_trial_that_repeats_a_decoded_configuration_reuses_its_measurement(tiny_dirs, tmp_path, monkeypatch):
    """TPE proposes a configuration again (the main command on SmolLM2 decoded one three times, ~70 s each):
    the repeat takes the earlier trial's measurement, says whose, and costs no decode; it still counts."""
    from viasd_tune.search import objective, params, screen

    monkeypatch.setattr(screen, "REFERENCE_MARGIN", float("inf"))  # tiny random models replay far below AR
    repeat = DecodeConfig(mode="sd", drafter="lookup", gamma=2)
    suggest = params.suggest

    def always_the_same(trial, *args):
        cfg = suggest(trial, *args)
        if TrialRecord.read(trial).enqueued is None:  # a sampled trial, not a reference point
            cfg = repeat
            TrialRecord(config=cfg.to_dict()).write(trial)
        return cfg

    decodes = []
    real_measure = objective.measure
    monkeypatch.setattr(params, "suggest", always_the_same)
    monkeypatch.setattr(objective, "measure", lambda *a, **k: decodes.append(a[3]) or real_measure(*a, **k))
    out = tmp_path / "twins"
    run_search(settings(tiny_dirs, out, trials=6, prompts=4, max_new_tokens=4))
    study = optuna.load_study(study_name="twins", storage=f"sqlite:///{out / 'study.db'}")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert [TrialRecord.read(t).measured for t in complete] == [True] * 6
    enqueued = sum(TrialRecord.read(t).enqueued is not None for t in complete)  # reference points and seeds
    assert enqueued == 4
    first, second = complete[enqueued], complete[enqueued + 1]
    assert TrialRecord.read(first).decode_config() == TrialRecord.read(second).decode_config() == repeat
    assert TrialRecord.read(second).duplicate_of == first.number and TrialRecord.read(first).duplicate_of is None
    assert second.values == first.values
    assert TrialRecord.read(second).fidelity == TrialRecord.read(first).fidelity
    assert decodes.count(repeat) == 1 and len(decodes) == 5  # the enqueued four, then the one decode


def test_a_replayed_trial_is_decoded_only_if_it_could_enter_the_front():
    from viasd_tune.search.screen import FRONT_SLACK, could_enter_front

    study = optuna.create_study(directions=["maximize", "maximize"])
    assert could_enter_front(study, 0.1, 0.1)  # nothing measured yet: decode

    def add(values, measured, feasible, modelled):
        study.add_trial(
            optuna.trial.create_trial(
                values=values,
                user_attrs={"measured": measured, "feasible": feasible, "speedup_modelled": modelled},
            )
        )

    add([1.2, 2.0], True, True, 2.4)  # measured at half its modelled speedup
    add([5.0, 5.0], True, False, 10.0)  # infeasible: not a front point
    add([9.0, 9.0], False, False, 9.0)  # replayed only: not a front point
    # modelled 2.0 -> predicted 1.0 (ratio 0.5): dominated by (1.2, 2.0) beyond the slack at acceptance 1.5
    assert not could_enter_front(study, 2.0, 1.5)
    assert could_enter_front(study, 2.0, 2.0 / (1 + FRONT_SLACK) + 0.01)  # too close on acceptance
    assert could_enter_front(study, 2.3, 1.0)  # predicted 1.15: within the slack on speedup
    assert could_enter_front(study, 3.0, 0.5)  # predicted faster than anything measured


def test_a_reference_point_is_left_undecoded_only_when_its_replay_is_far_below_a_measured_speed():
    from viasd_tune.search.screen import REFERENCE_MARGIN, far_slower_than_measured

    study = optuna.create_study(directions=["maximize", "maximize"])
    # Nothing measured: plain decoding (speedup 1) is the bar.
    assert far_slower_than_measured(study, 0.9 / REFERENCE_MARGIN)
    assert not far_slower_than_measured(study, 1.1 / REFERENCE_MARGIN)
    study.add_trial(
        optuna.trial.create_trial(
            values=[3.0, 2.0], user_attrs={"measured": True, "feasible": True, "speedup_modelled": 1.5}
        )
    )  # measured at twice its modelled speedup: a modelled 0.7 predicts 1.4, under 3.0 / REFERENCE_MARGIN
    assert far_slower_than_measured(study, 0.7)
    assert not far_slower_than_measured(study, 0.8)


def test_a_search_over_token_trees_replays_and_decodes_them_alike(tiny_dirs, tmp_path):
    """A space with trees (issue 33): tree trials are scored through the replay (the engine's tree rounds over
    recorded forwards, priced on the measured block-cost curve), decoded for real with the same tier shares (fp32),
    and a tree trial's configuration exports as a profile that runtime.load serves."""
    space = tmp_path / "trees.yaml"
    space.write_text(
        "version: 1\n"
        "skip: {encoding: budget, sublayers: [attn, mlp], protect_first: 1, protect_last: 1,"
        " budget: {min: 0.0, max: 0.0}}\n"
        "tau_escalate: {low: 0.05, high: 20.0, log: true}\n"
        "tau_accept_ratio: {low: 0.001, high: 1.0, log: true}\n"
        "kl: [forward]\n"
        "gamma: [3, 5]\n"
        "drafter: [lookup+recycle, lookup+recycle+model, lookup]\n"
        "tree: {nodes: [12, 4], recycle: {width: {low: 1, high: 3}}, model: {depth: {low: 1, high: 3}}}\n"
    )
    out = tmp_path / "trees"
    summary = run_search(settings(tiny_dirs, out, space=str(space), trials=4))
    study = optuna.load_study(study_name="trees", storage=f"sqlite:///{out / 'study.db'}")
    measured = [
        t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs["measured"]
    ]
    trees = [t for t in measured if t.user_attrs["config"]["tree_nodes"] > 1]
    assert trees and study.user_attrs["signature"]  # the reference points alone hold two tree trials
    for t in measured:
        assert t.user_attrs["replay_gap"] == pytest.approx(0.0, abs=1e-9), t.user_attrs["config"]
        assert t.user_attrs["speedup_modelled"] > 0
    chosen = study.trials[summary["trial"]]
    profile = build_profile(study, trees[0], study.user_attrs.get(f"held_out:{chosen.number}"))
    cfg = DecodeConfig.from_profile(profile)
    assert cfg.tree_nodes == trees[0].user_attrs["config"]["tree_nodes"] and cfg.is_tree
    target, draft = (models.load(d, "float32", "cpu") for d in tiny_dirs)
    dec = runtime.load(profile, model=target, draft=draft, strict=True)
    ar = Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar"))
    for prompt in ("abcabcabc", "The quick brown fox"):
        out_tokens = dec.generate(prompt, max_new_tokens=MAX_NEW_TOKENS).token_ids
        assert out_tokens == ar.generate(prompt, max_new_tokens=MAX_NEW_TOKENS).token_ids

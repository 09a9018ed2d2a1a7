"""Routed profiles (issue 15): several configurations and a JSON decision tree that picks one per request."""

from __future__ import annotations

import copy
import random
from dataclasses import asdict

import numpy as np
import pytest
from test_profile import assert_one_line, make_profile

from viasd_tune import models, runtime
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.errors import UserError
from viasd_tune.profile import load_profile, validate_profile, write_profile
from viasd_tune.routing import SkipSet
from viasd_tune.rule import apply_rule, fit_rule, one_leaf, prompt_features, validate_rule

AR = {"name": "plain", **DecodeConfig(mode="ar", drafter="lookup").to_profile()}
LOOKUP = {"name": "lookup", **DecodeConfig(mode="sd", drafter="lookup", gamma=4).to_profile()}
MODEL = {"name": "draft", **DecodeConfig(mode="sd", drafter="model", gamma=3).to_profile()}
SELF = {
    "name": "self",
    **DecodeConfig(mode="sd", drafter="self", gamma=3, draft_skip=SkipSet.of([1], [2])).to_profile(),
}
HYBRID = {
    "name": "hybrid",
    **DecodeConfig(mode="sd", drafter="lookup+model", gamma=3, lookup_min=2).to_profile(),
}
RECHECK = {
    "name": "viasd-recheck",
    **DecodeConfig(
        mode="viasd", drafter="model", gamma=3, skip=SkipSet.of([2], [1]), tau_escalate=50.0, recheck=True
    ).to_profile(),
}
BY_LENGTH = {
    "nodes": [
        {"feature": "prompt_tokens", "threshold": 20, "left": 1, "right": 2},
        {"config": 0},
        {"config": 1},
    ]
}


def routed(configurations: list[dict], rule: dict, base: dict | None = None) -> dict:
    p = copy.deepcopy(base or make_profile())
    p["routes"] = {"configurations": copy.deepcopy(configurations), "rule": copy.deepcopy(rule)}
    return p


# ---------------------------------------------------------------------------------------------- schema


def test_routed_profile_round_trips(tmp_path) -> None:
    p = routed([AR, LOOKUP, MODEL, SELF, HYBRID], BY_LENGTH)
    write_profile(tmp_path / "r.json", p)
    assert load_profile(tmp_path / "r.json") == p
    single = make_profile()
    assert validate_profile(copy.deepcopy(single)) == single  # a one-configuration profile is unchanged


@pytest.mark.parametrize(
    ("rule", "needle"),
    [
        (
            {
                "nodes": [
                    {"feature": "colour", "threshold": 1, "left": 1, "right": 2},
                    {"config": 0},
                    {"config": 1},
                ]
            },
            "colour",
        ),
        ({"nodes": [{"config": 7}]}, "nodes[0].config is 7"),
        (
            {"nodes": [{"feature": "prompt_tokens", "threshold": 1, "left": 0, "right": 1}, {"config": 0}]},
            "later node",
        ),
        (
            {"nodes": [{"feature": "prompt_tokens", "threshold": 1, "left": 1, "right": 1}, {"config": 0}]},
            "two parents",
        ),
        (
            {
                "nodes": [
                    {"feature": "category", "in": "qa", "left": 1, "right": 2},
                    {"config": 0},
                    {"config": 1},
                ]
            },
            "category",
        ),
        ({"nodes": [{"config": 0}, {"config": 1}]}, "not reachable"),
        ({"nodes": []}, "nodes"),
    ],
)
def test_bad_rules_refused(rule, needle) -> None:
    with pytest.raises(UserError) as e:
        validate_profile(routed([AR, LOOKUP], rule))
    assert needle in assert_one_line(e)


def _chain(depth: int) -> dict:
    """A left-leaning chain ``depth`` splits deep (2*depth + 1 nodes)."""
    nodes = []
    for i in range(depth):
        nodes += [
            {"feature": "copy_share", "threshold": 0.5, "left": 2 * i + 2, "right": 2 * i + 1},
            {"config": 0},
        ]
    return {"nodes": [*nodes, {"config": 1}]}


@pytest.mark.parametrize("depth", [7, 63, 10_000])
def test_depth_bombs_refused(depth) -> None:
    with pytest.raises(UserError) as e:
        validate_profile(routed([AR, LOOKUP], _chain(depth)))
    assert_one_line(e)


def test_deepest_allowed_rule_is_valid() -> None:
    rule = _chain(6)
    validate_profile(routed([AR, LOOKUP], rule))
    assert apply_rule(rule, {"prompt_tokens": 1, "copy_share": 0.0}) == 1
    assert apply_rule(rule, {"prompt_tokens": 1, "copy_share": 0.9}) == 0


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("gamma", 0, "configurations[1]"),
        ("drafter", "oracle", "configurations[1]"),
        ("metrics", {}, "unknown field"),
        ("name", "plain", "names two"),
    ],
)
def test_bad_configuration_refused(key, value, needle) -> None:
    bad = {**LOOKUP, key: value}
    with pytest.raises(UserError) as e:
        validate_profile(routed([AR, bad], one_leaf()))
    assert needle in assert_one_line(e)


def test_configuration_skip_set_checked_against_the_models() -> None:
    bad = copy.deepcopy(SELF)
    bad["draft"]["skip_attn"] = [99]  # the target has 28 layers
    with pytest.raises(UserError) as e:
        validate_profile(routed([AR, bad], one_leaf()))
    assert "out of range" in assert_one_line(e)


# ---------------------------------------------------------------------------------------------- features and fitting


def test_prompt_features() -> None:
    f = prompt_features([5, 6, 7, 5, 6, 7, 5, 6], "qa")
    assert f == {"prompt_tokens": 8, "copy_share": pytest.approx(3 / 6), "category": "qa"}
    assert prompt_features([1, 2])["copy_share"] == 0.0  # shorter than an n-gram
    # the rule reads task groups: MT-bench's categories are Spec-Bench's one conversation group
    assert prompt_features([1, 2], "writing")["category"] == "conversation"
    assert prompt_features([1, 2], "math")["category"] == "conversation"
    assert prompt_features([1, 2], "math_reasoning")["category"] == "math_reasoning"
    assert prompt_features([1, 2])["category"] is None
    assert prompt_features(list(range(50)))["copy_share"] == 0.0


def test_fit_recovers_a_known_threshold() -> None:
    rng = random.Random(0)
    rows = [
        {"prompt_tokens": rng.randint(1, 400), "copy_share": rng.random(), "category": None}
        for _ in range(300)
    ]
    labels = [int(r["prompt_tokens"] > 137) for r in rows]
    rule = fit_rule(rows, labels)
    validate_rule(rule, 2)
    root = rule["nodes"][0]
    assert root["feature"] == "prompt_tokens"
    below = max(r["prompt_tokens"] for r in rows if r["prompt_tokens"] <= 137)
    above = min(r["prompt_tokens"] for r in rows if r["prompt_tokens"] > 137)
    assert below <= root["threshold"] < above
    assert [apply_rule(rule, r) for r in rows] == labels
    assert len(rule["nodes"]) == 3  # splits that do not change the choice are merged away


def test_fit_uses_the_category_and_collapses_to_one_leaf() -> None:
    rng = random.Random(1)
    cats = ["qa", "math", "translation"]
    rows = [
        {"prompt_tokens": rng.randint(1, 99), "copy_share": rng.random(), "category": rng.choice(cats)}
        for _ in range(120)
    ]
    labels = [2 if r["category"] == "translation" else 0 for r in rows]
    rule = fit_rule(rows, labels)
    assert rule["nodes"][0] == {"feature": "category", "in": ["translation"], "left": 1, "right": 2}
    assert [apply_rule(rule, r) for r in rows] == labels
    assert apply_rule(rule, {"prompt_tokens": 5, "copy_share": 0.0, "category": None}) == 0
    assert fit_rule(rows, [1] * len(rows)) == one_leaf(1)


# ---------------------------------------------------------------------------------------------- serving


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    target = models.load(tiny_dirs[0], "float32", "cpu")
    draft = models.load(tiny_dirs[1], "float32", "cpu")
    base = make_profile()
    base["target"] = {"name": tiny_dirs[0], "fingerprint": target.fingerprint}
    base["draft"] = {"kind": "model", "name": tiny_dirs[1], "fingerprint": draft.fingerprint}
    base.update(dtype="float32", drafter="model", mode="sd", routing={"skip_attn": [], "skip_mlp": []})
    base["thresholds"] = {"tau_accept": 0.0, "tau_escalate": 0.0, "kl": "forward"}  # plain SD routes nothing
    return target, draft, base


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(4, 90) for _ in range(rng.randint(2, 6))]
        out.append(
            (motif * 12)[: rng.randint(3, 40)]
            if rng.random() < 0.5
            else [rng.randrange(4, 90) for _ in range(rng.randint(3, 40))]
        )
    return out


def test_rule_applied_per_request_and_lossless(tiny, one_thread) -> None:
    target, draft, base = tiny
    dec = runtime.load(routed([AR, LOOKUP], BY_LENGTH, base), model=target, draft=draft)
    assert isinstance(dec, runtime.RoutedDecoder)
    ar = Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar"))
    short, long_ = [9, 10, 11, 12, 13], list(range(4, 34))
    a, b = dec.generate(short, max_new_tokens=12), dec.generate(long_, max_new_tokens=12)
    assert (a.stats.routed_to, b.stats.routed_to) == ("plain", "lookup")
    assert a.stats.drafted == 0 and b.stats.rounds > 0
    assert dec.config_of(b).mode == "sd"
    for p in (short, long_):
        assert dec.generate(p, max_new_tokens=12).token_ids == ar.generate(p, max_new_tokens=12).token_ids


def test_configurations_share_the_models_losslessly(tiny, one_thread) -> None:
    """Six configurations (AR, lookup, draft model, self-draft with a skip set, lookup+model, VIA-SD with recheck
    and a slim skip set) on one target: each stays token-identical to greedy AR in fp32 on many random prompts,
    whichever served the one before (the VIA-SD one settles tokens in the slim tier, so its skip set runs)."""
    target, draft, base = tiny
    nodes = []
    for i, cat in enumerate("cabde"):  # category c -> configuration 1, a -> 2, ..., e -> 5, none -> 0
        nodes += [
            {"feature": "category", "in": [cat], "left": 2 * i + 2, "right": 2 * i + 1},
            {"config": i + 1},
        ]
    by_category = {"nodes": [*nodes, {"config": 0}]}
    dec = runtime.load(
        routed([AR, LOOKUP, MODEL, SELF, HYBRID, RECHECK], by_category, base), model=target, draft=draft
    )
    assert dec.decoders[2].draft is draft.model and all(d.target is target.model for d in dec.decoders)
    ar = Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar"))
    want = {None: "plain", "c": "lookup", "a": "draft", "b": "self", "d": "hybrid", "e": "viasd-recheck"}
    rng, slim = random.Random(3), 0
    for prompt in _prompts(36, seed=5):
        cat = rng.choice([None, "a", "b", "c", "d", "e"])
        out = dec.generate(prompt, max_new_tokens=10, category=cat)
        assert out.stats.routed_to == want[cat]
        assert out.token_ids == ar.generate(prompt, max_new_tokens=10).token_ids
        slim += out.stats.slim_calls
    assert slim > 0


_TIMES = {"draft_time_s", "slim_time_s", "full_time_s", "prefill_time_s", "wall_time_s", "routed_to"}


def test_one_leaf_rule_is_the_single_configuration(tiny, one_thread) -> None:
    target, draft, base = tiny
    viasd = {
        "name": "viasd",
        **DecodeConfig(
            mode="viasd",
            drafter="model",
            gamma=3,
            skip=SkipSet.of([1], [2]),
            tau_accept=0.05,
            tau_escalate=0.5,
        ).to_profile(),
    }
    single = copy.deepcopy(base)
    single.update({k: v for k, v in viasd.items() if k not in ("name", "draft")})
    single["draft"].update(viasd["draft"])
    one = runtime.load(routed([AR, viasd], one_leaf(1), base), model=target, draft=draft)
    ref = runtime.load(single, model=target, draft=draft)
    assert one.decoders[1].config == ref.config
    for prompt in _prompts(12, seed=7):
        a, b = one.generate(prompt, max_new_tokens=10), ref.generate(prompt, max_new_tokens=10)
        assert a.token_ids == b.token_ids and a.stats.routed_to == "viasd" and b.stats.routed_to is None
        assert a.stats.to_dict()["routed_to"] == "viasd" and "routed_to" not in b.stats.to_dict()
        strip = lambda s: {k: v for k, v in asdict(s).items() if k not in _TIMES}  # noqa: E731
        assert strip(a.stats) == strip(b.stats)


def test_generate_cli_routes_by_category(tiny, tmp_path, capsys, monkeypatch) -> None:
    import json

    from viasd_tune.cli import main

    target, draft, base = tiny
    path = tmp_path / "routed.json"
    rule = {
        "nodes": [{"feature": "category", "in": ["qa"], "left": 1, "right": 2}, {"config": 0}, {"config": 1}]
    }
    write_profile(path, routed([AR, LOOKUP], rule, base))
    for cat, name, mode in (("qa", "lookup", "sd"), ("math", "plain", "ar")):
        argv = ["generate", "--profile", str(path), "--prompt", "abcabc", "--max-new-tokens", "3", "--json"]
        assert main([*argv, "--category", cat, "--device", "cpu"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["stats"]["routed_to"] == name and out["config"]["mode"] == mode


# ---------------------------------------------------------------------------------------------- search export


def _study(per_prompt: dict[str, list[float]], features: list[dict]):
    """An in-memory study with one feasible measured trial per drafter kind and the given per-prompt times
    (seconds per token; key ``ar`` is the baseline measured beside each trial, ``ar:KIND`` the one beside that
    kind's trial where they differ)."""
    import optuna

    from viasd_tune.profile import calibration_fingerprint

    p = make_profile()
    study = optuna.create_study(directions=["maximize", "maximize"])
    ids = [f"p{i}" for i in range(len(features))]
    attrs = {
        "target": "t",
        "target_fingerprint": p["target"]["fingerprint"],
        "draft": "d",
        "draft_fingerprint": p["draft"]["fingerprint"],
        "dtype": "float32",
        "device": "cpu",
        "min_fidelity": 0.9,
        "storage": "",
        "calibration": {
            "source": "builtin",
            "prompt_ids": ids,
            "fingerprint": calibration_fingerprint([(i, i) for i in ids]),
            "features": features,
        },
    }
    for k, v in attrs.items():
        study.set_user_attr(k, v)
    configs = {
        "lookup": DecodeConfig(mode="sd", drafter="lookup", gamma=4),
        "model": DecodeConfig(mode="sd", drafter="model", gamma=3),
    }
    for kind, cfg in configs.items():
        times, ar = per_prompt[kind], per_prompt.get(f"ar:{kind}", per_prompt["ar"])
        study.add_trial(
            optuna.trial.create_trial(
                values=[sum(ar) / sum(times), 1.5 if kind == "model" else 1.2],
                user_attrs={
                    "config": cfg.to_dict(),
                    "measured": True,
                    "feasible": True,
                    "fidelity": 1.0,
                    "prompt_s_per_token": times,
                    "ar_prompt_s_per_token": ar,
                },
            )
        )
    return study


def test_routed_export_fits_the_rule_on_measured_times() -> None:
    from viasd_tune.search.export import routed_profile

    rng = random.Random(0)
    features = [
        {"prompt_tokens": rng.randint(5, 300), "copy_share": rng.random(), "category": None}
        for _ in range(16)
    ]
    copies = [f["copy_share"] > 0.5 for f in features]
    times = {
        "ar": [1.0] * 16,
        "lookup": [0.5 if c else 1.2 for c in copies],  # lookup wins where the prompt repeats itself
        "model": [0.8 if c else 0.6 for c in copies],
    }
    profile = validate_profile(routed_profile(_study(times, features)))
    routes = profile["routes"]
    assert [c["name"] for c in routes["configurations"]] == ["trial-0", "trial-1"]  # AR never wins: dropped
    assert routes["fit"]["served_per_prompt"] == routes["fit"]["best_per_prompt"]
    assert routes["rule"]["nodes"][0]["feature"] == "copy_share"
    for f, c in zip(features, copies, strict=True):
        assert routes["configurations"][apply_rule(routes["rule"], f)]["drafter"] == (
            "lookup" if c else "model"
        )
    assert profile["metrics"]["speedup_measured"] > profile["metrics"]["speedup_best_single"] > 1
    assert profile["draft"]["fingerprint"] is not None  # a configuration drafts with the model


def test_routed_export_compares_trials_as_ratios_to_the_ar_run_beside_them() -> None:
    """The model trial ran while the host was 60 % slower (its AR too): in absolute seconds lookup wins every
    prompt, but side by side with AR the model wins the prompts that do not repeat themselves."""
    from viasd_tune.search.export import routed_profile

    features = [{"prompt_tokens": 20 + i, "copy_share": float(i % 2), "category": None} for i in range(12)]
    copies = [f["copy_share"] > 0.5 for f in features]
    slow = 1.6
    times = {
        "ar": [1.0] * 12,
        "lookup": [0.6 if c else 0.9 for c in copies],
        "ar:model": [slow] * 12,
        "model": [slow * (0.8 if c else 0.6) for c in copies],
    }
    assert all(m > lk for m, lk in zip(times["model"], times["lookup"], strict=True))  # raw: lookup everywhere
    routes = validate_profile(routed_profile(_study(times, features)))["routes"]
    assert routes["rule"]["nodes"][0]["feature"] == "copy_share"
    for f, c in zip(features, copies, strict=True):
        assert routes["configurations"][apply_rule(routes["rule"], f)]["drafter"] == ("lookup" if c else "model")
    assert routes["fit"]["seconds_per_token"]["ar"] == pytest.approx(12 * (1 + slow) / 2)


def test_routed_export_keeps_one_leaf_when_the_tree_does_not_help() -> None:
    from viasd_tune.search.export import routed_profile

    features = [{"prompt_tokens": 10 + i, "copy_share": 0.0, "category": None} for i in range(8)]
    times = {"ar": [1.0] * 8, "lookup": [1.1] * 8, "model": [0.7, 0.71] * 4}
    profile = validate_profile(routed_profile(_study(times, features)))
    assert profile["routes"]["rule"] == one_leaf(0)
    assert [c["drafter"] for c in profile["routes"]["configurations"]] == ["model"]
    assert profile["drafter"] == "model" and profile["mode"] == "sd"  # the top level is the one configuration


def test_routed_export_without_per_prompt_times_is_refused() -> None:
    from viasd_tune.search.export import routed_profile

    study = _study({"ar": [1.0], "lookup": [0.5], "model": [0.6]}, [{"prompt_tokens": 3, "copy_share": 0.0}])
    study.set_user_attr("calibration", {**study.user_attrs["calibration"], "features": None})
    with pytest.raises(UserError) as e:
        routed_profile(study)
    assert "per-prompt timings" in assert_one_line(e)


def test_routed_export_falls_back_to_plain_decoding() -> None:
    from viasd_tune.search.export import routed_profile

    features = [{"prompt_tokens": 10 + i, "copy_share": 0.0, "category": None} for i in range(6)]
    times = {"ar": [1.0] * 6, "lookup": [1.3] * 6, "model": [1.2] * 6}
    profile = validate_profile(routed_profile(_study(times, features)))
    assert profile["routes"]["rule"] == one_leaf(0) and profile["mode"] == "ar"
    assert profile["routes"]["configurations"][0]["name"] == "ar"
    assert profile["metrics"]["speedup_measured"] == 1.0 and profile["metrics"]["fidelity"] == 1.0
    assert profile["draft"] == {"kind": "lookup", "name": None, "fingerprint": None}


def test_routed_export_drops_a_tree_that_only_fits_noise() -> None:
    """Two configurations tied but for timing noise unrelated to the features: a tree still saves time in
    sample, and here even left out (3.4 % at depth 1, each prompt routed by a tree fitted on the others), but
    the per-prompt savings scatter so widely that the mean is 1.5 standard errors from zero: refused."""
    from viasd_tune.search.export import ROUTE_DEPTHS, ROUTE_GAIN, ROUTE_T, _fit, routed_profile

    rng = random.Random(3)
    features = [{"prompt_tokens": 10 + i, "copy_share": rng.random(), "category": None} for i in range(12)]
    times = {"ar": [1.0] * 12, "lookup": [rng.uniform(0.6, 0.8) for _ in features]}
    times["model"] = [rng.uniform(0.6, 0.8) for _ in features]
    cost = np.column_stack([times["ar"], times["lookup"], times["model"]])
    in_sample = sum(cost[i, apply_rule(_fit(features, cost, max(ROUTE_DEPTHS)), f)] for i, f in enumerate(features))
    assert in_sample < (1 - ROUTE_GAIN) * cost.sum(axis=0).min()  # the in-sample check alone keeps the tree
    profile = validate_profile(routed_profile(_study(times, features)))
    fit = profile["routes"]["fit"]
    assert profile["routes"]["rule"] == one_leaf(0) and len(profile["routes"]["configurations"]) == 1
    left_out = fit["left_out_seconds_per_token"]
    assert left_out["routed"] < (1 - ROUTE_GAIN) * left_out["best_single"]  # the gain check alone keeps it
    assert 0 < fit["left_out_saving_standard_errors"] < ROUTE_T

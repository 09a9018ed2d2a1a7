"""The dashboard: one offline HTML file, every figure there, built from studies that follow the search's contract,
and rendered for real in headless Chromium (no console errors, no network, every figure drawn)."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import numpy as np
import optuna
import pytest
from browser import CHROMIUM, load_page  # tests/ is on sys.path (rootdir conftest, no package)
from html_page import read_page, trace_points, traces
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from viasd_tune import dashboard
from viasd_tune.dashboard.points import trial_points
from viasd_tune.errors import UserError

NUM_LAYERS = 8
MIN_FIDELITY = 0.9
FIGURES = (
    "pareto",
    "fidelity",
    "skips",
    "layer_importance",
    "thresholds",
    "tokens",
    "history",
    "importances",
)
# What the search's calibration pass stores (search/importance.py): layers 0 and 7 protected, not scored.
LAYER_IMPORTANCE = {
    "drop": {
        "attn": [None, 0.0, 0.05, 0.1, 0.02, 0.3, 0.0, None],
        "mlp": [None, 0.01, 0.0, 0.2, 0.04, 0.06, 0.5, None],
    },
    "kl": {
        "attn": [None, 0.0, 0.01, 0.02, 0.003, 0.1, 0.0, None],
        "mlp": [None, 0.002, 0.0, 0.05, 0.01, 0.02, 0.3, None],
    },
    "saved_s": {"attn": 0.002, "mlp": 0.004},
    "positions": 120,
    "block": 8,
}
DISTS = {
    "drafter": CategoricalDistribution(["model", "self", "lookup"]),
    "gamma": CategoricalDistribution([2, 4, 6, 8]),
    "kl": CategoricalDistribution(["forward", "reverse", "js"]),
    "tau_escalate": FloatDistribution(1e-3, 1.0, log=True),
    "tau_accept_ratio": FloatDistribution(0.0, 1.0),
    "skip_frac": FloatDistribution(0.0, 0.5),
}
PLAIN_SD_DISTS = {k: DISTS[k] for k in ("drafter", "gamma")} | {
    "escalate_all": CategoricalDistribution([False, True])
}

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _trial(rng: random.Random, i: int, *, infeasible: bool = False, new_constraint_format: bool = False):
    """A complete trial as the search records it: measured objectives, constraint, config and tier attrs."""
    params = {
        "drafter": rng.choice(["model", "self", "lookup"]),
        "gamma": rng.choice([2, 4, 6, 8]),
        "kl": rng.choice(["forward", "reverse", "js"]),
        "tau_escalate": 10 ** rng.uniform(-3, 0),
        "tau_accept_ratio": rng.uniform(0, 1),
        "skip_frac": rng.uniform(0, 0.5),
    }
    n_skip = round(params["skip_frac"] * 2 * NUM_LAYERS)
    slots = rng.sample(
        [(layer, kind) for layer in range(1, NUM_LAYERS - 1) for kind in ("attn", "mlp")], n_skip
    )
    fidelity = rng.uniform(0.6, 0.85) if infeasible else rng.uniform(0.9, 1.0)
    speedup = 1.0 + 1.5 * params["skip_frac"] + rng.uniform(-0.2, 0.4)
    acceptance = 1.0 + params["gamma"] * rng.uniform(0.2, 0.6)
    direct = rng.uniform(0.2, 0.6)
    slim = rng.uniform(0, 1 - direct)
    self_draft = [2, 5] if params["drafter"] == "self" else []
    user_attrs = {
        "config": {
            "skip_attn": sorted(layer for layer, k in slots if k == "attn"),
            "skip_mlp": sorted(layer for layer, k in slots if k == "mlp"),
            "tau_accept": params["tau_accept_ratio"] * params["tau_escalate"],
            "tau_escalate": params["tau_escalate"],
            "kl": params["kl"],
            "gamma": params["gamma"],
            "drafter": params["drafter"],
            "draft_skip_attn": self_draft,
            "draft_skip_mlp": self_draft,
        },
        "fidelity": fidelity,
        "feasible": not infeasible,
        "measured": True,
        "tier_shares": {"direct": direct, "slim": slim, "full": 1 - direct - slim},
        "tier_time_s": {
            "draft": rng.uniform(0.1, 1),
            "slim": rng.uniform(0.1, 1),
            "full": rng.uniform(0.5, 2),
        },
        "speedup_modelled": speedup * rng.uniform(0.9, 1.1),
    }
    violation = MIN_FIDELITY - fidelity
    return create_trial(
        values=[speedup, acceptance],
        params=params,
        distributions=DISTS,
        user_attrs=user_attrs,
        system_attrs={} if new_constraint_format else {"constraints": [violation]},
        constraints={"fidelity": violation} if new_constraint_format else None,
    )


def _plain_sd_trial():
    """The enqueued plain-SD reference: τ_accept = τ_escalate = 0, nothing skipped."""
    return create_trial(
        values=[1.3, 2.4],
        params={"drafter": "model", "gamma": 4, "escalate_all": True},
        distributions=PLAIN_SD_DISTS,
        user_attrs={
            "config": {
                "skip_attn": [],
                "skip_mlp": [],
                "tau_accept": 0.0,
                "tau_escalate": 0.0,
                "kl": "forward",
                "gamma": 4,
                "drafter": "model",
                "draft_skip_attn": [],
                "draft_skip_mlp": [],
            },
            "fidelity": 1.0,
            "feasible": True,
            "measured": True,
            "tier_shares": {"direct": 0.0, "slim": 0.0, "full": 1.0},
            "tier_time_s": {"draft": 0.4, "slim": 0.0, "full": 1.2},
            "speedup_modelled": 1.25,
        },
        system_attrs={"constraints": [MIN_FIDELITY - 1.0]},
    )


def _replay_only_trial():
    """A trial the replay estimate ruled out: modelled objectives, no timing, never measured."""
    return create_trial(
        values=[2.9, 1.6],
        params={
            "drafter": "lookup",
            "gamma": 8,
            "kl": "js",
            "tau_escalate": 0.5,
            "tau_accept_ratio": 0.9,
            "skip_frac": 0.5,
        },
        distributions=DISTS,
        user_attrs={
            "config": {
                "skip_attn": [1, 2, 3, 4, 5, 6],
                "skip_mlp": [2, 3, 4, 5],
                "tau_accept": 0.45,
                "tau_escalate": 0.5,
                "kl": "js",
                "gamma": 8,
                "drafter": "lookup",
                "draft_skip_attn": [],
                "draft_skip_mlp": [],
            },
            "fidelity": 0.41,
            "feasible": False,
            "measured": False,
            "tier_shares": {"direct": 0.7, "slim": 0.2, "full": 0.1},
            "speedup_modelled": 2.9,
        },
        system_attrs={"constraints": [MIN_FIDELITY - 0.41]},
    )


def populate(study: optuna.Study, seed: int = 0, export: bool = True) -> int | None:
    """12 complete trials (feasible, infeasible, plain SD with τ = 0, a replay-only one), one failed, one pruned;
    with ``export``, mark a feasible Pareto trial as exported (with held-out metrics) and return its number."""
    rng = random.Random(seed)
    study.set_user_attr("num_layers", NUM_LAYERS)
    study.set_user_attr("min_fidelity", MIN_FIDELITY)
    study.set_user_attr("target", "tiny/llama-8l")
    study.set_user_attr("draft", "tiny/llama-2l")
    study.set_user_attr("layer_importance", LAYER_IMPORTANCE)
    study.add_trial(_plain_sd_trial())
    for i in range(8):
        study.add_trial(_trial(rng, i, new_constraint_format=(i == 3)))
    study.add_trial(_trial(rng, 8, infeasible=True))
    study.add_trial(_trial(rng, 9, infeasible=True, new_constraint_format=True))
    study.add_trial(_replay_only_trial())
    study.add_trial(create_trial(state=TrialState.FAIL, params={}, distributions={}))
    study.add_trial(create_trial(state=TrialState.PRUNED, params={}, distributions={}))
    if not export:
        return None
    # Export a middle point of the feasible front, as the knee pick would.
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    front = sorted((p for p in trial_points(complete, MIN_FIDELITY) if p.pareto), key=lambda p: p.speedup)
    chosen = front[len(front) // 2].number
    study.set_user_attr("exported_trial", chosen)
    study.set_user_attr(
        f"held_out:{chosen}",
        {
            "speedup_measured": 1.7,
            "speedup_vs_sd": 1.2,
            "acceptance": 2.8,
            "fidelity": 0.95,
            "tier_shares": {"direct": 0.4, "slim": 0.35, "full": 0.25},
            "tier_time_s": {"draft": 0.3, "slim": 0.5, "full": 0.9},
            "held_out_prompts": 6,
        },
    )
    return chosen


def new_study(storage=None, name: str = "viasd-test") -> optuna.Study:
    return optuna.create_study(storage=storage, study_name=name, directions=["maximize", "maximize"])


def figure_divs(page) -> list[str]:
    """The figures a reader gets, in page order: each plotly div, which must have its Plotly.newPlot call."""
    assert list(page.figures) == page.figure_ids
    return [fid.removeprefix(dashboard.FIG_ID_PREFIX) for fid in page.figure_ids]


def figure(page, key: str) -> dict:
    return page.figures[dashboard.FIG_ID_PREFIX + key]


def counts(text: str) -> dict[str, int]:
    """The counts a sentence states, by the word after each number: "12 complete (9 feasible" -> {"complete": 12,
    "feasible": 9}. Tests check these facts, not the wording around them."""
    return {word: int(n) for n, word in re.findall(r"(?<![\d.#])(\d+) ([a-z]+)", text)}


def numbers(text: str) -> list[str]:
    """Every number in ``text`` as written (a trial number keeps its #)."""
    return re.findall(r"#?\d+(?:\.\d+)?(?:e-?\d+)?", text)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, int, optuna.Study]:
    study = new_study()
    exported = populate(study)
    path = dashboard.build_dashboard(study, tmp_path_factory.mktemp("dash") / "dashboard.html")
    return path, exported, study


# ------------------------------------------------------------------------------------------------ the file


def test_file_is_self_contained_with_every_figure(built):
    text = built[0].read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]+src=", text), "no external (or any src=) scripts"
    assert '<script src="http' not in text
    assert not re.search(r"<link[^>]+href=", text), "no external style sheets"
    assert len(re.findall(r"\* plotly\.js v\d", text)) == 1, "plotly.js embedded exactly once"
    page = read_page(text)
    assert figure_divs(page) == list(FIGURES)
    assert text.count("Plotly.newPlot(") == len(FIGURES)
    assert [k for k, s in page.sections.items() if s.figures] == list(FIGURES)  # one figure per section


def test_header_and_contract_details(built):
    path, exported, study = built
    page = read_page(path)
    assert page.title == page.h1 == "viasd-tune study viasd-test"
    facts = page.facts
    assert facts["target"] == "tiny/llama-8l" and facts["draft"] == "tiny/llama-2l"
    # 12 complete: 9 feasible (plain SD + 8), 3 infeasible (2 + replay-only); plus 1 failed, 1 pruned.
    assert counts(facts["trials"]) == {
        "complete": 12,
        "feasible": 9,  # plain SD + 8
        "infeasible": 3,  # 2 + the replay-only one
        "decoded": 11,
        "replayed": 1,
        "failed": 1,
        "pruned": 1,
    }
    assert facts["min fidelity"] == "0.9"
    star = study.trials[exported]
    calibration = [star.values[0], star.values[1], star.user_attrs["fidelity"]]
    held_out = [
        "6",
        "1.700",
        "1.200",
        "2.800",
        "0.9500",
    ]  # prompts, speedup vs AR and vs plain SD, acceptance, fidelity
    assert (
        numbers(facts["exported profile"])
        == [f"#{exported}"]
        + [format(v, f) for v, f in zip(calibration, (".3f", ".3f", ".4f"), strict=True)]
        + held_out
    )
    config = star.user_attrs["config"]
    assert facts["its routing"].startswith(f"skip attn {config['skip_attn']} mlp {config['skip_mlp']}; ")

    # The star on the front: at the exported trial's objectives, and annotated with its number there.
    pareto = figure(page, "pareto")
    (marker,) = traces(pareto, name=f"exported profile (#{exported})")
    assert trace_points(marker, "x", "y") == [tuple(star.values)]
    (note,) = [a for a in pareto["layout"]["annotations"] if a["text"].startswith("exported #")]
    assert note["text"].startswith(f"exported #{exported}<br>")
    assert (note["x"], note["y"]) == tuple(star.values)
    # Only the replay-only trial (#11) says it was never measured.
    hovers = [h for t in pareto["data"] for h in t.get("hovertext") or []]
    assert [h for h in hovers if "replay estimate only" in h] == [
        next(h for h in hovers if h.startswith("<b>trial #11</b>"))
    ]

    # The plain-SD point (#0, τ_accept = τ_escalate = 0) on the log threshold map: labelled τ=0, drawn at
    # the floor the dashed lines and the note name, below every positive threshold.
    thresholds = figure(page, "thresholds")
    labelled = [
        (x, y, hover)
        for t in thresholds["data"]
        if "text" in t
        for x, y, text, hover in trace_points(t, "x", "y", "text", "hovertext")
        if text == "τ=0"
    ]
    assert len(labelled) == 1
    x, y, hover = labelled[0]
    assert hover.startswith("<b>trial #0</b>") and hover.count("(drawn at floor)") == 2
    (floor_note,) = thresholds["layout"]["annotations"]
    assert numbers(floor_note["text"]) == ["0", f"{x:g}"]  # τ = 0, drawn at x
    assert x == y and {s["x0"] for s in thresholds["layout"]["shapes"] if s["x0"] == s["x1"]} == {x}
    positive = [
        v
        for t in study.trials[1:12]
        for v in (t.user_attrs["config"]["tau_accept"], t.user_attrs["config"]["tau_escalate"])
    ]
    assert 0 < x < min(positive)
    caption = page.sections["thresholds"].captions[0]
    assert counts(caption)["trials"] == 12 and numbers(caption)[-1] == f"{x:g}"


def test_pareto_marking_matches_the_definition(tmp_path):
    study = new_study()
    populate(study)
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    points = trial_points(trials, MIN_FIDELITY)
    feasible = [p for p in points if p.feasible]
    for p in feasible:
        beaten = any(
            q.speedup >= p.speedup
            and q.acceptance >= p.acceptance
            and (q.speedup, q.acceptance) != (p.speedup, p.acceptance)
            for q in feasible
        )
        assert p.pareto is not beaten, p.number
    assert not any(p.pareto for p in points if not p.feasible)
    assert sorted(p.number for p in points if not p.feasible) == [9, 10, 11]  # both constraint formats read
    # The ringed front a reader sees is that set, drawn left to right.
    page = read_page(dashboard.build_dashboard(study, tmp_path / "d.html"))
    (front,) = [t for t in figure(page, "pareto")["data"] if t["name"].startswith("feasible Pareto front")]
    expected = sorted((p.speedup, p.acceptance) for p in points if p.pareto)
    assert (
        trace_points(front, "x", "y") == expected
        and front["name"] == f"feasible Pareto front ({len(expected)})"
    )


def test_falls_back_when_nothing_is_exported(tmp_path):
    study = new_study()
    populate(study, export=False)
    page = read_page(dashboard.build_dashboard(study, tmp_path / "d.html", title="my <run>"))
    assert page.title == page.h1 == "my <run>"  # escaped in the file, so a reader sees it as written
    assert page.facts["exported profile"] == "none yet"
    best = max(
        (t for t in study.get_trials(states=(TrialState.COMPLETE,)) if t.user_attrs["feasible"]),
        key=lambda t: t.values[0],
    )
    (caption,) = page.sections["tokens"].captions
    assert numbers(caption) == [f"#{best.number}"]  # the best-speedup feasible trial stands in
    (shares, _) = figure(page, "tokens")["data"]
    assert dict(zip(shares["x"], shares["y"], strict=True)) == best.user_attrs["tier_shares"]
    assert figure_divs(page) == list(FIGURES)
    pareto = figure(page, "pareto")
    assert not [t for t in pareto["data"] if t["name"].startswith("exported")]
    assert [a["text"] for a in pareto["layout"]["annotations"]] == ["target AR"]


def test_importance_failure_becomes_a_note(tmp_path):
    study = new_study()
    study.set_user_attr("num_layers", NUM_LAYERS)
    study.add_trial(_plain_sd_trial())  # one trial: importances cannot be computed
    text = dashboard.build_dashboard(study, tmp_path / "d.html").read_text(encoding="utf-8")
    page = read_page(text)
    # nor is there a layer importance: a study from before seeding
    assert figure_divs(page) == [f for f in FIGURES if f not in ("importances", "layer_importance")]
    assert page.sections["layer_importance"].notes[0].startswith("No layer importance in this study")
    (note,) = page.sections["importances"].notes
    assert note.startswith("parameter importances unavailable")
    assert len(re.findall(r"\* plotly\.js v\d", text)) == 1


def test_an_importance_error_becomes_a_note(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("Cannot evaluate parameter importances with only a single trial.\nmore")

    monkeypatch.setattr(optuna.importance, "get_param_importances", boom)
    study = new_study()
    populate(study)
    page = read_page(dashboard.build_dashboard(study, tmp_path / "d.html"))
    assert figure_divs(page) == [f for f in FIGURES if f != "importances"]
    (note,) = page.sections["importances"].notes
    assert "Cannot evaluate parameter importances with only a single trial." in note  # Optuna's reason ...
    assert "more" not in note  # ... its first line only


def test_a_study_without_complete_trials_is_a_user_error(tmp_path):
    study = new_study()
    study.add_trial(create_trial(state=TrialState.FAIL, params={}, distributions={}))
    with pytest.raises(UserError, match="no complete trial"):
        dashboard.build_dashboard(study, tmp_path / "d.html")
    assert not (tmp_path / "d.html").exists()


def test_layer_importance_map_shows_the_stored_scores(built):
    page = read_page(built[0])
    (heat,) = figure(page, "layer_importance")["data"]
    z = [
        [None if v is None or v != v else v for v in row]
        for row in np.asarray(heat["z"], dtype=float).tolist()
    ]
    assert z == [list(pair) for pair in zip(*LAYER_IMPORTANCE["drop"].values(), strict=True)]
    assert heat["x"] == ["attention", "MLP"]
    assert "not scored" in heat["hovertext"][0][0] and "30.0" in numbers(heat["hovertext"][5][0])  # drop 0.3
    caption = page.sections["layer_importance"].captions[0]
    assert counts(caption)["positions"] == 120 and counts(caption)["tokens"] == 8  # positions, block size
    assert {"2", "4"} <= set(numbers(caption))  # ms one skipped attention / MLP sub-layer saves per block


def test_speed_vs_fidelity_scatter(built):
    path, exported, study = built
    page = read_page(path)
    fig = figure(page, "fidelity")
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    (decoded,) = traces(fig, name=f"decoded for real ({len(complete) - 1})")
    assert sorted(trace_points(decoded, "x", "y")) == sorted(
        (t.user_attrs["fidelity"], t.values[0]) for t in complete if t.user_attrs["measured"]
    )
    (replayed,) = traces(fig, name="replayed only (modelled speedup) (1)")
    assert trace_points(replayed, "x", "y") == [(0.41, 2.9)]
    (star,) = traces(fig, name=f"exported profile (#{exported})")
    assert trace_points(star, "x", "y") == [
        (study.trials[exported].user_attrs["fidelity"], study.trials[exported].values[0])
    ]
    assert [s["x0"] for s in fig["layout"]["shapes"] if s["x0"] == s["x1"]] == [MIN_FIDELITY]


def test_a_banner_when_the_export_is_slower_than_plain_decoding(tmp_path, built):
    assert "Slower than plain decoding" not in read_page(built[0]).text  # held-out 1.7x: no banner
    study = new_study()
    chosen = populate(study)
    held = dict(study.user_attrs[f"held_out:{chosen}"], speedup_measured=0.85)
    study.set_user_attr(f"held_out:{chosen}", held)
    text = dashboard.build_dashboard(study, tmp_path / "d.html").read_text(encoding="utf-8")
    (banner,) = re.findall(r'<p class="note" id="slower-than-ar">(.*?)</p>', text, flags=re.DOTALL)
    assert numbers(banner) == [
        f"#{chosen}",
        "0.85",
        "6",
    ]  # the pick, its held-out speedup, on how many prompts


def test_a_replayed_trial_never_joins_the_front(tmp_path):
    """A trial only replayed (modelled objectives) can meet the constraint on its estimate; it is plotted but
    is not a front point, as the export's front holds decoded trials only."""
    study = new_study()
    populate(study, export=False)
    t = _replay_only_trial()
    study.add_trial(
        create_trial(
            values=[9.0, 9.0],
            params=t.params,
            distributions=t.distributions,
            user_attrs={**t.user_attrs, "fidelity": MIN_FIDELITY + 0.05, "screened": "dominated"},
            system_attrs={"constraints": [-0.05]},
        )
    )
    points = trial_points(study.get_trials(states=(TrialState.COMPLETE,)), MIN_FIDELITY)
    (p,) = [p for p in points if p.speedup == 9.0]
    assert p.feasible and not p.pareto
    assert any(q.pareto for q in points)


def test_an_export_with_nothing_to_export_still_writes_the_dashboard(tmp_path):
    """The search hands its dashboard writer to the export: with no feasible trial the export refuses, after
    writing the dashboard (the study is still worth looking at); with no complete trial it skips it."""
    from viasd_tune.search.export import export_study

    study = new_study()
    study.set_user_attr("min_fidelity", MIN_FIDELITY)
    study.add_trial(_trial(random.Random(0), 0, infeasible=True))
    with pytest.raises(UserError, match="no measured trial meeting min fidelity"):
        export_study(study, tmp_path, dashboard=dashboard.write_beside_profile)
    assert figure_divs(read_page(tmp_path / "dashboard.html"))[0] == "pareto"
    assert not (tmp_path / "profile.json").exists()
    assert dashboard.write_beside_profile(new_study(), tmp_path / "empty", None) is None


# ------------------------------------------------------------------------------------------------ loading


def test_dashboard_from_storage(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    populate(new_study(url, "alpha"))
    new_study(url, "empty")
    out = dashboard.dashboard_from_storage(url, "alpha", tmp_path / "a.html")
    assert figure_divs(read_page(out)) == list(FIGURES)

    with pytest.raises(UserError) as e:
        dashboard.dashboard_from_storage(url, "beta", tmp_path / "b.html")
    assert "\n" not in str(e.value)
    assert re.findall(r"'(\w+)'", str(e.value)) == [
        "beta",
        "alpha",
        "empty",
    ]  # the one asked for, those there
    with pytest.raises(UserError, match="'empty' .* has no complete trial"):
        dashboard.dashboard_from_storage(url, "empty", tmp_path / "b.html")
    with pytest.raises(UserError, match="no Optuna database at"):
        dashboard.dashboard_from_storage(f"sqlite:///{tmp_path / 'nope.db'}", "alpha", tmp_path / "b.html")
    assert not (tmp_path / "nope.db").exists()
    assert not (tmp_path / "b.html").exists()


def test_dashboard_from_out_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    url = f"sqlite:///{run / 'study.db'}"
    populate(new_study(url, "run"))
    out = dashboard.dashboard_from_out_dir(run)
    assert out == run / "dashboard.html"
    assert figure_divs(read_page(out)) == list(FIGURES)

    # A second study: ambiguous until profile.json's provenance names one.
    study2 = new_study(url, "second")
    populate(study2, seed=1, export=False)
    with pytest.raises(UserError, match="holds 2 studies"):
        dashboard.dashboard_from_out_dir(run)
    (run / "profile.json").write_text(json.dumps({"provenance": {"study": "second", "trial": 2}}))
    page = read_page(dashboard.dashboard_from_out_dir(run, tmp_path / "custom.html"))
    assert page.title == "viasd-tune study second"
    stars = [t for t in figure(page, "pareto")["data"] if t["name"].startswith("exported")]
    assert [t["name"] for t in stars] == ["exported profile (#2)"]  # the profile's trial is starred

    with pytest.raises(UserError, match="no study.db"):
        dashboard.dashboard_from_out_dir(tmp_path)
    with pytest.raises(UserError, match="not a directory"):
        dashboard.dashboard_from_out_dir(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    new_study(f"sqlite:///{empty / 'study.db'}", "empty")
    with pytest.raises(UserError, match="has no complete trial"):
        dashboard.dashboard_from_out_dir(empty)


# ------------------------------------------------------------------------------------------------ browser


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"{CHROMIUM} not found; install it with: apt-get install -y chromium",
)
def test_renders_in_headless_chromium(built):
    started = time.monotonic()
    shot = Path("/tmp/viasd-dashboard.png")
    report = load_page(built[0], screenshot=shot, width=1200, height=3000)
    assert report.errors == [], report.errors
    assert report.remote_requests == [], "the dashboard must not touch the network"
    assert [f["id"] for f in report.figures] == [dashboard.FIG_ID_PREFIX + f for f in FIGURES]
    for f in report.figures:
        assert f["main_svg"] >= 1 and f["plot_container"] == 1, f
        assert f["drawn"] > 0, f  # markers, bars or heat-map cells actually painted
        assert 900 <= f["width"] <= 1100 and f["height"] >= 250, f
    assert shot.stat().st_size > 50_000
    assert time.monotonic() - started < 30


def test_a_tree_trial_shows_its_tree(tmp_path):
    """A tree configuration's node budget and each source's depth and width, in its hover and in the exported
    profile's row; chain trials say nothing of trees."""
    study = new_study()
    populate(study, export=False)
    t = _plain_sd_trial()
    tree = {"drafter": "lookup+recycle", "tree_nodes": 16, "tree_lookup_depth": 7, "tree_lookup_width": 3,
            "tree_recycle_depth": 5, "tree_recycle_width": 2, "tree_model_depth": 4, "tree_model_width": 4}  # fmt: skip
    study.add_trial(
        create_trial(
            values=[3.0, 3.1],
            params=t.params,
            distributions=t.distributions,
            user_attrs={**t.user_attrs, "config": {**t.user_attrs["config"], **tree}},
            system_attrs=t.system_attrs,
        )
    )
    number = len(study.trials) - 1
    study.set_user_attr("exported_trial", number)
    page = read_page(dashboard.build_dashboard(study, tmp_path / "dashboard.html"))
    want = "tree of 16 nodes · lookup depth 7 width 3 · recycle depth 5 width 2"
    assert want in page.facts["its routing"]
    hovers = [h for t in figure(page, "pareto")["data"] for h in t.get("hovertext") or []]
    # its point and the export's star: one text
    (mine,) = {h for h in hovers if h.startswith(f"<b>trial #{number}</b>")}
    assert want in mine and "model depth" not in mine
    assert all("tree of" not in h for h in hovers if h != mine)

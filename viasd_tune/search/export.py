"""From a finished study to profiles: the feasible Pareto front, its knee, and profile JSON built from the
study's own records (so ``viasd-tune export`` needs no models)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

import optuna

from ..config import DecodeConfig, model_drafter
from ..errors import UserError
from ..profile import SCHEMA_VERSION, package_versions, write_profile
from ..rule import apply_rule, fit_rule, leaves, one_leaf
from .front import pareto_front
from .records import StudyRecord, TrialRecord

# Writes the study's dashboard into a search's output folder (the exported trial starred, or None) and returns
# its path, or None when there is nothing to draw: viasd_tune.dashboard.write_beside_profile. The dashboard sits
# above the search (it reads the study's records), so the caller hands it in.
DashboardWriter: TypeAlias = Callable[[optuna.Study, Path, "int | None"], "Path | None"]
PICKS = ("auto", "knee", "fastest", "most-faithful", "routed")
# Calibration speedups this close to the fastest are within run-to-run noise (a few %): among them, the
# higher acceptance wins (it carries over to other hosts; a wall-clock edge this small may not).
SPEED_NOISE = 0.03
# Tree depths tried; the one with the least left-out time wins. A rule a person reads at a glance: on 30 Qwen
# calibration prompts depth 2 fitted noise (a copy_share split at 0.03) and lost the left-out check depth 1 passed.
ROUTE_DEPTHS = (1, 2)
# The tree must save this share of the best single configuration's time, or the rule is one leaf.
ROUTE_GAIN = 0.02
# ... and its left-out saving must clear this many standard errors of the per-prompt savings: on 12 prompts of
# pure timing noise, 8 seeds of 20 passed the 2 % checks, 4 of those at 2 standard errors or more.
ROUTE_T = 2.0


def feasible_measured(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Complete trials confirmed by real decoding that meet the fidelity constraint."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [t for t in complete if (r := TrialRecord.read(t)).measured and r.feasible]


def knee(front: list[optuna.trial.FrozenTrial]) -> optuna.trial.FrozenTrial:
    """The front point closest to the ideal corner, each objective measured as its relative shortfall from
    the front's best (1 - value / best). Relative, not min-max scaling: on a front whose acceptances span
    1.29–1.35 and speedups 0.65–0.94×, min-max scaling made a 5 % acceptance gain weigh as much as a 30 %
    speed loss and exported the slow point."""
    best = [max(t.values[i] for t in front) for i in range(2)]

    def gap(t) -> float:
        return sum((1 - t.values[i] / best[i]) ** 2 for i in range(2) if best[i] > 0)

    return min(front, key=gap)


def auto(pool: list[optuna.trial.FrozenTrial]) -> optuna.trial.FrozenTrial:
    """The default pick: the fastest trial, acceptance breaking near-ties (within ``SPEED_NOISE``). Speed is
    what a user ships the profile for; the knee weighs acceptance as much as speed and, on the Qwen pair,
    exported the draft model at γ 12 (acceptance 4.3, 1.14x) over lookup+model (acceptance 2.5, 1.34x), which
    then ran 0.81x plain decoding held out."""
    top = max(t.values[0] for t in pool)
    return max(
        (t for t in pool if t.values[0] >= (1 - SPEED_NOISE) * top), key=lambda t: (t.values[1], t.values[0])
    )


def check_pick(pick: str) -> int | None:
    """Refuse an unknown ``--pick`` before any study is read; the trial number of ``trial:N``, else ``None``.
    ``N`` is a trial number as the dashboard shows it (0, 1, ...), never a Python index from the end."""
    if pick.startswith("trial:"):
        number = pick.split(":", 1)[1]
        if not (number.isascii() and number.isdigit()):
            raise UserError(f"--pick {pick}: N in trial:N must be a trial number, 0 or more (e.g. trial:3)")
        return int(number)
    if pick not in PICKS:
        raise UserError(f"unknown --pick {pick!r}; use auto, knee, fastest, most-faithful, routed or trial:N")
    return None


def pick_trial(study: optuna.Study, pick: str) -> optuna.trial.FrozenTrial:
    """``auto``, ``knee``, ``fastest``, ``most-faithful`` (among feasible measured trials) or ``trial:N``."""
    number = check_pick(pick)
    if number is not None:
        trial = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
        if trial is None:
            raise UserError(
                f"--pick {pick}: no trial {number} in study {study.study_name!r} ({len(study.trials)} trials, "
                "numbered from 0)"
            )
        if trial.state != optuna.trial.TrialState.COMPLETE:
            raise UserError(
                f"--pick {pick}: that trial is {trial.state.name}, not COMPLETE; pick a finished one"
            )
        return trial
    pool = feasible_measured(study)
    if not pool:
        raise UserError(
            f"study {study.study_name!r} has no measured trial meeting min fidelity "
            f"{StudyRecord.read(study).min_fidelity}; run more trials, lower --min-fidelity, or --pick trial:N"
        )
    if pick == "auto":
        return auto(pool)
    if pick == "knee":
        return knee(pareto_front(pool))
    if pick == "fastest":
        return max(pool, key=lambda t: t.values[0])
    if pick == "most-faithful":
        return max(pool, key=lambda t: (TrialRecord.read(t).fidelity, t.values[0]))
    if pick == "routed":
        raise UserError("--pick routed writes a routed profile; use it with `viasd-tune export`")
    raise UserError(f"unknown --pick {pick!r}; use auto, knee, fastest, most-faithful, routed or trial:N")


def build_profile(study: optuna.Study, trial: optuna.trial.FrozenTrial, held_out: dict | None = None) -> dict:
    """A routing profile for ``trial``; metrics from the held-out evaluation when given, else calibration."""
    a, record = StudyRecord.read(study), TrialRecord.read(trial)
    decoding = record.decode_config().to_profile()
    draft: dict = {"kind": decoding["drafter"], "name": None, "fingerprint": None, **decoding.pop("draft")}
    if model_drafter(draft["kind"]) == "model":
        draft.update(name=a.draft, fingerprint=a.draft_fingerprint)
    shares = record.tier_shares or {"direct": 0.0, "slim": 0.0, "full": 1.0}
    metrics = held_out or {
        "speedup_measured": trial.values[0],
        "speedup_vs_sd": None,
        "acceptance": trial.values[1],
        "fidelity": record.fidelity,
        "tier_shares": shares,
        "held_out_prompts": 0,
    }
    metrics = {
        **metrics,
        "speedup_modelled": record.speedup_modelled,
        "evaluated_on": "held_out" if held_out else "calibration",
    }
    metrics["acceptance_definition"] = (
        "tokens emitted per full-target-equivalent forward (a slim forward counts as the share of sub-layers it runs)"
    )
    return {
        "schema_version": SCHEMA_VERSION,
        "target": {"name": a.target, "fingerprint": a.target_fingerprint},
        "draft": draft,
        **decoding,
        "dtype": a.dtype,
        "device": a.device,
        "metrics": metrics,
        "calibration": {k: a.calibration[k] for k in ("source", "prompt_ids", "fingerprint")},
        "provenance": {
            "study": study.study_name,
            "trial": trial.number,
            "storage": a.storage if a.storage is not None else "",
            # The host its speed was measured on: a verify block costs ~1 step with AMX, 3.3 without native bf16.
            "matrix_isa": record.matrix_isa or (a.matrix_isa if a.matrix_isa is not None else "unknown"),
            "versions": package_versions(),
            "created_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        },
    }


def _route_candidates(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Feasible measured trials with per-prompt times: the Pareto front plus the fastest of each drafter kind
    (the front ranks by overall speed and acceptance, so it can miss the configuration that wins one kind of
    prompt)."""
    n = len(StudyRecord.read(study).calibration["prompt_ids"])
    pool = [t for t in feasible_measured(study) if len(TrialRecord.read(t).prompt_s_per_token or ()) == n]
    chosen = {t.number: t for t in pareto_front(pool)}
    drafter = {t.number: TrialRecord.read(t).decode_config().drafter for t in pool}
    for kind in set(drafter.values()):
        best = max((t for t in pool if drafter[t.number] == kind), key=lambda t: t.values[0])
        chosen.setdefault(best.number, best)
    return sorted(chosen.values(), key=lambda t: t.number)


def _side_by_side(candidates: list[optuna.trial.FrozenTrial]):
    """Seconds per token, rows prompts, columns AR then each candidate, from ratios measured side by side:
    each trial decoded every prompt interleaved with AR, but trials run minutes apart on a host whose speed
    drifts (in benchmarks/results/study-qwen-lh.db AR ran 8 % slower during the second trial, in every task
    group). So a candidate's time on a prompt is its ratio to the AR run beside it times that prompt's mean AR
    time over the trials: absolute times from different trials are never compared."""
    import numpy as np

    records = [TrialRecord.read(t) for t in candidates]
    ar_runs = np.array([r.ar_prompt_s_per_token for r in records], dtype=np.float64)
    times = np.array([r.prompt_s_per_token for r in records], dtype=np.float64)
    ar = ar_runs.mean(axis=0)
    return np.column_stack([ar, *(times / np.maximum(ar_runs, 1e-12) * ar)])


def _fit(features: list[dict], cost, depth: int) -> dict:
    """The tree over prompt features whose leaves name the configuration with the least time per token, each
    prompt weighted by what the right choice saves on it over the runner-up (near-ties barely count)."""
    import numpy as np

    ranked = np.sort(cost, axis=1)
    margin = ranked[:, 1] - ranked[:, 0] if cost.shape[1] > 1 else np.zeros(len(cost))
    return fit_rule(features, cost.argmin(axis=1).tolist(), max_depth=depth, weights=margin + 1e-12)


def _left_out(features: list[dict], cost, depth: int):
    """Leave-one-out seconds per token per prompt: each prompt served by the rule of this depth fitted on the
    other prompts."""
    import numpy as np

    n = len(features)
    if n < 2:
        return cost.min(axis=1)
    rest = [[j for j in range(n) if j != i] for i in range(n)]
    return np.array(
        [
            cost[i, apply_rule(_fit([features[j] for j in r], cost[r], depth), features[i])]
            for i, r in enumerate(rest)
        ]
    )


def _left_out_single(cost):
    """Leave-one-out seconds per token per prompt of the best single configuration picked on the other prompts
    (the same for every depth, so computed once)."""
    import numpy as np

    n = len(cost)
    if n < 2:
        return cost.min(axis=1)
    totals = cost.sum(axis=0)
    return np.array([cost[i, int((totals - cost[i]).argmin())] for i in range(n)])


def _saving_t(routed, single) -> float:
    """How many standard errors the mean per-prompt saving (single - routed) is above zero."""
    import numpy as np

    saving = single - routed
    if len(saving) < 2:
        return 0.0
    se = float(np.std(saving, ddof=1)) / np.sqrt(len(saving))
    return float(np.mean(saving)) / max(se, 1e-12)  # finite, so the profile stays plain JSON


def routed_profile(study: optuna.Study) -> dict:
    """A routed profile: plain decoding and the candidate trials' configurations, and a decision tree fitted on
    the calibration prompts (label: the configuration with the least time per token on that prompt, relative to
    the AR run beside it: ``_side_by_side``). The depth is the one whose tree serves the prompts fastest left
    out (each prompt routed by a tree fitted on the others). When the tree saves less than ``ROUTE_GAIN`` of the
    best single configuration's time, in sample or left out, or its left-out saving is under ``ROUTE_T``
    standard errors, the rule is one leaf naming that configuration."""
    import numpy as np

    a = StudyRecord.read(study)
    features = (a.calibration or {}).get("features")
    candidates = _route_candidates(study) if features else []
    if not candidates:
        raise UserError(
            f"study {study.study_name!r} has no per-prompt timings (searched before routed export existed, or no "
            "feasible measured trial); run the search again with this version, or use --pick knee"
        )
    cost = _side_by_side(candidates)
    ar = cost[:, 0]
    configs = [DecodeConfig(mode="ar", drafter="lookup")] + [
        TrialRecord.read(t).decode_config() for t in candidates
    ]
    names = ["ar"] + [f"trial-{t.number}" for t in candidates]
    labels = cost.argmin(axis=1)
    single = int(cost.sum(axis=0).argmin())
    left_out = {d: _left_out(features, cost, d) for d in ROUTE_DEPTHS}
    left_out_single = _left_out_single(cost)
    depth = min(ROUTE_DEPTHS, key=lambda d: left_out[d].sum())  # the first (shallowest) of equals
    loo_t = _saving_t(left_out[depth], left_out_single)
    loo_routed, loo_single = float(left_out[depth].sum()), float(left_out_single.sum())
    rule = _fit(features, cost, depth)
    picked = [apply_rule(rule, f) for f in features]
    routed_s = float(cost[np.arange(len(picked)), picked].sum())
    # The tree must pay in sample and on prompts it was not fitted on, clearly above the spread of what it
    # saves per prompt: a few dozen noisy timings fit easily.
    if (
        routed_s > (1 - ROUTE_GAIN) * cost[:, single].sum()
        or loo_routed > (1 - ROUTE_GAIN) * loo_single
        or loo_t < ROUTE_T
    ):
        rule, picked, routed_s = one_leaf(single), [single] * len(features), float(cost[:, single].sum())
    used = sorted(set(leaves(rule)))  # keep only the configurations the rule can pick, renumbered
    remap = {k: i for i, k in enumerate(used)}
    for node in rule["nodes"]:
        if "config" in node:
            node["config"] = remap[node["config"]]
    fallback = single if single in used else used[0]
    routes = {
        "configurations": [{"name": names[k], **configs[k].to_profile()} for k in used],
        "rule": rule,
        "fit": {
            "candidates": names,
            "best_per_prompt": [names[k] for k in labels],
            "served_per_prompt": [names[k] for k in picked],
            "seconds_per_token": {
                "routed": routed_s,
                "best_single": float(cost[:, single].sum()),
                "ar": float(ar.sum()),
            },
            "best_single": names[single],
            "left_out_seconds_per_token": {"routed": loo_routed, "best_single": loo_single},
            "depth": depth,
            "left_out_routed_by_depth": {str(d): float(left_out[d].sum()) for d in ROUTE_DEPTHS},
            "left_out_saving_standard_errors": loo_t,
            "evaluated_on": "calibration (in sample)",
        },
    }
    front = candidates[-1] if fallback == 0 else candidates[fallback - 1]
    profile = build_profile(study, front)
    profile.update({k: v for k, v in configs[fallback].to_profile().items() if k != "draft"})
    uses_model = any(configs[k].model_drafter == "model" and configs[k].mode != "ar" for k in used)
    profile["draft"] = {
        **configs[fallback].to_profile()["draft"],
        "name": a.draft if uses_model else None,
        "fingerprint": a.draft_fingerprint if uses_model else None,
    }
    if fallback == 0:  # plain decoding: what it does is known, whatever trial lent the evidence fields
        shares = {"direct": 0.0, "slim": 0.0, "full": 1.0}
        profile["metrics"].update(acceptance=1.0, fidelity=1.0, tier_shares=shares, speedup_modelled=None)
    profile["metrics"] = {
        **profile["metrics"],
        "metrics_of": f"speedups: the routed rule and the best single configuration, per token over the "
        f"calibration prompts; acceptance, fidelity, tier shares: the fallback configuration {names[fallback]}",
        "speedup_measured": float(ar.sum()) / routed_s,
        "speedup_best_single": float(ar.sum() / cost[:, single].sum()),
        "evaluated_on": "calibration (in sample)",
        "routed_configuration": names[fallback],
    }
    profile["routes"] = routes
    return profile


def plain_decoding_profile(profile: dict, trial: int, held: dict) -> dict:
    """``profile`` turned into plain decoding (``mode: ar``), with why: the best speculative configuration the
    search found ran slower than plain decoding on the held-out prompts."""
    why = (
        f"trial #{trial}, the search's pick, ran at {held['speedup_measured']:.2f}x plain decoding on the "
        f"{held['held_out_prompts']} held-out prompts (acceptance {held['acceptance']:.2f} tokens per "
        f"full-target forward, tier shares direct/slim/full "
        + "/".join(f"{held['tier_shares'][k]:.0%}" for k in ("direct", "slim", "full"))
        + "); plain decoding is exported instead"
    )
    metrics = {
        "speedup_measured": 1.0,
        "speedup_modelled": None,
        "speedup_vs_sd": None,
        "acceptance": 1.0,
        "fidelity": 1.0,
        "tier_shares": {"direct": 0.0, "slim": 0.0, "full": 1.0},
        "held_out_prompts": held["held_out_prompts"],
        "evaluated_on": "held_out",
        "plain_decoding_because": why,
        "best_speculative": {"trial": trial, **held},
    }
    decoding = DecodeConfig(mode="ar", drafter="lookup").to_profile()  # plain decoding needs no draft model
    draft = {"kind": decoding["drafter"], "name": None, "fingerprint": None, **decoding.pop("draft")}
    return {**profile, **decoding, "draft": draft, "metrics": metrics}


def export_study(
    study: optuna.Study,
    out: Path,
    pick: str = "auto",
    evaluate: Callable[[DecodeConfig], dict] | None = None,
    dashboard: DashboardWriter | None = None,
) -> dict:
    """Write ``out/profile.json`` (the pick, held-out metrics when ``evaluate`` is given), every feasible Pareto
    trial under ``out/pareto/``, the dashboard when given its writer, and return a summary."""
    try:
        chosen = pick_trial(study, pick)
    except UserError:
        if dashboard is not None:  # nothing to export, but the study is still worth looking at
            dashboard(study, out, None)
        raise
    # Finished trials are read-only in Optuna, so held-out metrics live in the study's attrs.
    held = StudyRecord.read(study).held_out.get(chosen.number)
    if evaluate is not None and held is None:
        held = evaluate(TrialRecord.read(chosen).decode_config())
        StudyRecord(held_out={chosen.number: held}).write(study)
    profile = build_profile(study, chosen, held)
    config = TrialRecord.read(chosen).config
    if held is not None and held["speedup_measured"] < 1.0:
        # A pick by rule never ships something slower than not using the tool; a trial named by the user does.
        if not pick.startswith("trial:"):
            profile = plain_decoding_profile(profile, chosen.number, held)
            config = DecodeConfig(mode="ar", drafter="lookup").to_dict()
        else:  # the user asked for this trial by name: export it, but say so
            profile["metrics"]["slower_than_ar"] = True
    out.mkdir(parents=True, exist_ok=True)
    write_profile(out / "profile.json", profile)
    front = pareto_front(feasible_measured(study))
    for t in front:
        write_profile(out / "pareto" / f"trial-{t.number:04d}.json", build_profile(study, t))
    StudyRecord(exported_trial=chosen.number).write(study)
    page = dashboard(study, out, chosen.number) if dashboard is not None else None
    return {
        "profile": str(out / "profile.json"),
        "trial": chosen.number,
        "pareto": len(front),
        "metrics": profile["metrics"],
        "config": config,
        "dashboard": str(page) if page else None,
    }

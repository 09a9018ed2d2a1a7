"""Screening: which replayed trials are worth decoding for real, and how well the replay matched decoding.

A trial whose replayed fidelity is clearly below ``--min-fidelity``, or that could not enter the measured
feasible front, keeps the replay's estimates (``measured=False``); the others are decoded, and their replayed
and measured tier shares are compared (:func:`replay_check`).
"""

from __future__ import annotations

import statistics

import optuna

from .records import TIERS, TrialRecord

ESTIMATE_MARGIN = 0.03  # trials estimated this far below min fidelity are not worth decoding for real
FRONT_SLACK = 0.1  # a replayed trial is decoded unless a measured feasible one beats it by this much on both
# A reference point is decoded unless plain decoding or a measured feasible trial runs this many times its
# predicted speedup: then its replay already says it is no bar to beat (on SmolLM2 the no-skip VIA-SD point with
# the self-draft replays at 0.46x AR, decodes at 0.39x and cost ~106 s of the main command's 15 minutes).
REFERENCE_MARGIN = 2.0
# Replayed and measured tier shares (direct / slim / full) of a decoded trial may differ by this much: the replay
# runs the engine itself, but its batched forwards and decoding's incremental ones round apart in bf16 (a flipped
# near-tie changes the rest of the output). The study records it with how many decoded trials stayed within it
# (``replay_check``).
REPLAY_TOLERANCE = 0.05


def finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def screened_out(
    study: optuna.Study,
    trial: optuna.trial.BaseTrial,
    fidelity: float,
    modelled: float,
    acceptance: float,
    min_fidelity: float,
) -> str | None:
    """Why a replayed trial is not decoded for real (``"fidelity"``, ``"dominated"`` or ``"slow"``), or
    ``None``. The enqueued reference points (no skip, plain SD per drafter) are the bars a profile must beat, so
    each is decoded unless plain decoding or a measured trial runs ``REFERENCE_MARGIN`` times its predicted
    speed."""
    if fidelity < min_fidelity - ESTIMATE_MARGIN:
        return "fidelity"
    if TrialRecord.read(trial).reference:
        return "slow" if far_slower_than_measured(study, modelled) else None
    if not could_enter_front(study, modelled, acceptance):
        return "dominated"
    return None


def _measured(study: optuna.Study) -> tuple[list[optuna.trial.FrozenTrial], float]:
    """The measured feasible trials, and the median measured/modelled speedup ratio over them (1 if none): what
    puts a replayed trial's modelled speedup on the measured scale."""
    TS = optuna.trial.TrialState
    records = [(t, TrialRecord.read(t)) for t in study.get_trials(deepcopy=False, states=(TS.COMPLETE,))]
    measured = [(t, r) for t, r in records if r.measured and r.feasible]
    ratios = [
        t.values[0] / r.speedup_modelled
        for t, r in measured
        if r.speedup_modelled is not None and finite(r.speedup_modelled) and r.speedup_modelled > 0
    ]
    return [t for t, _ in measured], statistics.median(ratios) if ratios else 1.0


def far_slower_than_measured(study: optuna.Study, modelled: float) -> bool:
    """Whether plain decoding (speedup 1: every decoded trial measures it beside itself) or a measured feasible
    trial runs ``REFERENCE_MARGIN`` times a replayed trial's predicted speedup."""
    measured, ratio = _measured(study)
    best = max([1.0, *(t.values[0] for t in measured)])
    return best >= modelled * ratio * REFERENCE_MARGIN


def could_enter_front(study: optuna.Study, modelled: float, acceptance: float) -> bool:
    """Whether a replayed trial might join the measured feasible Pareto front, so that decoding it for real is
    worth its cost. Its modelled speedup is put on the measured scale by the median measured/modelled ratio of
    the measured trials, and it is ruled out only when a measured feasible trial beats it by ``FRONT_SLACK`` on
    both objectives (the replay and the cost model are approximations)."""
    measured, ratio = _measured(study)
    predicted = modelled * ratio
    return not any(
        t.values[0] >= predicted * (1 + FRONT_SLACK) and t.values[1] >= acceptance * (1 + FRONT_SLACK)
        for t in measured
    )


def tier_shares(tiers: tuple[int, int, int], tokens: int) -> dict[str, float]:
    """Tokens emitted by each tier (direct, slim, full) as shares of all emitted tokens."""
    return {k: t / max(tokens, 1) for k, t in zip(TIERS, tiers, strict=True)}


def replay_check(study: optuna.Study) -> dict:
    """How well the replay's tier shares matched real decoding on the decoded trials (``REPLAY_TOLERANCE``)."""
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    gaps = [r.replay_gap for r in map(TrialRecord.read, complete) if r.replay_gap is not None]
    return {
        "tolerance": REPLAY_TOLERANCE,
        "trials": len(gaps),
        "within": sum(g <= REPLAY_TOLERANCE for g in gaps),
        "max_gap": max(gaps, default=0.0),
    }

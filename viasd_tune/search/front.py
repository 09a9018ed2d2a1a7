"""The one Pareto front of a study's two objectives (speedup, acceptance), for the export and the dashboard."""

from __future__ import annotations

import math
from collections.abc import Iterable

from optuna.trial import FrozenTrial


def pareto_front(trials: Iterable[FrozenTrial]) -> list[FrozenTrial]:
    """The trials no other one beats on both objectives (identical points do not beat each other), in
    increasing speedup (ties in the given order).

    The caller chooses the pool (e.g. only feasible trials). A sweep in decreasing speedup: a trial is dominated
    iff an earlier one has a higher acceptance, or the same acceptance at a strictly higher speedup.
    """
    pool = list(trials)
    on_front: set[int] = set()
    best_acc = best_acc_speedup = -math.inf  # the largest speedup among earlier trials that reach best_acc
    for t in sorted(pool, key=lambda t: (-t.values[0], -t.values[1])):
        speedup, acceptance = t.values[0], t.values[1]
        if not (best_acc > acceptance or (best_acc == acceptance and best_acc_speedup > speedup)):
            on_front.add(id(t))
        if acceptance > best_acc:
            best_acc, best_acc_speedup = acceptance, speedup
    return sorted((t for t in pool if id(t) in on_front), key=lambda t: t.values[0])

"""Trials → points: each complete trial with finite objectives, flattened for plotting, with its hover text.

Reads only the trial's record (:class:`~viasd_tune.search.records.TrialRecord`) and tolerates what an older study
or a failed worker lacks: a missing value shows as "-".
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial

from ..search.front import pareto_front
from ..search.records import StudyRecord, TrialRecord


@dataclass
class Point:
    """One complete trial with finite objectives, flattened for plotting."""

    trial: FrozenTrial
    record: TrialRecord
    speedup: float
    acceptance: float
    feasible: bool
    fidelity: float | None
    config: dict[str, Any] = field(default_factory=dict)
    pareto: bool = False

    @property
    def number(self) -> int:
        return self.trial.number


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _feasible(trial: FrozenTrial, record: TrialRecord) -> bool:
    """Optuna's rule (every constraint <= 0) when constraints were recorded, else the record's ``feasible``."""
    constraints = trial.constraints
    if constraints:
        return all(v <= 0 for v in constraints.values())
    return bool(record.feasible if record.feasible is not None else True)


def _fidelity(trial: FrozenTrial, record: TrialRecord, min_fidelity: float | None) -> float | None:
    fid = record.fidelity
    if finite(fid):
        return float(fid)
    constraints = trial.constraints
    if min_fidelity is not None and len(constraints) == 1:  # constraint = min_fidelity - fidelity
        (value,) = constraints.values()
        if finite(value):
            return float(min_fidelity - value)
    return None


def trial_points(trials: Sequence[FrozenTrial], min_fidelity: float | None) -> list[Point]:
    """The trials with two finite objectives as points, the feasible decoded ones on the front marked."""
    points = []
    for t in trials:
        values = t.values or []
        if len(values) < 2 or not (finite(values[0]) and finite(values[1])):
            continue
        record = TrialRecord.read(t)
        points.append(
            Point(
                trial=t,
                record=record,
                speedup=float(values[0]),
                acceptance=float(values[1]),
                feasible=_feasible(t, record),
                fidelity=_fidelity(t, record, min_fidelity),
                config=record.config if isinstance(record.config, dict) else {},
            )
        )
    _mark_pareto([p for p in points if p.feasible and decoded(p)])
    return points


def decoded(p: Point) -> bool:
    """Decoded for real; a trial the search only replayed has modelled objectives and never joins the front."""
    return p.record.measured is not False


def _mark_pareto(points: list[Point]) -> None:
    """Flag the points no other point beats on both objectives: the export's front (search/front.py)."""
    front = {id(t) for t in pareto_front(p.trial for p in points)}
    for p in points:
        p.pareto = id(p.trial) in front


def study_min_fidelity(study: optuna.Study) -> float | None:
    value = StudyRecord.read(study).min_fidelity
    return float(value) if finite(value) else None


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def layer_list(values: Any, per_line: int = 16) -> str:
    """A layer list for hover text, wrapped so a long skip set stays readable."""
    if not isinstance(values, (list, tuple)):
        return "-"
    if not values:
        return "[]"
    items = [str(v) for v in values]
    lines = [", ".join(items[i : i + per_line]) for i in range(0, len(items), per_line)]
    return "[" + ",<br>   ".join(lines) + "]"


def num(value: Any, fmt: str = ".3g") -> str:
    return format(value, fmt) if finite(value) else "-"


def shares_text(shares: Any) -> str:
    if not isinstance(shares, dict):
        return "-"
    return " · ".join(f"{esc(k)} {v:.0%}" for k, v in shares.items() if finite(v)) or "-"


def tree_text(c: dict[str, Any]) -> str | None:
    """A configuration's token tree in one line (its node budget, each source's depth and width); ``None`` for
    a chain of a chain drafter (and for a record from before trees existed)."""
    nodes = c.get("tree_nodes") or 1
    sources = [s for s in ("lookup", "recycle", "model") if s in str(c.get("drafter", "")).split("+")]
    if nodes <= 1 and "recycle" not in sources:
        return None
    head = f"tree of {nodes} nodes" if nodes > 1 else "chain from token recycling"
    if nodes > 1 and c.get("tree_sizing") == "cost":
        head = f"tree of up to {nodes} nodes, cut to the host's verify cost"
    shapes = [
        f"{s} depth {c.get(f'tree_{s}_depth', '-')} width {c.get(f'tree_{s}_width', '-')}" for s in sources
    ]
    return " · ".join([head, *shapes])


def hover(p: Point, min_fidelity: float | None) -> str:
    c, r = p.config, p.record
    status = "feasible" if p.feasible else "infeasible"
    if r.measured is False:
        status += ", replay estimate only"
    if p.pareto:
        status += ", Pareto-optimal"
    fid = num(p.fidelity, ".4f") + (f" (min {min_fidelity:g})" if min_fidelity is not None else "")
    lines = [
        f"<b>trial #{p.number}</b> ({status})",
        f"speedup {p.speedup:.3f}× · acceptance {p.acceptance:.3f} tok/full-equivalent call",
        f"fidelity {fid}",
    ]
    if finite(r.speedup_modelled):
        lines.append(f"modelled speedup {r.speedup_modelled:.3f}×")
    if c:
        lines += [
            f"skip attn {layer_list(c.get('skip_attn'))}",
            f"skip mlp {layer_list(c.get('skip_mlp'))}",
            f"τ_accept {num(c.get('tau_accept'), '.4g')} · τ_escalate {num(c.get('tau_escalate'), '.4g')}"
            f" · kl {esc(c.get('kl', '-'))}",
            f"γ {esc(c.get('gamma', '-'))} · drafter {esc(c.get('drafter', '-'))}",
        ]
        if str(c.get("drafter", "")).startswith("lookup+"):
            lines.append(f"lookup_min {esc(c.get('lookup_min', 1))}")
        if c.get("drafter") in ("self", "lookup+self"):
            lines.append(
                f"draft skip attn {layer_list(c.get('draft_skip_attn'))} mlp {layer_list(c.get('draft_skip_mlp'))}"
            )
        tree = tree_text(c)
        if tree:
            lines.append(esc(tree))
    lines.append(f"tokens: {shares_text(r.tier_shares)}")
    return "<br>".join(lines)

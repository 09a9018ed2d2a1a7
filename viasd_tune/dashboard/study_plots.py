"""Optuna's views of the whole study: the optimisation history (with the best feasible speedup so far) and
fANOVA parameter importances for speedup."""

from __future__ import annotations

import math
import warnings

import optuna
import plotly.graph_objects as go

from .figures import layout
from .points import Point, esc

TOP_IMPORTANCES = 30


def history(study: optuna.Study, points: list[Point]) -> go.Figure:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = optuna.visualization.plot_optimization_history(
            study, target=lambda t: t.values[0], target_name="speedup"
        )
    for trace in fig.data:  # Optuna greys out infeasible trials but leaves them out of the legend
        if trace.name and "nfeasible" in trace.name:
            trace.update(name="infeasible trial", showlegend=True)
        elif trace.name == "speedup":
            trace.update(name="feasible trial")
    best, xs, ys = -math.inf, [], []
    for p in sorted(points, key=lambda p: p.number):
        if p.feasible and p.speedup > best:
            best = p.speedup
        if best > -math.inf:
            xs.append(p.number)
            ys.append(best)
    if xs:  # a multi-objective study gets no best-value line from Optuna; draw the feasible one
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                line=dict(shape="hv", color="#d62728", width=2),
                name="best feasible speedup so far",
                hovertemplate="after trial %{x}: best feasible %{y:.3f}×<extra></extra>",
            )
        )
    fig.update_layout(title=None)
    return layout(
        fig,
        420,
        xaxis_title="trial number",
        yaxis_title="speedup (×)",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        margin=dict(l=70, r=30, t=50, b=60),
    )


def _importance_params(points: list[Point]) -> tuple[list[str], int]:
    """Parameters that nearly every complete trial has (>= 90%) and that vary, and how many trials have them all.

    Optuna otherwise scores only the parameters *every* trial shares, and the enqueued plain-SD reference trial
    has none of the routing parameters, so they would silently drop out.
    """
    seen: dict[str, set[str]] = {}
    for p in points:
        for name, value in p.trial.params.items():
            seen.setdefault(name, set()).add(repr(value))
    names = [
        name
        for name, values in seen.items()
        if len(values) > 1 and sum(name in p.trial.params for p in points) >= 0.9 * len(points)
    ]
    return sorted(names), sum(all(n in p.trial.params for n in names) for p in points)


def importances(study: optuna.Study, points: list[Point]) -> tuple[go.Figure | None, str]:
    """Optuna's fANOVA importances for speedup, top few params; ``None`` and the reason when it cannot."""
    params, used = _importance_params(points)
    if used < 2 or not params:
        return None, (
            "parameter importances unavailable: they need at least 2 complete trials whose parameters differ "
            f"({len(points)} complete trial{'s' if len(points) != 1 else ''} so far)."
        )
    # Optuna's own importance computation; the bar chart is drawn here because plot_param_importances
    # deep-copies every trial once per parameter for its hover text (70 of 84 s on 300 trials x 62 params).
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importances = optuna.importance.get_param_importances(
                study,
                evaluator=optuna.importance.FanovaImportanceEvaluator(n_trees=32, seed=0),
                params=params,
                target=lambda t: t.values[0],
            )
    except Exception as e:  # too few trials, params that never vary, an empty shared search space, ...
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        return None, f"parameter importances unavailable: {esc(first)}"
    ranked = sorted(importances.items(), key=lambda kv: -kv[1])
    if not ranked:
        return None, "parameter importances unavailable: no parameter varies across the complete trials"
    note = f"{len(ranked)} parameters, {used} trials"
    if len(ranked) > TOP_IMPORTANCES:
        note = f"top {TOP_IMPORTANCES} of {note}"
        ranked = ranked[:TOP_IMPORTANCES]
    ranked.reverse()  # horizontal bars draw bottom-up: the largest goes on top
    fig = go.Figure(
        go.Bar(
            x=[v for _, v in ranked],
            y=[name for name, _ in ranked],
            orientation="h",
            marker_color="#4c72b0",
            text=[f"{v:.2f}" if v >= 0.01 else "<0.01" for _, v in ranked],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="%{y}: %{x:.3f}<extra></extra>",
        )
    )
    layout(
        fig,
        min(max(260, 26 * len(ranked) + 120), 1100),
        xaxis=dict(title="importance for speedup (fANOVA; all parameters sum to 1)", rangemode="tozero"),
        yaxis=dict(automargin=True),
        margin=dict(l=70, r=60, t=30, b=60),
    )
    return fig, note

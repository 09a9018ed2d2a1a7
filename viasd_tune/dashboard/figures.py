"""The trade-off figures: the Pareto front, speedup against fidelity, the threshold map, and where the chosen
trial's tokens went. Each takes the points (``points.py``) and returns a Plotly figure."""

from __future__ import annotations

import math
from typing import Any

import optuna
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..search.records import StudyRecord
from .points import Point, decoded, esc, finite, hover, num

_FIDELITY_SCALE = "Viridis"
_SPEEDUP_SCALE = "Plasma"


def layout(fig: go.Figure, height: int, **kwargs: Any) -> go.Figure:
    settings: dict[str, Any] = dict(
        template="plotly_white",
        height=height,
        margin=dict(l=70, r=30, t=40, b=60),
        font=dict(size=13),
        hoverlabel=dict(align="left"),
    )
    fig.update_layout(**{**settings, **kwargs})
    return fig


def pareto(points: list[Point], exported: Point | None, min_fidelity: float | None) -> go.Figure:
    fig = go.Figure()
    fids = [p.fidelity for p in points if p.fidelity is not None]
    lo = min(fids + ([min_fidelity] if min_fidelity is not None else []), default=0.0)
    hi = max(fids, default=1.0)
    if hi <= lo:
        lo, hi = lo - 0.01, hi + 0.01
    colorbar_shown = False
    groups = [
        ("feasible", "circle", [p for p in points if p.feasible]),
        ("infeasible (fidelity below min)", "x", [p for p in points if not p.feasible]),
    ]
    for name, symbol, group in groups:
        if not group:
            continue
        known = [p for p in group if p.fidelity is not None]
        unknown = [p for p in group if p.fidelity is None]
        if known:
            fig.add_trace(
                go.Scatter(
                    x=[p.speedup for p in known],
                    y=[p.acceptance for p in known],
                    mode="markers",
                    name=name,
                    marker=dict(
                        symbol=symbol,
                        size=10,
                        color=[p.fidelity for p in known],
                        colorscale=_FIDELITY_SCALE,
                        cmin=lo,
                        cmax=hi,
                        showscale=not colorbar_shown,
                        colorbar=dict(title=dict(text="fidelity"), len=0.8),
                        line=dict(width=0.5, color="#333") if symbol == "circle" else None,
                    ),
                    hovertext=[hover(p, min_fidelity) for p in known],
                    hovertemplate="%{hovertext}<extra></extra>",
                )
            )
            colorbar_shown = True
        if unknown:
            fig.add_trace(
                go.Scatter(
                    x=[p.speedup for p in unknown],
                    y=[p.acceptance for p in unknown],
                    mode="markers",
                    name=f"{name}, fidelity unknown",
                    marker=dict(symbol=symbol, size=10, color="#999"),
                    hovertext=[hover(p, min_fidelity) for p in unknown],
                    hovertemplate="%{hovertext}<extra></extra>",
                )
            )
    front = sorted((p for p in points if p.pareto), key=lambda p: p.speedup)
    if front:
        fig.add_trace(
            go.Scatter(
                x=[p.speedup for p in front],
                y=[p.acceptance for p in front],
                mode="lines+markers",
                name=f"feasible Pareto front ({len(front)})",
                line=dict(color="#d62728", width=1.5, dash="dot"),
                marker=dict(symbol="circle-open", size=16, line=dict(width=2, color="#d62728")),
                hoverinfo="skip",
            )
        )
    if exported is not None:
        fig.add_trace(exported_star(exported, exported.speedup, exported.acceptance, 22, min_fidelity))
        fig.add_annotation(
            x=exported.speedup,
            y=exported.acceptance,
            text=f"exported #{exported.number}<br>{exported.speedup:.2f}×, {exported.acceptance:.2f} tok/call",
            showarrow=True,
            arrowhead=2,
            ax=-70,
            ay=-45,
            bgcolor="rgba(255,255,255,0.85)",
            bordercolor="#333",
        )
    fig.add_vline(x=1.0, line=dict(color="#888", dash="dash", width=1))
    fig.add_annotation(
        x=1.0, y=1.0, yref="paper", text="target AR", showarrow=False, xanchor="left", font=dict(color="#666")
    )
    return layout(
        fig,
        560,
        xaxis_title="speedup over the target's own AR decoding (×)",
        yaxis_title="acceptance (tokens emitted per full-target call)",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        margin=dict(l=70, r=30, t=70, b=60),
    )


def exported_star(exported: Point, x: float, y: float, size: int, min_fidelity: float | None) -> go.Scatter:
    """The exported profile as a gold star at (x, y), the same on every scatter of the page."""
    return go.Scatter(
        x=[x],
        y=[y],
        mode="markers",
        name=f"exported profile (#{exported.number})",
        marker=dict(symbol="star", size=size, color="gold", line=dict(width=1.5, color="black")),
        hovertext=[hover(exported, min_fidelity)],
        hovertemplate="%{hovertext}<extra>exported</extra>",
    )


def fidelity(points: list[Point], exported: Point | None, min_fidelity: float | None) -> go.Figure:
    """Speedup against fidelity: VIA-SD is lossy, and this is the trade a user makes."""
    fig = go.Figure()
    known = [p for p in points if p.fidelity is not None]
    groups = [
        (
            "decoded for real",
            dict(symbol="circle", size=10, color="#1f77b4", line=dict(width=0.5, color="#333")),
        ),
        ("replayed only (modelled speedup)", dict(symbol="circle-open", size=7, color="#999")),
    ]
    for name, marker in groups:
        group = [p for p in known if decoded(p) == (name == "decoded for real")]
        if group:
            fig.add_trace(
                go.Scatter(
                    x=[p.fidelity for p in group],
                    y=[p.speedup for p in group],
                    mode="markers",
                    name=f"{name} ({len(group)})",
                    marker=marker,
                    hovertext=[hover(p, min_fidelity) for p in group],
                    hovertemplate="%{hovertext}<extra></extra>",
                )
            )
    if exported is not None and exported.fidelity is not None:
        fig.add_trace(exported_star(exported, exported.fidelity, exported.speedup, 20, min_fidelity))
    if min_fidelity is not None:
        fig.add_vline(x=min_fidelity, line=dict(color="#d62728", dash="dash", width=1))
        fig.add_annotation(
            x=min_fidelity, y=1.0, yref="paper", text=f"min fidelity {min_fidelity:g}", showarrow=False,
            xanchor="right", font=dict(color="#d62728"),
        )  # fmt: skip
    fig.add_hline(y=1.0, line=dict(color="#888", dash="dash", width=1))
    return layout(
        fig,
        460,
        xaxis_title="fidelity (share of emitted tokens the target picks greedily)",
        yaxis_title="speedup over the target's AR (×)",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        margin=dict(l=70, r=30, t=70, b=60),
    )


def thresholds(points: list[Point]) -> tuple[go.Figure, str]:
    rows = [
        (p, p.config.get("tau_accept"), p.config.get("tau_escalate"))
        for p in points
        if finite(p.config.get("tau_accept")) and finite(p.config.get("tau_escalate"))
    ]
    positive = [v for _, a, e in rows for v in (a, e) if v > 0]
    floor = 10 ** math.floor(math.log10(min(positive)) - 1) if positive else 1e-4
    speeds = [p.speedup for p, _, _ in rows]
    fig = go.Figure()
    colorbar_shown = False
    for name, symbol, group in (
        ("feasible", "circle", [r for r in rows if r[0].feasible]),
        ("infeasible", "x", [r for r in rows if not r[0].feasible]),
    ):
        if not group:
            continue
        zero = [p for p, a, e in group if a <= 0 or e <= 0]
        fig.add_trace(
            go.Scatter(
                x=[max(a, floor) for _, a, _ in group],
                y=[max(e, floor) for _, _, e in group],
                mode="markers+text" if zero else "markers",
                name=name,
                text=["τ=0" if (a <= 0 or e <= 0) else "" for _, a, e in group],
                textposition="top right",
                marker=dict(
                    symbol=symbol,
                    size=10,
                    color=[p.speedup for p, _, _ in group],
                    colorscale=_SPEEDUP_SCALE,
                    cmin=min(speeds),
                    cmax=max(speeds) if max(speeds) > min(speeds) else min(speeds) + 1e-9,
                    showscale=not colorbar_shown,
                    colorbar=dict(title=dict(text="speedup (×)")),
                    line=dict(width=0.5, color="#333") if symbol == "circle" else None,
                ),
                hovertext=[
                    f"<b>trial #{p.number}</b> ({name})<br>"
                    f"τ_accept {a:.4g}{' (drawn at floor)' if a <= 0 else ''}<br>"
                    f"τ_escalate {e:.4g}{' (drawn at floor)' if e <= 0 else ''}<br>"
                    f"speedup {p.speedup:.3f}× · acceptance {p.acceptance:.3f}<br>"
                    f"fidelity {num(p.fidelity, '.4f')} · kl {esc(p.config.get('kl', '-'))}"
                    for p, a, e in group
                ],
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
        colorbar_shown = True
    any_zero = any(a <= 0 or e <= 0 for _, a, e in rows)
    if rows:
        lo = floor if any_zero or not positive else min(positive) / 2
        hi = max([floor, *positive]) * 2
        fig.add_trace(
            go.Scatter(
                x=[lo, hi],
                y=[lo, hi],
                mode="lines",
                name="τ_accept = τ_escalate",
                line=dict(color="#aaa", dash="dot", width=1),
                hoverinfo="skip",
            )
        )
    if any_zero:
        for axis in ("x", "y"):
            spec = dict(line=dict(color="#bbb", dash="dash", width=1))
            if axis == "x":
                fig.add_vline(x=floor, **spec)
            else:
                fig.add_hline(y=floor, **spec)
        fig.add_annotation(
            x=0.01,
            y=0.99,
            xref="paper",
            yref="paper",
            showarrow=False,
            xanchor="left",
            yanchor="top",
            align="left",
            text=f"dashed lines: τ = 0 drawn at {floor:g} (log axes)",
            bgcolor="rgba(255,255,255,0.85)",
        )
    layout(
        fig,
        520,
        xaxis=dict(
            type="log",
            dtick=1,
            exponentformat="power",
            title="τ_accept (accept the draft below this divergence)",
        ),
        yaxis=dict(
            type="log", dtick=1, exponentformat="power", title="τ_escalate (ask the full target above this)"
        ),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        margin=dict(l=70, r=30, t=60, b=60),
    )
    note = f"{len(rows)} trials" + (f"; τ = 0 drawn at {floor:g}" if any_zero else "")
    return fig, note


def tokens(study: optuna.Study, points: list[Point], exported: Point | None) -> tuple[go.Figure, str] | None:
    chosen, why = exported, "exported profile"
    if chosen is None:
        feasible = [p for p in points if p.feasible]
        pool = feasible or points
        if not pool:
            return None
        chosen = max(pool, key=lambda p: p.speedup)
        why = (
            "best-speedup feasible trial (nothing exported)"
            if feasible
            else "best-speedup trial (none feasible)"
        )
    series: list[tuple[str, dict, dict]] = []
    r = chosen.record
    series.append(("calibration (search)", r.tier_shares or {}, r.tier_time_s or {}))
    held = StudyRecord.read(study).held_out.get(chosen.number)
    if isinstance(held, dict):
        series.append(("held-out", held.get("tier_shares") or {}, held.get("tier_time_s") or {}))
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("share of emitted tokens per tier", "time spent per tier (s)"),
        horizontal_spacing=0.12,
    )
    colors = ["#1f77b4", "#ff7f0e"]
    for i, (name, shares, times) in enumerate(series):
        s_keys = [k for k in ("direct", "slim", "full") if finite(shares.get(k))]
        t_keys = [k for k in ("draft", "slim", "full") if finite(times.get(k))]
        fig.add_trace(
            go.Bar(
                x=s_keys,
                y=[shares[k] for k in s_keys],
                name=name,
                legendgroup=name,
                marker_color=colors[i % 2],
                text=[f"{shares[k]:.0%}" for k in s_keys],
                textposition="outside",
                hovertemplate="%{x}: %{y:.1%}<extra>" + name + "</extra>",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Bar(
                x=t_keys,
                y=[times[k] for k in t_keys],
                name=name,
                legendgroup=name,
                showlegend=False,
                marker_color=colors[i % 2],
                text=[f"{times[k]:.3g} s" for k in t_keys],
                textposition="outside",
                hovertemplate="%{x}: %{y:.4g} s<extra>" + name + "</extra>",
            ),
            row=1,
            col=2,
        )
    if not any(finite(v) for _, _, t in series for v in t.values()):
        fig.add_annotation(
            text="no per-tier timing recorded (replay estimate)",
            xref="x2 domain",
            yref="y2 domain",
            x=0.5,
            y=0.5,
            showarrow=False,
        )
    fig.update_yaxes(tickformat=".0%", range=[0, 1.15], row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    layout(fig, 420, barmode="group", legend=dict(orientation="h", yanchor="bottom", y=1.1, x=0))
    fig.update_layout(margin=dict(l=70, r=30, t=90, b=50))
    return fig, f"trial #{chosen.number}, {why}"

"""One self-contained HTML dashboard of a search study: Pareto front, skipped sub-layers, thresholds, where the
exported profile's tokens went, and Optuna's history and importance plots.

The file opens offline: plotly.js is embedded once (in the first figure), nothing is fetched. It reads only the
study's records (the contract the search writes), so it needs no model, and tolerates trials that lack
attributes (a failed worker, an older study): they are drawn with what they have, or left out of a figure.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import plotly.graph_objects as go
from optuna.trial import FrozenTrial, TrialState
from plotly.subplots import make_subplots

from viasd_tune.errors import UserError
from viasd_tune.fsutil import atomic_write_text
from viasd_tune.page import facts_table, figure_html, page_html
from viasd_tune.search.front import pareto_front

__all__ = ["build_dashboard", "dashboard_from_out_dir", "dashboard_from_storage"]

FIG_ID_PREFIX = "viasd-fig-"
WIDTH_PX = 1000
TOP_IMPORTANCES = 30
_FIDELITY_SCALE = "Viridis"
_SPEEDUP_SCALE = "Plasma"


# --------------------------------------------------------------------------------------------------- data


@dataclass
class _Point:
    """One complete trial with finite objectives, flattened for plotting."""

    trial: FrozenTrial
    speedup: float
    acceptance: float
    feasible: bool
    fidelity: float | None
    config: dict[str, Any] = field(default_factory=dict)
    pareto: bool = False

    @property
    def number(self) -> int:
        return self.trial.number


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _feasible(trial: FrozenTrial) -> bool:
    """Optuna's rule (every constraint <= 0) when constraints were recorded, else the ``feasible`` attr."""
    constraints = trial.constraints
    if constraints:
        return all(v <= 0 for v in constraints.values())
    return bool(trial.user_attrs.get("feasible", True))


def _fidelity(trial: FrozenTrial, min_fidelity: float | None) -> float | None:
    fid = trial.user_attrs.get("fidelity")
    if _finite(fid):
        return float(fid)
    constraints = trial.constraints
    if min_fidelity is not None and len(constraints) == 1:  # constraint = min_fidelity - fidelity
        (value,) = constraints.values()
        if _finite(value):
            return float(min_fidelity - value)
    return None


def _points(trials: Sequence[FrozenTrial], min_fidelity: float | None) -> list[_Point]:
    points = []
    for t in trials:
        values = t.values or []
        if len(values) < 2 or not (_finite(values[0]) and _finite(values[1])):
            continue
        config = t.user_attrs.get("config")
        points.append(
            _Point(
                trial=t,
                speedup=float(values[0]),
                acceptance=float(values[1]),
                feasible=_feasible(t),
                fidelity=_fidelity(t, min_fidelity),
                config=config if isinstance(config, dict) else {},
            )
        )
    _mark_pareto([p for p in points if p.feasible and _decoded(p)])
    return points


def _decoded(p: _Point) -> bool:
    """Decoded for real; a trial the search only replayed has modelled objectives and never joins the front."""
    return p.trial.user_attrs.get("measured") is not False


def _mark_pareto(points: list[_Point]) -> None:
    """Flag the points no other point beats on both objectives: the export's front (search/front.py)."""
    front = {id(t) for t in pareto_front(p.trial for p in points)}
    for p in points:
        p.pareto = id(p.trial) in front


def _study_min_fidelity(study: optuna.Study) -> float | None:
    value = study.user_attrs.get("min_fidelity")
    return float(value) if _finite(value) else None


# --------------------------------------------------------------------------------------------------- formatting


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _layers(values: Any, per_line: int = 16) -> str:
    """A layer list for hover text, wrapped so a long skip set stays readable."""
    if not isinstance(values, (list, tuple)):
        return "-"
    if not values:
        return "[]"
    items = [str(v) for v in values]
    lines = [", ".join(items[i : i + per_line]) for i in range(0, len(items), per_line)]
    return "[" + ",<br>   ".join(lines) + "]"


def _num(value: Any, fmt: str = ".3g") -> str:
    return format(value, fmt) if _finite(value) else "-"


def _shares(shares: Any) -> str:
    if not isinstance(shares, dict):
        return "-"
    return " · ".join(f"{_esc(k)} {v:.0%}" for k, v in shares.items() if _finite(v)) or "-"


def _hover(p: _Point, min_fidelity: float | None) -> str:
    c, ua = p.config, p.trial.user_attrs
    status = "feasible" if p.feasible else "infeasible"
    if ua.get("measured") is False:
        status += ", replay estimate only"
    if p.pareto:
        status += ", Pareto-optimal"
    fid = _num(p.fidelity, ".4f") + (f" (min {min_fidelity:g})" if min_fidelity is not None else "")
    lines = [
        f"<b>trial #{p.number}</b> ({status})",
        f"speedup {p.speedup:.3f}× · acceptance {p.acceptance:.3f} tok/full-equivalent call",
        f"fidelity {fid}",
    ]
    if _finite(ua.get("speedup_modelled")):
        lines.append(f"modelled speedup {ua['speedup_modelled']:.3f}×")
    if c:
        lines += [
            f"skip attn {_layers(c.get('skip_attn'))}",
            f"skip mlp {_layers(c.get('skip_mlp'))}",
            f"τ_accept {_num(c.get('tau_accept'), '.4g')} · τ_escalate {_num(c.get('tau_escalate'), '.4g')}"
            f" · kl {_esc(c.get('kl', '-'))}",
            f"γ {_esc(c.get('gamma', '-'))} · drafter {_esc(c.get('drafter', '-'))}",
        ]
        if str(c.get("drafter", "")).startswith("lookup+"):
            lines.append(f"lookup_min {_esc(c.get('lookup_min', 1))}")
        if c.get("drafter") in ("self", "lookup+self"):
            lines.append(
                f"draft skip attn {_layers(c.get('draft_skip_attn'))} mlp {_layers(c.get('draft_skip_mlp'))}"
            )
    lines.append(f"tokens: {_shares(ua.get('tier_shares'))}")
    return "<br>".join(lines)


def _layout(fig: go.Figure, height: int, **kwargs: Any) -> go.Figure:
    settings: dict[str, Any] = dict(
        template="plotly_white",
        height=height,
        margin=dict(l=70, r=30, t=40, b=60),
        font=dict(size=13),
        hoverlabel=dict(align="left"),
    )
    fig.update_layout(**{**settings, **kwargs})
    return fig


# --------------------------------------------------------------------------------------------------- figures


def _fig_pareto(points: list[_Point], exported: _Point | None, min_fidelity: float | None) -> go.Figure:
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
                    hovertext=[_hover(p, min_fidelity) for p in known],
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
                    hovertext=[_hover(p, min_fidelity) for p in unknown],
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
        fig.add_trace(_exported_star(exported, exported.speedup, exported.acceptance, 22, min_fidelity))
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
    return _layout(
        fig,
        560,
        xaxis_title="speedup over the target's own AR decoding (×)",
        yaxis_title="acceptance (tokens emitted per full-target call)",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        margin=dict(l=70, r=30, t=70, b=60),
    )


def _exported_star(exported: _Point, x: float, y: float, size: int, min_fidelity: float | None) -> go.Scatter:
    """The exported profile as a gold star at (x, y), the same on every scatter of the page."""
    return go.Scatter(
        x=[x],
        y=[y],
        mode="markers",
        name=f"exported profile (#{exported.number})",
        marker=dict(symbol="star", size=size, color="gold", line=dict(width=1.5, color="black")),
        hovertext=[_hover(exported, min_fidelity)],
        hovertemplate="%{hovertext}<extra>exported</extra>",
    )


def _fig_fidelity(points: list[_Point], exported: _Point | None, min_fidelity: float | None) -> go.Figure:
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
        group = [p for p in known if _decoded(p) == (name == "decoded for real")]
        if group:
            fig.add_trace(
                go.Scatter(
                    x=[p.fidelity for p in group],
                    y=[p.speedup for p in group],
                    mode="markers",
                    name=f"{name} ({len(group)})",
                    marker=marker,
                    hovertext=[_hover(p, min_fidelity) for p in group],
                    hovertemplate="%{hovertext}<extra></extra>",
                )
            )
    if exported is not None and exported.fidelity is not None:
        fig.add_trace(_exported_star(exported, exported.fidelity, exported.speedup, 20, min_fidelity))
    if min_fidelity is not None:
        fig.add_vline(x=min_fidelity, line=dict(color="#d62728", dash="dash", width=1))
        fig.add_annotation(
            x=min_fidelity, y=1.0, yref="paper", text=f"min fidelity {min_fidelity:g}", showarrow=False,
            xanchor="right", font=dict(color="#d62728"),
        )  # fmt: skip
    fig.add_hline(y=1.0, line=dict(color="#888", dash="dash", width=1))
    return _layout(
        fig,
        460,
        xaxis_title="fidelity (share of emitted tokens the target picks greedily)",
        yaxis_title="speedup over the target's AR (×)",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        margin=dict(l=70, r=30, t=70, b=60),
    )


def _fig_layer_importance(study: optuna.Study) -> tuple[go.Figure | None, str]:
    """The calibration pass's sub-layer scores (search/importance.py): what skipping each one alone changes."""
    imp = study.user_attrs.get("layer_importance")
    if not isinstance(imp, dict) or not isinstance(imp.get("drop"), dict):
        return None, "No layer importance in this study (searches before seeding did not score sub-layers)."
    drop, kl = imp["drop"], imp.get("kl") or {}
    n = max((len(v) for v in drop.values() if isinstance(v, list)), default=0)
    if n == 0:
        return None, "The study's layer importance is empty."

    def cell(table: dict, kind: str, layer: int) -> float | None:
        values = table.get(kind) or []
        v = values[layer] if layer < len(values) else None
        return float(v) if _finite(v) else None

    z = [[cell(drop, k, i) for k in ("attn", "mlp")] for i in range(n)]
    hover = [
        [
            f"layer {i} {name}: "
            + (
                "not scored (the space may not skip it)"
                if cell(drop, k, i) is None
                else f"skipped alone, top-1 changes at {cell(drop, k, i):.1%} of positions; "
                f"KL(full‖skipped) {_num(cell(kl, k, i), '.3g')}"
            )
            for k, name in (("attn", "attention"), ("mlp", "MLP"))
        ]
        for i in range(n)
    ]
    top = max((v for row in z for v in row if v is not None), default=0.0)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=["attention", "MLP"],
            y=list(range(n)),
            zmin=0,
            zmax=max(top, 1e-9),
            colorscale="Reds",
            colorbar=dict(title=dict(text="top-1 drop"), tickformat=".0%"),
            texttemplate="%{z:.0%}" if n <= 48 else None,
            xgap=2,
            ygap=1,
            hovertext=hover,
            hovertemplate="%{hovertext}<extra></extra>",
        )
    )
    _layout(
        fig,
        min(max(260, 18 * n + 110), 1500),
        xaxis=dict(side="top"),
        yaxis=dict(title="layer", autorange="reversed", dtick=1 if n <= 48 else None),
        margin=dict(l=70, r=30, t=50, b=30),
    )
    saved = imp.get("saved_s") or {}
    price = ", ".join(
        f"{name} {1000 * saved[k]:.3g} ms"
        for k, name in (("attn", "attention"), ("mlp", "MLP"))
        if _finite(saved.get(k))
    )
    note = f"{imp.get('positions', '?')} positions in blocks of {imp.get('block', '?')} tokens"
    if price:
        note += f"; one skipped sub-layer saves {price} per block (cost model)"
    return fig, note


def _slower_banner(study: optuna.Study, exported: _Point | None) -> str:
    """A banner when the exported pick ran slower than plain decoding on the held-out prompts."""
    if exported is None:
        return ""
    held = study.user_attrs.get(f"held_out:{exported.number}")
    speed = held.get("speedup_measured") if isinstance(held, dict) else None
    if not _finite(speed) or speed >= 1.0:
        return ""
    return (
        f'<p class="note" id="slower-than-ar"><b>Slower than plain decoding:</b> trial #{exported.number}, the '
        f"search's pick, ran at {speed:.2f}× the target's own AR decoding on the "
        f"{_esc(held.get('held_out_prompts', '?'))} held-out prompts. The search exports plain decoding "
        "(<code>mode: ar</code>) instead; a profile of this trial (<code>export --pick</code>) is slower than "
        "not using the tool.</p>"
    )


def _skip_pool(points: list[_Point]) -> tuple[list[_Point], str]:
    with_config = [p for p in points if p.config]
    for label, pool in (
        ("Pareto-optimal feasible", [p for p in with_config if p.pareto]),
        ("feasible", [p for p in with_config if p.feasible]),
        ("complete", with_config),
    ):
        if pool:
            return pool, label
    return [], "complete"


def _num_layers(study: optuna.Study, points: list[_Point]) -> int:
    n = study.user_attrs.get("num_layers")
    n = int(n) if _finite(n) else 0
    for p in points:
        for key in ("skip_attn", "skip_mlp"):
            for layer in p.config.get(key) or []:
                if isinstance(layer, int):
                    n = max(n, layer + 1)
    return max(n, 1)


def _fig_skips(study: optuna.Study, points: list[_Point]) -> tuple[go.Figure, str]:
    pool, label = _skip_pool(points)
    n = _num_layers(study, points)
    z = [[0.0, 0.0] for _ in range(n)]
    for p in pool:
        for col, key in enumerate(("skip_attn", "skip_mlp")):
            for layer in set(p.config.get(key) or []):
                if isinstance(layer, int) and 0 <= layer < n:
                    z[layer][col] += 1.0 / len(pool)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=["attention", "MLP"],
            y=list(range(n)),
            zmin=0,
            zmax=1,
            colorscale="Blues",
            colorbar=dict(title=dict(text="share"), tickformat=".0%"),
            texttemplate="%{z:.0%}" if n <= 48 else None,
            xgap=2,
            ygap=1,
            hovertemplate=f"layer %{{y}} %{{x}}: skipped by %{{z:.0%}} of {len(pool)} {label} trials"
            "<extra></extra>",
        )
    )
    _layout(
        fig,
        min(max(260, 18 * n + 110), 1500),
        xaxis=dict(side="top"),
        yaxis=dict(title="layer", autorange="reversed", dtick=1 if n <= 48 else None),
        margin=dict(l=70, r=30, t=50, b=30),
    )
    return fig, f"{len(pool)} {label} trial{'s' if len(pool) != 1 else ''}"


def _fig_thresholds(points: list[_Point]) -> tuple[go.Figure, str]:
    rows = [
        (p, p.config.get("tau_accept"), p.config.get("tau_escalate"))
        for p in points
        if _finite(p.config.get("tau_accept")) and _finite(p.config.get("tau_escalate"))
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
                    f"fidelity {_num(p.fidelity, '.4f')} · kl {_esc(p.config.get('kl', '-'))}"
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
    _layout(
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


def _fig_tokens(
    study: optuna.Study, points: list[_Point], exported: _Point | None
) -> tuple[go.Figure, str] | None:
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
    ua = chosen.trial.user_attrs
    series.append(("calibration (search)", ua.get("tier_shares") or {}, ua.get("tier_time_s") or {}))
    held = study.user_attrs.get(f"held_out:{chosen.number}")
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
        s_keys = [k for k in ("direct", "slim", "full") if _finite(shares.get(k))]
        t_keys = [k for k in ("draft", "slim", "full") if _finite(times.get(k))]
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
    if not any(_finite(v) for _, _, t in series for v in t.values()):
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
    _layout(fig, 420, barmode="group", legend=dict(orientation="h", yanchor="bottom", y=1.1, x=0))
    fig.update_layout(margin=dict(l=70, r=30, t=90, b=50))
    return fig, f"trial #{chosen.number}, {why}"


def _fig_history(study: optuna.Study, points: list[_Point]) -> go.Figure:
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
    return _layout(
        fig,
        420,
        xaxis_title="trial number",
        yaxis_title="speedup (×)",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        margin=dict(l=70, r=30, t=50, b=60),
    )


def _importance_params(points: list[_Point]) -> tuple[list[str], int]:
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


def _fig_importances(study: optuna.Study, points: list[_Point]) -> tuple[go.Figure | None, str]:
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
        return None, f"parameter importances unavailable: {_esc(first)}"
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
    _layout(
        fig,
        min(max(260, 26 * len(ranked) + 120), 1100),
        xaxis=dict(title="importance for speedup (fANOVA; all parameters sum to 1)", rangemode="tozero"),
        yaxis=dict(automargin=True),
        margin=dict(l=70, r=60, t=30, b=60),
    )
    return fig, note


# --------------------------------------------------------------------------------------------------- page


def _isas(study: optuna.Study, a: dict) -> str:
    """The hosts' matrix ISAs the trials were measured on (speeds are only comparable on one)."""
    seen = sorted({t.user_attrs["matrix_isa"] for t in study.get_trials(deepcopy=False) if "matrix_isa" in t.user_attrs})
    return ", ".join(seen) or a.get("matrix_isa", "unknown")


def _header_rows(
    study: optuna.Study, points: list[_Point], exported: _Point | None, wanted: int | None
) -> list:
    a = study.user_attrs
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    feasible = sum(p.feasible for p in points)
    complete = counts.get("complete", 0)
    trials = f"{complete} complete ({feasible} feasible, {len(points) - feasible} infeasible"
    if len(points) < complete:
        trials += f", {complete - len(points)} without finite objectives, not plotted"
    trials += ")"
    replayed = sum(not _decoded(p) for p in points)
    if replayed:
        trials += f", {len(points) - replayed} decoded for real, {replayed} replayed only"
    for state in ("fail", "pruned", "running", "waiting"):
        if counts.get(state):
            trials += f" · {counts[state]} {'failed' if state == 'fail' else state}"
    rows = [
        ("target", _esc(a.get("target") or "-")),
        ("draft", _esc(a.get("draft") or "- (self / lookup drafting only)")),
        ("trials", _esc(trials)),
        ("min fidelity", _esc(_num(a.get("min_fidelity"), "g"))),
        ("dtype · matrix ISA", _esc(f"{a.get('dtype', '-')} · {_isas(study, a)}")),
    ]
    if exported is not None:
        c = exported.config
        text = (
            f"trial #{exported.number}: speedup {exported.speedup:.3f}×, acceptance {exported.acceptance:.3f} "
            f"tok/full call, fidelity {_num(exported.fidelity, '.4f')}"
        )
        held = a.get(f"held_out:{exported.number}")
        if isinstance(held, dict):
            text += (
                f"; held-out ({held.get('held_out_prompts', '?')} prompts): speedup "
                f"{_num(held.get('speedup_measured'), '.3f')}× (vs plain SD {_num(held.get('speedup_vs_sd'), '.3f')}×), "
                f"acceptance {_num(held.get('acceptance'), '.3f')}, fidelity {_num(held.get('fidelity'), '.4f')}"
            )
        rows.append(("exported profile", _esc(text)))
        if c:
            rows.append(
                (
                    "its routing",
                    _esc(
                        f"skip attn {c.get('skip_attn')} mlp {c.get('skip_mlp')}; τ_accept "
                        f"{_num(c.get('tau_accept'), '.4g')}, τ_escalate {_num(c.get('tau_escalate'), '.4g')}, "
                        f"kl {c.get('kl')}, γ {c.get('gamma')}, drafter {c.get('drafter')}"
                    ),
                )
            )
    elif wanted is not None:
        rows.append(("exported profile", _esc(f"trial #{wanted} is not a complete trial of this study")))
    else:
        rows.append(("exported profile", "none yet"))
    return rows


def build_dashboard(
    study: optuna.Study, out: str | Path, exported_trial: int | None = None, title: str | None = None
) -> Path:
    """Write the study's dashboard to ``out`` (one offline HTML file) and return its path.

    ``exported_trial`` defaults to the study's ``exported_trial`` user attr; the star marks it on the front.
    """
    out = Path(out)
    if out.exists() and out.is_dir():
        raise UserError(
            f"dashboard output {out} is a directory; give a file name such as {out / 'dashboard.html'}"
        )
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        raise UserError(
            f"study {study.study_name!r} has no complete trial yet ({len(study.trials)} trials in all); "
            "run the search first"
        )
    if len(study.directions) != 2:
        raise UserError(
            f"study {study.study_name!r} has {len(study.directions)} objective(s); a viasd-tune study has two "
            "(speedup, acceptance)"
        )
    min_fidelity = _study_min_fidelity(study)
    points = _points(complete, min_fidelity)
    if exported_trial is None:
        attr = study.user_attrs.get("exported_trial")
        exported_trial = attr if isinstance(attr, int) and not isinstance(attr, bool) else None
    exported = next((p for p in points if p.number == exported_trial), None)

    sections: list[tuple[str, str, str, go.Figure | None]] = []  # key, heading, caption, figure
    front = sum(p.pareto for p in points)
    sections.append(
        (
            "pareto",
            "Pareto front: speedup vs acceptance",
            f"Every complete trial. Circles meet the fidelity constraint, crosses do not; colour is fidelity. "
            f"The {front} Pareto-optimal feasible trial{'s are' if front != 1 else ' is'} ringed in red"
            + (f"; the star is the exported profile (#{exported.number})." if exported else ".")
            + " Hover a point for its routing.",
            _fig_pareto(points, exported, min_fidelity),
        )
    )
    sections.append(
        (
            "fidelity",
            "Speedup vs fidelity",
            "VIA-SD is lossy: each trial's speedup against its fidelity (the share of emitted tokens the target "
            "itself picks greedily). Trials the search only replayed show their modelled speedup.",
            _fig_fidelity(points, exported, min_fidelity),
        )
    )
    fig, note = _fig_skips(study, points)
    sections.append(
        (
            "skips",
            "Which sub-layers the good trials skip",
            f"Share of {_esc(note)} whose slim verifier skips each layer's attention or MLP.",
            fig,
        )
    )
    fig, note = _fig_layer_importance(study)
    sections.append(
        (
            "layer_importance",
            "Layer importance: what skipping each sub-layer alone changes",
            (
                "The calibration pass before the study: the share of positions whose top-1 token changes when "
                f"the slim verifier skips only this sub-layer ({_esc(note)}). The study is seeded with skip sets "
                "built from these scores."
            )
            if fig
            else _esc(note),
            fig,
        )
    )
    fig, note = _fig_thresholds(points)
    sections.append(
        (
            "thresholds",
            "Threshold map",
            f"τ_accept vs τ_escalate (log axes), colour = speedup; {_esc(note)}.",
            fig,
        )
    )
    tokens = _fig_tokens(study, points, exported)
    if tokens is not None:
        sections.append(
            (
                "tokens",
                "Where the tokens went",
                f"{_esc(tokens[1])}: which tier emitted each token, and the time each tier took.",
                tokens[0],
            )
        )
    sections.append(
        (
            "history",
            "Optimisation history",
            "Speedup of each complete trial in the order it ran (infeasible ones in grey), and the best feasible "
            "speedup so far.",
            _fig_history(study, points),
        )
    )
    fig, note = _fig_importances(study, points)
    sections.append(
        (
            "importances",
            "Parameter importances (speedup)",
            f"fANOVA importance of each sampled parameter for speedup ({_esc(note)})." if fig else note,
            fig,
        )
    )

    name = title or f"viasd-tune study {study.study_name}"
    body = []
    first = True
    for key, heading, caption, figure in sections:
        body.append(f'<section id="{key}">\n<h2>{_esc(heading)}</h2>')
        if figure is None:
            body.append(f'<p class="note">{caption}</p>')
        else:
            body.append(f'<p class="caption">{caption}</p>')
            body.append(f'<div class="figure">{figure_html(figure, FIG_ID_PREFIX + key, first)}</div>')
            first = False
        body.append("</section>")
    facts = facts_table(_header_rows(study, points, exported, exported_trial))
    generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    content = f"""<h1>{_esc(name)}</h1>
{_slower_banner(study, exported)}
{facts}
<p class="caption">Generated {generated} by viasd-tune from the study's records; opens offline.</p>
{chr(10).join(body)}"""
    page = page_html(name, content, max_width=WIDTH_PX + 40)
    atomic_write_text(out, page)
    return out


# --------------------------------------------------------------------------------------------------- loading


def _redact(url: str) -> str:
    from viasd_tune.credentials import redact

    return redact(url)


def _open_storage(storage: str) -> optuna.storages.BaseStorage:
    """The storage through search/storage.py, as search and export open it (driver choice, one-line errors)."""
    from viasd_tune.search.storage import make_storage, sqlite_file

    db = sqlite_file(storage)
    if db is not None and not db.is_file():  # SQLAlchemy would silently create an empty database there
        raise UserError(f"no Optuna database at {db}; check the path (a search writes <out>/study.db)")
    return make_storage(storage)


def _study_names(storage: optuna.storages.BaseStorage) -> list[str]:
    return sorted(s.study_name for s in storage.get_all_studies())


def _load(storage: optuna.storages.BaseStorage, study_name: str, where: str) -> optuna.Study:
    names = _study_names(storage)
    if study_name not in names:
        raise UserError(
            f"no study {study_name!r} in {where}; studies there: {', '.join(map(repr, names)) or 'none'}"
        )
    study = optuna.load_study(study_name=study_name, storage=storage)
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise UserError(
            f"study {study_name!r} in {where} has no complete trial yet ({len(study.trials)} trials in all); "
            "run or resume the search first"
        )
    return study


def dashboard_from_storage(storage: str, study_name: str, out: str | Path) -> Path:
    """Load ``study_name`` from an Optuna storage URL and write its dashboard to ``out``."""
    study = _load(_open_storage(storage), study_name, _redact(storage))
    return build_dashboard(study, out)


def _profile_study(out_dir: Path) -> tuple[str | None, int | None]:
    """Study name and trial from ``out_dir/profile.json``'s provenance, when the file is there and readable."""
    try:
        provenance = json.loads((out_dir / "profile.json").read_text(encoding="utf-8"))["provenance"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    name, trial = provenance.get("study"), provenance.get("trial")
    return (
        name if isinstance(name, str) else None,
        trial if isinstance(trial, int) and not isinstance(trial, bool) else None,
    )


def dashboard_from_out_dir(out_dir: str | Path, out: str | Path | None = None) -> Path:
    """The dashboard of a search output directory: ``<out_dir>/study.db``, its only study (or the one named in
    ``profile.json``'s provenance), written to ``out`` (default ``<out_dir>/dashboard.html``)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise UserError(f"--out-dir {out_dir} is not a directory; give the folder a search wrote")
    db = out_dir / "study.db"
    if not db.is_file():
        raise UserError(
            f"no study.db in {out_dir}; give the folder a search wrote, or use --storage and --study-name"
        )
    storage = _open_storage(f"sqlite:///{db.resolve()}")
    named, profile_trial = _profile_study(out_dir)
    names = _study_names(storage)
    if named is None:
        if len(names) != 1:
            raise UserError(
                f"{db} holds {len(names)} studies ({', '.join(map(repr, names)) or 'none'}) and no profile.json "
                "names one; use --storage and --study-name"
            )
        named = names[0]
    study = _load(storage, named, str(db))
    exported = study.user_attrs.get("exported_trial")
    if not isinstance(exported, int) or isinstance(exported, bool):
        exported = profile_trial
    return build_dashboard(
        study, out if out is not None else out_dir / "dashboard.html", exported_trial=exported
    )

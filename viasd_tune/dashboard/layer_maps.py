"""The per-layer heat maps: which sub-layers the good trials skip, and what skipping each one alone changed in the
calibration pass before the study (search/importance.py)."""

from __future__ import annotations

import optuna
import plotly.graph_objects as go

from ..search.records import StudyRecord
from .figures import layout
from .points import Point, finite, num


def importance(study: optuna.Study) -> tuple[go.Figure | None, str]:
    """The calibration pass's sub-layer scores (search/importance.py): what skipping each one alone changes."""
    imp = StudyRecord.read(study).layer_importance
    if not isinstance(imp, dict) or not isinstance(imp.get("drop"), dict):
        return None, "No layer importance in this study (searches before seeding did not score sub-layers)."
    drop, kl = imp["drop"], imp.get("kl") or {}
    n = max((len(v) for v in drop.values() if isinstance(v, list)), default=0)
    if n == 0:
        return None, "The study's layer importance is empty."

    def cell(table: dict, kind: str, layer: int) -> float | None:
        values = table.get(kind) or []
        v = values[layer] if layer < len(values) else None
        return float(v) if finite(v) else None

    z = [[cell(drop, k, i) for k in ("attn", "mlp")] for i in range(n)]
    hover = [
        [
            f"layer {i} {name}: "
            + (
                "not scored (the space may not skip it)"
                if cell(drop, k, i) is None
                else f"skipped alone, top-1 changes at {cell(drop, k, i):.1%} of positions; "
                f"KL(full‖skipped) {num(cell(kl, k, i), '.3g')}"
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
    layout(
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
        if finite(saved.get(k))
    )
    note = f"{imp.get('positions', '?')} positions in blocks of {imp.get('block', '?')} tokens"
    if price:
        note += f"; one skipped sub-layer saves {price} per block (cost model)"
    return fig, note


def _skip_pool(points: list[Point]) -> tuple[list[Point], str]:
    with_config = [p for p in points if p.config]
    for label, pool in (
        ("Pareto-optimal feasible", [p for p in with_config if p.pareto]),
        ("feasible", [p for p in with_config if p.feasible]),
        ("complete", with_config),
    ):
        if pool:
            return pool, label
    return [], "complete"


def _num_layers(study: optuna.Study, points: list[Point]) -> int:
    n = StudyRecord.read(study).num_layers
    n = int(n) if finite(n) else 0
    for p in points:
        for key in ("skip_attn", "skip_mlp"):
            for layer in p.config.get(key) or []:
                if isinstance(layer, int):
                    n = max(n, layer + 1)
    return max(n, 1)


def skips(study: optuna.Study, points: list[Point]) -> tuple[go.Figure, str]:
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
    layout(
        fig,
        min(max(260, 18 * n + 110), 1500),
        xaxis=dict(side="top"),
        yaxis=dict(title="layer", autorange="reversed", dtick=1 if n <= 48 else None),
        margin=dict(l=70, r=30, t=50, b=30),
    )
    return fig, f"{len(pool)} {label} trial{'s' if len(pool) != 1 else ''}"

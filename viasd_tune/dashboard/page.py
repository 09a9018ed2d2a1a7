"""The page: the study's facts, a banner when the export is slower than plain decoding, and one section per
figure, written as one HTML file that opens offline (plotly.js embedded once, in the first figure)."""

from __future__ import annotations

import datetime as dt
import logging
from pathlib import Path

import optuna
import plotly.graph_objects as go
from optuna.trial import TrialState

from ..errors import UserError
from ..fsutil import atomic_write_text
from ..page import facts_table, figure_html, page_html
from ..search.records import StudyRecord, TrialRecord
from . import figures, layer_maps, study_plots
from .points import Point, decoded, esc, finite, num, study_min_fidelity, tree_text, trial_points

log = logging.getLogger(__name__)
FIG_ID_PREFIX = "viasd-fig-"
WIDTH_PX = 1000


def write_beside_profile(study: optuna.Study, out_dir: Path, exported_trial: int | None) -> Path | None:
    """The study's dashboard in a search's output folder, its exported trial starred; ``None`` (with a warning)
    when there is nothing to draw yet, so an export never fails on its dashboard."""
    try:
        return build_dashboard(study, out_dir / "dashboard.html", exported_trial=exported_trial)
    except UserError as e:  # e.g. no complete trial yet
        log.warning("dashboard skipped: %s", e)
        return None


def _slower_banner(study: optuna.Study, exported: Point | None) -> str:
    """A banner when the exported pick ran slower than plain decoding on the held-out prompts."""
    if exported is None:
        return ""
    held = StudyRecord.read(study).held_out.get(exported.number)
    speed = held.get("speedup_measured") if isinstance(held, dict) else None
    if not finite(speed) or speed >= 1.0:
        return ""
    return (
        f'<p class="note" id="slower-than-ar"><b>Slower than plain decoding:</b> trial #{exported.number}, the '
        f"search's pick, ran at {speed:.2f}× the target's own AR decoding on the "
        f"{esc(held.get('held_out_prompts', '?'))} held-out prompts. The search exports plain decoding "
        "(<code>mode: ar</code>) instead; a profile of this trial (<code>export --pick</code>) is slower than "
        "not using the tool.</p>"
    )


def _isas(study: optuna.Study, a: StudyRecord) -> str:
    """The hosts' matrix ISAs the trials were measured on (speeds are only comparable on one)."""
    records = map(TrialRecord.read, study.get_trials(deepcopy=False))
    seen = sorted({r.matrix_isa for r in records if r.matrix_isa is not None})
    return ", ".join(seen) or (a.matrix_isa if a.matrix_isa is not None else "unknown")


def _header_rows(
    study: optuna.Study, points: list[Point], exported: Point | None, wanted: int | None
) -> list:
    a = StudyRecord.read(study)
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    feasible = sum(p.feasible for p in points)
    complete = counts.get("complete", 0)
    trials = f"{complete} complete ({feasible} feasible, {len(points) - feasible} infeasible"
    if len(points) < complete:
        trials += f", {complete - len(points)} without finite objectives, not plotted"
    trials += ")"
    replayed = sum(not decoded(p) for p in points)
    if replayed:
        trials += f", {len(points) - replayed} decoded for real, {replayed} replayed only"
    for state in ("fail", "pruned", "running", "waiting"):
        if counts.get(state):
            trials += f" · {counts[state]} {'failed' if state == 'fail' else state}"
    rows = [
        ("target", esc(a.target or "-")),
        ("draft", esc(a.draft or "- (self / lookup drafting only)")),
        ("trials", esc(trials)),
        ("min fidelity", esc(num(a.min_fidelity, "g"))),
        ("dtype · matrix ISA", esc(f"{a.dtype if a.dtype is not None else '-'} · {_isas(study, a)}")),
    ]
    if exported is not None:
        c = exported.config
        text = (
            f"trial #{exported.number}: speedup {exported.speedup:.3f}×, acceptance {exported.acceptance:.3f} "
            f"tok/full call, fidelity {num(exported.fidelity, '.4f')}"
        )
        held = a.held_out.get(exported.number)
        if isinstance(held, dict):
            text += (
                f"; held-out ({held.get('held_out_prompts', '?')} prompts): speedup "
                f"{num(held.get('speedup_measured'), '.3f')}× (vs plain SD {num(held.get('speedup_vs_sd'), '.3f')}×), "
                f"acceptance {num(held.get('acceptance'), '.3f')}, fidelity {num(held.get('fidelity'), '.4f')}"
            )
        rows.append(("exported profile", esc(text)))
        if c:
            rows.append(
                (
                    "its routing",
                    esc(
                        f"skip attn {c.get('skip_attn')} mlp {c.get('skip_mlp')}; τ_accept "
                        f"{num(c.get('tau_accept'), '.4g')}, τ_escalate {num(c.get('tau_escalate'), '.4g')}, "
                        f"kl {c.get('kl')}, γ {c.get('gamma')}, drafter {c.get('drafter')}"
                        + (f"; {tree_text(c)}" if tree_text(c) else "")
                    ),
                )
            )
    elif wanted is not None:
        rows.append(("exported profile", esc(f"trial #{wanted} is not a complete trial of this study")))
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
    min_fidelity = study_min_fidelity(study)
    points = trial_points(complete, min_fidelity)
    if exported_trial is None:
        attr = StudyRecord.read(study).exported_trial
        exported_trial = attr if isinstance(attr, int) and not isinstance(attr, bool) else None
    exported = next((p for p in points if p.number == exported_trial), None)
    sections = _sections(study, points, exported, min_fidelity)
    name = title or f"viasd-tune study {study.study_name}"
    facts = facts_table(_header_rows(study, points, exported, exported_trial))
    generated = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    content = f"""<h1>{esc(name)}</h1>
{_slower_banner(study, exported)}
{facts}
<p class="caption">Generated {generated} by viasd-tune from the study's records; opens offline.</p>
{_body(sections)}"""
    page = page_html(name, content, max_width=WIDTH_PX + 40)
    atomic_write_text(out, page)
    return out


Section = tuple[str, str, str, "go.Figure | None"]  # key, heading, caption (HTML), figure (None: a note)


def _sections(
    study: optuna.Study, points: list[Point], exported: Point | None, min_fidelity: float | None
) -> list[Section]:
    """Every section of the page, in order: a figure with its caption, or a note saying why it is missing."""
    sections: list[Section] = []
    front = sum(p.pareto for p in points)
    sections.append(
        (
            "pareto",
            "Pareto front: speedup vs acceptance",
            f"Every complete trial. Circles meet the fidelity constraint, crosses do not; colour is fidelity. "
            f"The {front} Pareto-optimal feasible trial{'s are' if front != 1 else ' is'} ringed in red"
            + (f"; the star is the exported profile (#{exported.number})." if exported else ".")
            + " Hover a point for its routing.",
            figures.pareto(points, exported, min_fidelity),
        )
    )
    sections.append(
        (
            "fidelity",
            "Speedup vs fidelity",
            "VIA-SD is lossy: each trial's speedup against its fidelity (the share of emitted tokens the target "
            "itself picks greedily). Trials the search only replayed show their modelled speedup.",
            figures.fidelity(points, exported, min_fidelity),
        )
    )
    fig, note = layer_maps.skips(study, points)
    sections.append(
        (
            "skips",
            "Which sub-layers the good trials skip",
            f"Share of {esc(note)} whose slim verifier skips each layer's attention or MLP.",
            fig,
        )
    )
    fig, note = layer_maps.importance(study)
    sections.append(
        (
            "layer_importance",
            "Layer importance: what skipping each sub-layer alone changes",
            (
                "The calibration pass before the study: the share of positions whose top-1 token changes when "
                f"the slim verifier skips only this sub-layer ({esc(note)}). The study is seeded with skip sets "
                "built from these scores."
            )
            if fig
            else esc(note),
            fig,
        )
    )
    fig, note = figures.thresholds(points)
    sections.append(
        (
            "thresholds",
            "Threshold map",
            f"τ_accept vs τ_escalate (log axes), colour = speedup; {esc(note)}.",
            fig,
        )
    )
    tokens = figures.tokens(study, points, exported)
    if tokens is not None:
        sections.append(
            (
                "tokens",
                "Where the tokens went",
                f"{esc(tokens[1])}: which tier emitted each token, and the time each tier took.",
                tokens[0],
            )
        )
    sections.append(
        (
            "history",
            "Optimisation history",
            "Speedup of each complete trial in the order it ran (infeasible ones in grey), and the best feasible "
            "speedup so far.",
            study_plots.history(study, points),
        )
    )
    fig, note = study_plots.importances(study, points)
    sections.append(
        (
            "importances",
            "Parameter importances (speedup)",
            f"fANOVA importance of each sampled parameter for speedup ({esc(note)})." if fig else note,
            fig,
        )
    )
    return sections


def _body(sections: list[Section]) -> str:
    """The sections as HTML; the first figure carries plotly.js, so the page opens offline."""
    body = []
    first = True
    for key, heading, caption, figure in sections:
        body.append(f'<section id="{key}">\n<h2>{esc(heading)}</h2>')
        if figure is None:
            body.append(f'<p class="note">{caption}</p>')
        else:
            body.append(f'<p class="caption">{caption}</p>')
            body.append(f'<div class="figure">{figure_html(figure, FIG_ID_PREFIX + key, first)}</div>')
            first = False
        body.append("</section>")
    return "\n".join(body)

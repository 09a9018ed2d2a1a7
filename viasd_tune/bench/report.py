"""The bench's reports, all built from the result (what ``bench.json`` holds): ``bench.md`` and ``bench.html``.

Both render the same facts and tables: the tables are pandas DataFrames of display strings, the facts and notes
short lists of plain, code and emphasised text. Markdown and HTML are each written from those, never one
converted into the other. The HTML page (offline Plotly figures: speedup per task group, fidelity vs speedup)
uses the page shell the search dashboard uses.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..fsutil import atomic_write_text
from ..page import esc, facts_table, figure_html, page_html
from .methods import BASELINE, is_viasd

if TYPE_CHECKING:
    import pandas as pd

PAGE_WIDTH_PX = 1100
FIG_ID_PREFIX = "viasd-bench-"
_PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974")


# ------------------------------------------------------------------------------------------------ text


class Code(str):
    """Text shown as code."""


class Em(str):
    """Text shown emphasised."""


Text = list[str]  # plain str, Code and Em parts, in order


def text_md(parts: Text) -> str:
    return "".join(f"`{p}`" if isinstance(p, Code) else f"*{p}*" if isinstance(p, Em) else p for p in parts)


def text_html(parts: Text) -> str:
    return "".join(
        f"<code>{esc(p)}</code>"
        if isinstance(p, Code)
        else f"<i>{esc(p)}</i>"
        if isinstance(p, Em)
        else esc(p)
        for p in parts
    )


# ------------------------------------------------------------------------------------------------ content


def matrix_isa(result: dict) -> str:
    return result["meta"]["machine"].get("matrix_isa", "unknown")


def facts(result: dict) -> list[tuple[str, Text]]:
    """The header: how, when, where and on what the bench ran."""
    meta = result["meta"]
    mach = meta["machine"]
    machine = (
        f"{mach['cpu']}, {mach['cpu_count']} CPUs, torch threads {mach['torch_threads']}"
        + (f", GPU {mach['gpu']}" if "gpu" in mach else "")
        + f"; torch {mach['torch']}, transformers {mach['transformers']}, Python {mach['python']}"
    )
    models: Text = ["target ", Code(meta["model"])]
    models += [", draft ", Code(meta["draft"])] if meta["draft"] else [", no draft"]
    models.append(f"; dtype {meta['dtype']}, device {meta['device']}")
    groups = ", ".join(f"{g} {n}" for g, n in meta["group_sizes"].items())
    rows: list[tuple[str, Text]] = [
        ("command", [Code(meta["command"])]),
        (
            "date",
            [
                f"{meta['started_utc']} (wall time {meta['wall_s'] / 60:.1f} min, models loaded in "
                f"{meta['load_s']:.0f} s)"
            ],
        ),
        (
            "matrix ISA",
            [
                Code(matrix_isa(result)),
                " (what this host multiplies matrices with: speed ratios compare only between hosts with the same "
                "ISA and dtype)",
            ],
        ),
        ("machine", [machine]),
        ("models", models),
        (
            "decoding",
            [
                f"greedy, max_new_tokens {meta['max_new_tokens']} (EOS may stop earlier; produced tokens are "
                f"counted), γ {meta['gamma']} ({meta['gamma_source']}); {meta['repeats']} repeat(s), methods "
                "interleaved with rotated order, one untimed warm-up each"
            ],
        ),
        (
            "prompts",
            [
                f"{len(result['prompts'])} from ",
                Code(meta["data"]),
                f" (seed {meta['seed']}, chat {meta['chat']}), task groups: {groups}; "
                f"{len(meta['calibration_dropped'])} prompt(s) dropped because a profile was calibrated on them",
            ],
        ),
    ]
    quiet = contention_text(result)
    if quiet:
        rows.append(("contention", [quiet]))
    code = meta.get("code")
    if code:
        rows.append(
            (
                "code",
                [f"viasd-tune {code['viasd_tune']}" + (f", git {code['git']}" if code.get("git") else "")],
            )
        )
    return rows


def contention_text(result: dict) -> str | None:
    meta = result["meta"]
    totals = [s["contention"] for s in result["summary"].values() if "contention" in s]
    if not totals:
        return None
    settings = meta.get("contention", {})
    runs = sum(c["runs"] for c in totals)
    text = (
        f"{sum(c['disturbed_runs'] for c in totals)} of {runs} timed runs had other processes using more than "
        f"{settings.get('foreign_max', 0.05):g} cores on average"
    )
    if settings.get("retries") or settings.get("wait_idle"):
        text += (
            f" ({sum(c['retries'] for c in totals)} re-run, {sum(c['waited_s'] for c in totals) / 60:.1f} min "
            "spent waiting for quiet)"
        )
    start, end = meta["machine"].get("load_average_at_start"), meta.get("load_average_at_end")
    if start is not None:
        text += f"; load average at start {start}" + (f", at end {end}" if end is not None else "")
    return text


def _rng(d: dict, spec: str = ".2f") -> str:
    return f"{d['median']:{spec}} [{d['min']:{spec}}–{d['max']:{spec}}]"


def _accuracy_cell(acc: dict) -> str:
    parts = [
        f"{'pass@1' if k == 'pass@1' else 'final number'} {v['correct']}/{v['graded']}"
        for k, v in acc.items()
    ]
    return ", ".join(parts) or "–"


def _shares_cell(shares: dict | None, method: str) -> str:
    if shares is None or not is_viasd(method):
        return "–"
    return " / ".join(f"{shares[k]:.0%}" for k in ("direct", "slim", "full"))


def _groups(result: dict) -> list[str]:
    return sorted({g for s in result["summary"].values() for g in s["per_group"]})


def method_table(result: dict) -> pd.DataFrame:
    """One row per method: speed, target forwards, fidelity, accuracy, tier shares."""
    import pandas as pd

    rows = []
    for m, s in result["summary"].items():
        base = m == BASELINE
        rows.append(
            {
                "method": m,
                "tok/s median [min–max]": _rng(s["tok_s"]),
                "speedup vs hf median [min–max]": "1 (baseline)" if base else _rng(s["speedup_vs_hf"], ".3f"),
                "accepted / target call": f"{s['accepted_per_target_call']:.2f}",
                "exact match": "(reference)" if base else f"{s['exact_match']:.0%}",
                "agreement": "(reference)" if base else f"{s['agreement']:.3f}",
                "greedy agreement": f"{s['greedy_agreement']:.3f}",
                "task accuracy": _accuracy_cell(s["accuracy"]),
                "tiers direct/slim/full": _shares_cell(s.get("tier_shares"), m),
            }
        )
    return pd.DataFrame(rows)


GLOSSARY: Text = [
    Em("speedup"),
    ": ",
    Code("hf"),
    "'s time per token / the method's, per repeat (median [min–max]). ",
    Em("accepted / target call"),
    ": tokens emitted per forward of the full target (ours: our own count; HF: a forward hook), prefill "
    "included. ",
    Em("exact match"),
    " / ",
    Em("agreement"),
    ": the output equals / position-wise agrees with ",
    Code("hf"),
    "'s greedy output (first repeat). ",
    Em("greedy agreement"),
    ": share of emitted tokens that are the target's argmax given the emitted prefix (one teacher-forced "
    "forward). Task accuracy uses the first repeat's output.",
]


def group_speedup_table(result: dict) -> pd.DataFrame:
    import pandas as pd

    groups, sizes = _groups(result), result["meta"]["group_sizes"]
    rows = []
    for m, s in result["summary"].items():
        if m == BASELINE:
            continue
        row = {"method": m}
        for g in groups:
            x = s["per_group"].get(g)
            row[f"{g} ({sizes[g]})"] = _rng(x["speedup_vs_hf"], ".3f") if x else "–"
        rows.append(row)
    return pd.DataFrame(rows, columns=["method", *(f"{g} ({sizes[g]})" for g in groups)])


def routed_versus_table(result: dict) -> pd.DataFrame | None:
    """Per routed profile and configuration: the profile's paired speed ratio to the configuration alone, over
    all prompts and per task group; None when no routed profile ran beside its configurations."""
    import pandas as pd

    groups, sizes = _groups(result), result["meta"]["group_sizes"]
    n = len(result["prompts"])
    rows = []
    for m, s in result["summary"].items():
        for conf, vs in s.get("versus_configurations", {}).items():
            row = {"method": m, "vs": conf, f"all ({n})": _versus_cell(vs["all"])}
            for g in groups:
                x = vs["per_group"].get(g)
                row[f"{g} ({sizes[g]})"] = _versus_cell(x) if x else "–"
            rows.append(row)
    return pd.DataFrame(rows) if rows else None


def _versus_cell(x: dict) -> str:
    return f"{_rng(x, '.3f')}, ahead {x['ahead']}/{x['repeats']}"


def group_agreement_table(result: dict) -> pd.DataFrame:
    import pandas as pd

    groups = _groups(result)
    rows = []
    for m, s in result["summary"].items():
        row = {"method": m}
        for g in groups:
            x = s["per_group"].get(g)
            row[g] = (
                f"{x['exact_match']:.0%} / {x['agreement']:.3f} / {x['greedy_agreement']:.3f}" if x else "–"
            )
        rows.append(row)
    return pd.DataFrame(rows, columns=["method", *groups])


def prompt_table(result: dict) -> pd.DataFrame:
    """Per prompt: its task group and length, and per method the median seconds and the tokens produced."""
    import statistics

    import pandas as pd

    methods = list(result["summary"])
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in result["records"]:
        runs.setdefault((r["method"], r["prompt"]), []).append(r)
    rows = []
    for p in result["prompts"]:
        row = {"prompt": p["id"], "task group": p["task_group"], "prompt tokens": str(p["prompt_tokens"])}
        for m in methods:
            rs = sorted(runs.get((m, p["id"]), []), key=lambda r: r["repeat"])
            row[m] = f"{statistics.median(r['seconds'] for r in rs):.2f} s / {rs[0]['tokens']}" if rs else "–"
        rows.append(row)
    return pd.DataFrame(rows, columns=["prompt", "task group", "prompt tokens", *methods])


def difference_items(result: dict) -> list[Text]:
    items: list[Text] = []
    n = len(result["prompts"])
    for m, s in result["summary"].items():
        if m == BASELINE or "diffs" not in s:
            continue
        diffs = s["diffs"]
        text: Text = [Code(m), f": {n - len(diffs)}/{n} identical"]
        if diffs:
            text.append(
                "; "
                + "; ".join(
                    f"{d['prompt']} differs from token {d['first_diff']} ({d['tokens']} tokens, hf {d['hf_tokens']})"
                    for d in diffs
                )
            )
        items.append(text)
    return items


def method_items(result: dict) -> list[Text]:
    meta = result["meta"]
    items: list[Text] = [
        [Code(m), f": {info['description']}; {json.dumps(info['settings'], default=str)}"]
        for m, info in result["methods"].items()
    ]
    items += [[Code(m), f": skipped — {why}"] for m, why in meta["skipped_methods"].items()]
    items += [[f"note: {note}"] for note in meta["notes"]]
    return items


# (key, title, caption, table or list) sections after the main method table, in both reports
def sections(result: dict) -> list[tuple[str, Text, str, Any]]:
    versus = routed_versus_table(result)
    routed = [
        (
            "routed-versus",
            ["Routed profile vs each of its configurations alone"],
            "per repeat, the configuration's time per token / the routed profile's, both run interleaved in that "
            "repeat: median [min–max], and in how many repeats the routed profile was faster",
            versus,
        )
    ]
    return [
        (
            "group-speedup",
            ["Speedup vs ", Code("hf"), " per task group"],
            "median [min–max] over repeats",
            group_speedup_table(result),
        ),
        *(routed if versus is not None else []),
        (
            "group-agreement",
            ["Agreement with ", Code("hf"), " per task group"],
            "exact match / agreement / greedy agreement",
            group_agreement_table(result),
        ),
        (
            "differences",
            ["Outputs that differ from ", Code("hf")],
            "first repeat; in bf16 a k-token verify block and k single steps round differently, so near-ties "
            "can flip a token",
            difference_items(result),
        ),
        (
            "prompts",
            ["Per prompt"],
            "median seconds over repeats / tokens produced in the first; prompt tokens include the chat template",
            prompt_table(result),
        ),
        ("methods", ["Methods"], "", method_items(result)),
    ]


# ------------------------------------------------------------------------------------------------ markdown


def table_md(df: pd.DataFrame, code_column: str | None = "method") -> list[str]:
    lines = ["| " + " | ".join(str(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    for row in df.itertuples(index=False):
        cells = [f"`{v}`" if c == code_column else str(v) for c, v in zip(df.columns, row, strict=True)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(result: dict) -> str:
    """The human report: facts, the method table, per task group, differences, per prompt, methods."""
    lines = ["# viasd-tune bench", ""]
    lines += [f"- {label}: {text_md(text)}" for label, text in facts(result)]
    lines += ["", *table_md(method_table(result)), "", text_md(GLOSSARY)]
    for _, title, caption, content in sections(result):
        lines += ["", f"**{text_md(title)}**" + (f" ({caption})" if caption else ""), ""]
        if isinstance(content, list):
            lines += [f"- {text_md(item)}" for item in content]
        else:
            lines += table_md(content, "method" if "method" in content.columns else None)
    lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ HTML


def _colors(summary: dict) -> dict[str, str]:
    """One colour per method, the same in every figure."""
    return {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(summary)}


def _fig_title(result: dict, what: str) -> dict:
    meta = result["meta"]
    return dict(text=f"{what} · {meta['dtype']} on {matrix_isa(result)}", font=dict(size=14), x=0.01)


def fig_groups(result: dict):
    import plotly.graph_objects as go

    summary = result["summary"]
    groups = _groups(result)
    colors = _colors(summary)
    fig = go.Figure()
    for m, s in summary.items():
        if m == BASELINE:
            continue
        vals = [s["per_group"].get(g, {}).get("speedup_vs_hf") for g in groups] + [s["speedup_vs_hf"]]
        fig.add_trace(
            go.Bar(
                name=m,
                x=[*groups, "all"],
                y=[v["median"] if v else None for v in vals],
                marker_color=colors[m],
                error_y=dict(
                    type="data",
                    symmetric=False,
                    array=[v["max"] - v["median"] if v else 0 for v in vals],
                    arrayminus=[v["median"] - v["min"] if v else 0 for v in vals],
                ),
                hovertemplate=f"{html.escape(m)} · %{{x}}: %{{y:.3f}}×<extra></extra>",
            )
        )
    fig.add_hline(y=1.0, line_dash="dash", line_color="#888", annotation_text="hf generate")
    fig.update_layout(
        title=_fig_title(result, "Speedup vs hf per task group"),
        barmode="group",
        template="plotly_white",
        height=460,
        yaxis_title="speedup vs hf (time per token ratio)",
        xaxis_title="task group",
        legend_title="method",
        margin=dict(l=70, r=30, t=50, b=60),
    )
    return fig


def fig_fidelity(result: dict):
    import plotly.graph_objects as go

    summary = result["summary"]
    colors = _colors(summary)
    fig = go.Figure()
    for n, (m, s) in enumerate(summary.items()):
        sp = s["speedup_vs_hf"]
        fig.add_trace(
            go.Scatter(
                x=[sp["median"]],
                y=[s["agreement"]],
                mode="markers+text",
                name=m,
                text=[m],
                textposition="top center" if n % 2 == 0 else "bottom center",  # methods often coincide
                marker=dict(size=13, color=colors[m]),
                error_x=dict(
                    type="data",
                    symmetric=False,
                    array=[sp["max"] - sp["median"]],
                    arrayminus=[sp["median"] - sp["min"]],
                ),
                hovertemplate=(
                    f"<b>{html.escape(m)}</b><br>speedup %{{x:.3f}}×<br>agreement %{{y:.3f}}<br>"
                    f"exact match {s['exact_match']:.0%}<br>greedy agreement {s['greedy_agreement']:.3f}"
                    "<extra></extra>"
                ),
            )
        )
    fig.update_layout(
        title=_fig_title(result, "Fidelity vs speedup"),
        template="plotly_white",
        height=460,
        xaxis_title="speedup vs hf (median; bars: min–max over repeats)",
        yaxis_title="agreement with hf greedy output",
        legend_title="method",
        margin=dict(l=70, r=30, t=50, b=60),
    )
    return fig


def table_html(df: pd.DataFrame, code_column: str | None = "method") -> str:
    cells = df.map(esc)
    if code_column in cells.columns:
        cells[code_column] = cells[code_column].map(lambda v: f"<code>{v}</code>")
    cells.columns = [esc(c) for c in cells.columns]
    return cells.to_html(index=False, escape=False, classes="data", border=0, justify="left")


def _section(key: str, title: Text, caption: str, inner: str) -> str:
    cap = f'\n<p class="caption">{esc(caption)}</p>' if caption else ""
    return f'<section id="{key}">\n<h2>{text_html(title)}</h2>{cap}\n{inner}\n</section>'


def render_html(result: dict) -> str:
    """One offline page: the facts, speedup per task group, fidelity vs speedup, then the tables."""
    body = [
        "<h1>viasd-tune bench</h1>",
        facts_table([(label, text_html(text)) for label, text in facts(result)]),
        '<p class="caption">Written by viasd-tune bench with bench.json and bench.md; opens offline.</p>',
    ]
    figures = [
        (
            "groups",
            "Speedup vs hf per task group",
            "Median over repeats; whiskers: min–max. Above the dashed line a method is faster than hf generate.",
            fig_groups(result),
        ),
        (
            "fidelity",
            "Fidelity vs speedup",
            "Agreement with hf's greedy output (first repeat) against the median speedup.",
            fig_fidelity(result),
        ),
    ]
    for n, (key, title, caption, fig) in enumerate(figures):
        inner = f"<div class='figure'>{figure_html(fig, FIG_ID_PREFIX + key, n == 0)}</div>"
        body.append(_section(key, [title], caption, inner))
    main = table_html(method_table(result)) + f'\n<p class="text">{text_html(GLOSSARY)}</p>'
    body.append(_section("summary", ["Methods compared"], "", main))
    for key, title, caption, content in sections(result):
        if isinstance(content, list):
            inner = (
                '<ul class="items">\n' + "\n".join(f"<li>{text_html(t)}</li>" for t in content) + "\n</ul>"
            )
        else:
            inner = table_html(content, "method" if "method" in content.columns else None)
        body.append(_section(key, title, caption, inner))
    return page_html(f"viasd-tune bench: {result['meta']['model']}", "\n".join(body), max_width=PAGE_WIDTH_PX)


def write_reports(out: Path, result: dict) -> dict[str, Path]:
    """bench.json, bench.md and bench.html, each written atomically."""
    paths = {"json": out / "bench.json", "md": out / "bench.md", "html": out / "bench.html"}
    atomic_write_text(paths["json"], json.dumps(result, indent=1, allow_nan=False, default=str) + "\n")
    atomic_write_text(paths["md"], render_markdown(result))
    atomic_write_text(paths["html"], render_html(result))
    return paths

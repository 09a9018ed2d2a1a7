"""The page shell of viasd-tune's offline HTML reports (the search dashboard, the bench page): head, CSS, and
Plotly figures embedded so that the file opens without a network.

plotly.js goes inline into the page's first figure and nowhere else; nothing is fetched (no CDN, no MathJax).
"""

from __future__ import annotations

import html
from typing import Any

PLOTLY_CONFIG = {"responsive": True, "displaylogo": False}
DEFAULT_MAX_WIDTH = 1040

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; margin: 0;
       background: #fafafa; }
main { max-width: {MAX_WIDTH}px; margin: 0 auto; padding: 16px 20px 40px; }
h1 { font-size: 1.45rem; margin: 0.2em 0 0.4em; }
h2 { font-size: 1.15rem; margin: 1.6em 0 0.2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
p.caption { margin: 0.2em 0 0.6em; color: #555; font-size: 0.92rem; }
table.facts { border-collapse: collapse; font-size: 0.93rem; }
table.facts th { text-align: left; font-weight: 600; padding: 2px 16px 2px 0; vertical-align: top; color: #444;
                 white-space: nowrap; }
table.facts td { padding: 2px 0; }
.figure { background: #fff; border: 1px solid #e5e5e5; border-radius: 4px; }
.note { background: #fff8e1; border: 1px solid #f0d890; padding: 8px 12px; border-radius: 4px; }
code { font-size: 0.9em; }
table.data { border-collapse: collapse; font-size: 0.85rem; margin: 0.6em 0; background: #fff; }
table.data th, table.data td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
table.data th { background: #f3f3f3; }
ul.items li, p.text { font-size: 0.9rem; overflow-wrap: anywhere; }
"""


def esc(value: Any) -> str:
    """Text as HTML (quotes included), for any value."""
    return html.escape(str(value))


def figure_html(fig: Any, div_id: str, first: bool) -> str:
    """One figure as an HTML fragment; the page's first figure carries plotly.js, so the page opens offline."""
    return fig.to_html(
        full_html=False,
        include_plotlyjs=first,  # True embeds plotly.js inline (never a CDN link)
        include_mathjax=False,
        div_id=div_id,
        config=PLOTLY_CONFIG,
        default_width="100%",
    )


def facts_table(rows: list[tuple[str, str]]) -> str:
    """The header's facts: ``rows`` are (label, HTML) pairs; labels are escaped here, values are HTML already."""
    body = "\n".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="facts">\n{body}\n</table>'


def page_html(title: str, body: str, max_width: int = DEFAULT_MAX_WIDTH) -> str:
    """A whole page: ``title`` (text, escaped here) in the head, ``body`` (HTML) inside ``<main>``."""
    css = _CSS.replace("{MAX_WIDTH}", str(max_width))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{esc(title)}</title>
<style>{css}</style>
</head>
<body>
<main>
{body}
</main>
</body>
</html>
"""

"""Read an offline Plotly page as its reader gets it, not as bytes: the text of the HTML around the figures
(entities decoded), and each figure's data and layout as the browser receives them (the JSON handed to
``Plotly.newPlot``, typed arrays decoded). How plotly happens to encode a string (``τ`` or ``\\u03c4``) or an
array (a list or base64 ``bdata``) then cannot make a test pass or fail."""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

_NEW_PLOT = re.compile(r"Plotly\.newPlot\(\s*")
_BLOCKS = {"p", "div", "section", "h1", "h2", "tr", "table", "br", "title", "td", "th"}


@dataclass
class Section:
    heading: str = ""
    captions: list[str] = field(default_factory=list)  # <p class="caption">
    notes: list[str] = field(default_factory=list)  # <p class="note">
    figures: list[str] = field(default_factory=list)  # ids of its plotly divs


@dataclass
class Page:
    title: str = ""
    h1: str = ""
    facts: dict[str, str] = field(default_factory=dict)  # the header table: <th> -> <td>
    sections: dict[str, Section] = field(default_factory=dict)  # <section id=...>, in page order
    figure_ids: list[str] = field(default_factory=list)  # every div.plotly-graph-div, in page order
    figures: dict[str, dict] = field(default_factory=dict)  # div id -> {"data": [...], "layout": {...}}
    text: str = ""  # all visible text outside scripts and styles


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self._stack: list[tuple[str, dict[str, str]]] = []
        self._buf: list[str] = []  # text of the innermost element being captured
        self._capture: tuple[str, ...] | None = None
        self._th: str | None = None
        self._section: Section | None = None
        self._chunks: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self._stack.append((tag, a))
        if tag in _BLOCKS:
            self._chunks.append("\n")
        if tag == "section":
            self._section = self.page.sections.setdefault(a.get("id", ""), Section())
        if tag == "div" and "plotly-graph-div" in a.get("class", "").split():
            self.page.figure_ids.append(a["id"])
            if self._section is not None:
                self._section.figures.append(a["id"])
        if tag in ("title", "h1", "h2", "th", "td") or (tag == "p" and a.get("class") in ("caption", "note")):
            self._capture = (tag, a.get("class", ""))
            self._buf = []

    def handle_endtag(self, tag):
        while self._stack:
            if self._stack.pop()[0] == tag:
                break
        if self._capture is None or self._capture[0] != tag:
            return
        text = " ".join("".join(self._buf).split())
        kind, cls = self._capture
        self._capture = None
        if kind == "title":
            self.page.title = text
        elif kind == "h1":
            self.page.h1 = text
        elif kind == "h2" and self._section is not None:
            self._section.heading = text
        elif kind == "th":
            self._th = text
        elif kind == "td" and self._th is not None:
            self.page.facts[self._th] = text
            self._th = None
        elif kind == "p" and self._section is not None:
            (self._section.captions if cls == "caption" else self._section.notes).append(text)

    def handle_data(self, data):
        if self._stack and self._stack[-1][0] in ("script", "style"):
            return
        if self._capture is not None:
            self._buf.append(data)
        self._chunks.append(data)


def decode_arrays(value):
    """Plotly ≥ 6 writes numeric arrays as ``{"dtype": "f8", "bdata": <base64>[, "shape": "r, c"]}``; give them
    back as lists, so a figure reads the same whichever plotly wrote it."""
    if isinstance(value, dict):
        if "bdata" in value and "dtype" in value:
            array = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
            if "shape" in value:
                array = array.reshape([int(n) for n in str(value["shape"]).split(",")])
            return array.tolist()
        return {k: decode_arrays(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_arrays(v) for v in value]
    return value


def plotly_figures(html: str) -> dict[str, dict]:
    """Every ``Plotly.newPlot(id, data, layout, config)`` call of the page, by div id, arguments JSON-decoded."""
    decoder = json.JSONDecoder()
    figures = {}
    for match in _NEW_PLOT.finditer(html):
        args, pos = [], match.end()
        for _ in range(4):  # div id, data, layout, config
            value, pos = decoder.raw_decode(html, pos)
            args.append(value)
            pos = re.compile(r"\s*,?\s*").match(html, pos).end()
        div_id, data, layout, _config = args
        figures[div_id] = {"data": decode_arrays(data), "layout": decode_arrays(layout)}
    return figures


def read_page(path_or_html: str | Path) -> Page:
    html = Path(path_or_html).read_text(encoding="utf-8") if isinstance(path_or_html, Path) else path_or_html
    parser = _Parser()
    parser.feed(html)
    parser.close()
    page = parser.page
    page.text = " ".join("".join(parser._chunks).split())
    page.figures = plotly_figures(html)
    return page


def traces(figure: dict, **match) -> list[dict]:
    """The traces of a figure whose fields equal ``match`` (e.g. ``name="feasible"``)."""
    return [t for t in figure["data"] if all(t.get(k) == v for k, v in match.items())]


def trace_points(trace: dict, *fields: str) -> list[tuple]:
    """A trace's per-point values, zipped: ``trace_points(t, "x", "y", "text")``."""
    return list(zip(*(trace[f] for f in fields), strict=True))

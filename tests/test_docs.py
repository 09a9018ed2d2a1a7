"""The docs a reader follows: every relative link resolves (file, and heading for a ``#anchor``), the README stays a
short page, and the results index lists every report, newest first."""

from __future__ import annotations

import re
import unicodedata
from itertools import pairwise
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "benchmarks" / "README.md",
        RESULTS / "README.md",
        RESULTS / "LOG.md",
    ]
)
README_MAX_LINES = 200
_MD = MarkdownIt("commonmark").enable("table")


def _inline_tokens(path: Path):
    for block in _MD.parse(path.read_text(encoding="utf-8")):
        yield from block.children or ()


def _links(path: Path) -> list[str]:
    """Link targets as written, code spans and fenced blocks excluded (the parser knows what is a link)."""
    return [t.attrGet("href") for t in _inline_tokens(path) if t.type == "link_open"]


def _slug(text: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped (letters, digits, marks, ``-`` and ``_`` kept),
    spaces to hyphens."""
    kept = (c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets ``-1``, ``-2``... as on GitHub."""
    tokens = _MD.parse(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for prev, tok in pairwise(tokens):
        if prev.type == "heading_open":
            slug = _slug("".join(c.content for c in tok.children or () if c.type in ("text", "code_inline")))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _broken(page: Path) -> list[str]:
    broken = []
    for href in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", href):  # http:, https:, mailto: ... : not ours to check offline
            continue
        target, _, anchor = href.partition("#")
        dest = (page.parent / unquote(target)).resolve() if target else page
        if not dest.exists():
            broken.append(f"{href}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            broken.append(f"{href}: no heading with that anchor in {target or page.name}")
    return broken


def test_the_link_checker_catches_a_broken_link(tmp_path: Path) -> None:
    """Its own power: a missing file, a missing anchor and a link in a table cell are found; code is not a link."""
    (tmp_path / "other.md").write_text("# A title: with `code`\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-title-with-code) [ok](other.md#twice-1) [ok](#here) [web](https://example.org/x)\n\n"
        "# Here\n\n| a | b |\n|---|---|\n| [gone](gone.md) | [bad](other.md#nope) |\n\n"
        "`[not a link](gone.md)`\n\n```\n[not a link](gone.md)\n```\n",
        encoding="utf-8",
    )
    assert [b.split(":")[0] for b in _broken(page)] == ["gone.md", "other.md#nope"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    assert _links(page), f"{page.relative_to(ROOT)} links nowhere: is the parser reading it?"
    assert _broken(page) == []


def test_readme_is_a_short_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move detail to docs/ or benchmarks/results/"
    )


def _expand(name: str) -> list[str]:
    """``a-{x,y}.json`` → ``a-x.json``, ``a-y.json`` (the index names families of files this way)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for alt in m.group(1).split(",") for n in _expand(name[: m.start()] + alt + name[m.end() :])]


def test_results_index_lists_every_report_newest_first() -> None:
    index = RESULTS / "README.md"
    linked = {unquote(h) for h in _links(index) if "/" not in h}
    named = {n for t in _inline_tokens(index) if t.type == "code_inline" for n in _expand(t.content)}
    for path in sorted(RESULTS.iterdir()):
        name = path.name
        if name in ("README.md", "LOG.md"):
            continue
        if path.is_dir():
            assert f"{name}/" in named, f"benchmarks/results/README.md does not list {name}/"
        elif path.suffix == ".md":
            assert name in linked, f"benchmarks/results/README.md does not link the report {name}"
        else:
            twin = path.with_suffix(".md").name  # a report's raw JSON sits beside it
            assert name in named or twin in linked, f"benchmarks/results/README.md does not list {name}"

    tokens = _MD.parse(index.read_text(encoding="utf-8"))
    first_cells = [tokens[i + 2].content for i, t in enumerate(tokens) if t.type == "tr_open"]
    dates = [c[:10] for c in first_cells if re.fullmatch(r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2})?", c)]
    assert len(dates) == sum(n.endswith(".md") for n in linked if n != "LOG.md"), "one dated row per report"
    assert dates == sorted(dates, reverse=True), "the index lists reports newest first"

"""What a study pins about the engine that scored its trials, computed rather than bumped by hand."""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _code(path: Path) -> str:
    """The module's syntax tree without docstrings (comments are not in it): what runs, not what explains it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree)


@functools.cache
def engine_fingerprint() -> str:
    """sha256 of the code that decides a trial's tokens and forwards: the decoding package and routing. The search
    keeps it in a study's signature, so a study scored by one engine is not continued by another (the replay runs
    the engine itself, so the two cannot drift apart; what changes with the engine is every trial's score)."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted(here.glob("*.py")) + [here.parent / "routing.py"]:
        h.update(path.name.encode() + b"\0" + _code(path).encode() + b"\0")
    return h.hexdigest()

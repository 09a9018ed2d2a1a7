"""From parsed command-line arguments to settings: the flag types every sub-command shares, and the one builder
of ``bench`` and ``search`` settings (each used to copy its flags field by field, and the copies drifted:
``--categories "qa, rag"`` worked in one and not the other)."""

from __future__ import annotations

import argparse
import math
from dataclasses import fields
from typing import Any, TypeVar

from .errors import UserError

T = TypeVar("T")
# Settings fields given on the command line as one comma-separated string.
LIST_FLAGS = ("categories", "methods")


def finite_float(text: str) -> float:
    """argparse ``type`` of every float flag: a finite number, refused at parsing (``nan`` would otherwise pass
    every ``<``/``>`` check and surface at the end of a long run, e.g. when writing JSON)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give one such as 0.5")
    return value


def split_list(text: str | None, flag: str = "the list") -> list[str] | None:
    """``"qa, rag"`` -> ``["qa", "rag"]``: items stripped, empty ones dropped; ``None`` stays ``None``, and a
    list that names nothing (``","``) is refused rather than read as no filter."""
    if text is None:
        return None
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise UserError(
            f"{flag} {text!r} names nothing; give comma-separated names such as qa,math_reasoning"
        )
    return items


def settings_from_args(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``cls`` (a settings dataclass) from the flags of the same names: ``given`` values win, ``--no-progress``
    sets ``progress``, comma-separated flags (``LIST_FLAGS``) become lists. The dataclass validates."""
    flags = vars(args)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in given:
            values[f.name] = given[f.name]
        elif f.name == "progress" and "no_progress" in flags:
            values[f.name] = not flags["no_progress"]
        elif f.name in flags:
            value = flags[f.name]
            listed = f.name in LIST_FLAGS and isinstance(value, str)
            values[f.name] = split_list(value, "--" + f.name.replace("_", "-")) if listed else value
    return cls(**values)

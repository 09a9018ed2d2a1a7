"""The search's settings: one dataclass, checked whole before any folder, study or model exists (the command
line and Python callers alike), so bad input fails in one line and changes nothing on disk."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from pathlib import Path

from .. import prompts
from ..credentials import check_storage
from ..errors import UserError
from ..fsutil import check_outputs_spare_inputs
from .space import space_file
from .storage import sqlite_file


@dataclass
class SearchSettings:
    model: str
    draft: str | None = None
    data: str = "builtin"
    data_field: str | None = None
    categories: list[str] | None = None
    prompts: int | None = 12
    held_out: float = 0.25
    chat: str = "auto"
    trials: int = 20
    out: str = "artifacts/search"
    storage: str | None = None
    study_name: str | None = None
    space: str = "default"
    min_fidelity: float = 0.95
    max_new_tokens: int = 48
    timeout: float | None = None
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    progress: bool = True
    worker: bool = False  # only run trials; the process that started the workers exports

    def __post_init__(self) -> None:
        """Every setting checked here, before any folder, study or model exists (flags and Python alike)."""
        for name in ("model", "data", "out", "space"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise UserError(f"{name} must be a non-empty string (got {getattr(self, name)!r})")
        _whole("prompts", self.prompts, 1, MAX_PROMPTS, "--prompts", allow_none=True)
        _whole("trials", self.trials, 1, MAX_TRIALS, "--trials")
        _whole("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS, "--max-new-tokens")
        _whole("seed", self.seed, 0, 2**32 - 1, "--seed")
        held = _number("held_out", self.held_out, "--held-out")
        if not 0 <= held < 1:
            raise UserError(f"held_out (--held-out) must be in [0, 1) (got {held}); it is the share kept out")
        fid = _number("min_fidelity", self.min_fidelity, "--min-fidelity")
        if not 0 < fid <= 1:
            raise UserError(f"--min-fidelity must be in (0, 1] (got {fid})")
        if self.timeout is not None:
            t = _number("timeout", self.timeout, "--timeout")
            if not t > 0:
                raise UserError(
                    f"--timeout must be a number of seconds > 0 (got {t}); leave it out for no time limit"
                )
        if self.chat not in ("auto", "on", "off"):
            raise UserError(f"chat (--chat) must be auto, on or off (got {self.chat!r})")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file, not a folder; pass a folder for the search's outputs")
        if self.storage is not None:
            check_storage(self.storage)
        if self.study_name is not None and (
            not isinstance(self.study_name, str) or not self.study_name.strip()
        ):
            raise UserError(f"--study-name must be a non-empty name (got {self.study_name!r})")
        prompts.check_source(self.data, self.data_field)
        self._check_outputs_spare_inputs()

    def _check_outputs_spare_inputs(self) -> None:
        """The files the search writes into ``out`` must not be its data, space or study database."""
        out = Path(self.out)
        written = [(f"--out's {name}", out / name) for name in ("profile.json", "dashboard.html")]
        if self.storage is None:
            written.append(("--out's study.db", out / "study.db"))
        read = [
            ("--data", prompts.data_file(self.data)),
            ("--space", space_file(self.space)),
            ("--storage", sqlite_file(self.storage) if self.storage else None),
        ]
        check_outputs_spare_inputs(written, read, folders=[("--out's pareto/", out / "pareto")])


MAX_PROMPTS = 100_000
MAX_TRIALS = 100_000
MAX_NEW_TOKENS = 1_000_000  # bounds against typos; the model's context length is checked once it loads


def _whole(name: str, value, low: int, high: int, flag: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(f"{name} ({flag}) must be a whole number (got {value!r})")
    if not low <= value <= high:
        raise UserError(f"{name} ({flag}) must be from {low} to {high} (got {value})")


def _number(name: str, value, flag: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(f"{name} ({flag}) must be a finite number (got {value!r})")
    return float(value)

"""What one bench run depends on: the ``viasd-tune bench`` flags, checked before anything slow starts."""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from .. import prompts
from ..errors import UserError
from ..fsutil import check_outputs_spare_inputs


@dataclass
class BenchSettings:
    """Everything one bench run depends on (the CLI flags, one to one)."""

    out: str
    data: str
    model: str | None = None
    draft: str | None = None
    profiles: list[str] = field(default_factory=list)
    data_field: str | None = None
    categories: list[str] | None = None
    prompts: int | None = 12
    max_new_tokens: int = 64
    repeats: int = 3
    gamma: int | None = None
    draft_confidence: float = 0.0  # our sd's: stop drafting below this top-1 probability (0: off)
    tree_nodes: int | None = None  # sd-tree's node budget; given, sd-tree runs by default
    methods: list[str] | None = None
    chat: str = "auto"
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    warmup_tokens: int = 16
    progress: bool = True
    threads: int = 0  # torch.set_num_threads before loading; 0 leaves torch's default
    wait_idle: float = 0.0  # before each timed run, wait up to this long for other processes to go idle
    foreign_max: float = 0.05  # a run during which other processes used more cores than this is "disturbed"
    retries: int = 0  # re-run a disturbed run at most this many times

    def validate(self) -> None:
        """Fail on bad numbers before anything slow (loading models) starts."""
        for name, value, low in (
            ("--repeats", self.repeats, 1),
            ("--max-new-tokens", self.max_new_tokens, 1),
            ("--warmup-tokens", self.warmup_tokens, 1),
            ("--threads", self.threads, 0),
            ("--wait-idle", self.wait_idle, 0),
            ("--foreign-max", self.foreign_max, 0),
            ("--retries", self.retries, 0),
        ):
            if not value >= low or not math.isfinite(value):  # NaN fails every comparison
                raise UserError(f"{name} must be a finite number, at least {low} (got {value})")
        if self.prompts is not None and self.prompts < 1:
            raise UserError(f"--prompts must be at least 1 (got {self.prompts})")
        if self.gamma is not None and self.gamma < 1:
            raise UserError(
                f"--gamma must be at least 1 (got {self.gamma}); it is the draft tokens per round"
            )
        from ..config import DecodeConfig  # torch: only once a bench really runs, never for --help

        # Our sd drafts with the draft model, else prompt lookup: its one bound, and whether it applies at all.
        DecodeConfig(
            mode="sd", drafter="model" if self.draft else "lookup", draft_confidence=self.draft_confidence
        )
        if self.draft_confidence and self.methods is not None and "sd" not in self.methods:
            raise UserError(
                f"--draft-confidence {self.draft_confidence:g} does nothing here: it applies to method sd only, "
                "which --methods leaves out; drop it or add sd to --methods"
            )
        prompts.check_source(self.data, self.data_field)
        reads_gamma = ("sd", "sd-tree", "hf-lookup", "hf-assisted", "hf-assisted-conf", "hf-assisted-heuristic")
        if self.gamma is not None and self.methods is not None and not set(reads_gamma) & set(self.methods):
            raise UserError(
                f"--gamma {self.gamma} does nothing here: it applies to methods {', '.join(reads_gamma)}, which "
                "--methods leaves out; drop it or add one of them"
            )
        if self.tree_nodes is not None:  # the tree's node budget: its one bound and message
            DecodeConfig(mode="sd", drafter="lookup+recycle", tree_nodes=self.tree_nodes)
        if self.chat not in prompts.CHAT_MODES:
            raise UserError(f"--chat must be one of {', '.join(prompts.CHAT_MODES)} (got {self.chat!r})")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file; give a folder for bench.json, bench.md and bench.html")
        written = [(f"--out's {name}", out / name) for name in ("bench.json", "bench.md", "bench.html")]
        read = [("--data", prompts.data_file(self.data)), *(("--profile", p) for p in self.profiles)]
        check_outputs_spare_inputs(written, read)


def command_line(s: BenchSettings) -> str:
    """An equivalent ``viasd-tune bench`` command with every setting spelled out, for the report."""
    parts = ["viasd-tune", "bench", "--model", s.model or "?"]
    if s.draft:
        parts += ["--draft", s.draft]
    for p in s.profiles:
        parts += ["--profile", p]
    parts += ["--data", s.data]
    if s.data_field:
        parts += ["--data-field", s.data_field]
    if s.categories:
        parts += ["--categories", ",".join(s.categories)]
    if s.prompts is not None:
        parts += ["--prompts", str(s.prompts)]
    parts += ["--max-new-tokens", str(s.max_new_tokens), "--repeats", str(s.repeats)]
    if s.gamma is not None:
        parts += ["--gamma", str(s.gamma)]
    if s.draft_confidence:
        parts += ["--draft-confidence", f"{s.draft_confidence:g}"]
    if s.tree_nodes is not None:
        parts += ["--tree-nodes", str(s.tree_nodes)]
    if s.methods:
        parts += ["--methods", ",".join(s.methods)]
    parts += ["--chat", s.chat, "--seed", str(s.seed), "--dtype", s.dtype, "--device", s.device]
    if s.threads:
        parts += ["--threads", str(s.threads)]
    if s.wait_idle:
        parts += ["--wait-idle", f"{s.wait_idle:g}"]
    if s.retries:
        parts += ["--retries", str(s.retries), "--foreign-max", f"{s.foreign_max:g}"]
    parts += ["--out", s.out]
    return shlex.join(parts)

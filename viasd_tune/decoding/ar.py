"""Plain autoregressive decoding of the target: the baseline every speedup is measured against."""

from __future__ import annotations

import torch
from torch import nn

from .common import FULL, GREEDY, CachedLM, Result, Sampling, Stats, pick, run_rounds


def generate(
    target: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling = GREEDY,
    gen: torch.Generator | None = None,
) -> Result:
    """One token per target forward. ``input_ids``: 1-D prompt on the model's device."""
    stats = Stats()
    full = CachedLM(target, tier="full", stats=stats)

    def one_round(seq: torch.Tensor) -> tuple[list[int], list[int]]:
        logits = full.forward(seq, keep=1)
        return [int(pick(logits[-1], sampling, gen))], [FULL]

    return run_rounds(one_round, input_ids, max_new_tokens, eos_ids, stats, [full])

"""Plain autoregressive decoding of the target: the baseline every speedup is measured against."""

from __future__ import annotations

import torch

from .common import FULL, GREEDY, LM, Result, Round, RoundHook, Sampling, Sequence, pick, run_rounds


def generate(
    full: LM,
    seq: Sequence,
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling = GREEDY,
    gen: torch.Generator | None = None,
    on_round: RoundHook | None = None,
) -> Result:
    """One token per target forward."""

    def one_round(seq: Sequence) -> Round:
        logits = full.forward(seq.ids, keep=1)
        return Round(seq.length, [int(pick(logits[-1], sampling, gen))], [FULL])

    return run_rounds(one_round, seq, max_new_tokens, eos_ids, full, on_round=on_round)

"""Two-tier speculative decoding, lossless: the drafter proposes up to γ tokens, the target verifies them in one
forward and adds its correction or bonus token. Greedy output equals ``ar``; with sampling the standard
rejection rule keeps the output distribution the target's."""

from __future__ import annotations

import torch

from .common import (
    FULL,
    GREEDY,
    LM,
    Result,
    Round,
    RoundHook,
    Sampling,
    Sequence,
    draft_budget,
    probs_from_logits,
    run_rounds,
    verify_rows,
)
from .drafters import Drafter


def verify(
    p_logits: torch.Tensor, q_logits: torch.Tensor | None, drafts: torch.Tensor, sampling: Sampling, gen
) -> list[int]:
    """Target-verify ``drafts`` (k tokens) given the target's logits at the k+1 positions that predict them
    and the next token. Returns the accepted prefix plus the correction (first rejection) or bonus token."""
    q = None if q_logits is None or sampling.greedy else probs_from_logits(q_logits, sampling)
    accepted, last = verify_rows(p_logits, q, drafts, sampling, gen)
    return accepted + [last]


def generate(
    full: LM,
    drafter: Drafter,
    seq: Sequence,
    max_new_tokens: int,
    eos_ids: set[int],
    gamma: int,
    sampling: Sampling = GREEDY,
    gen: torch.Generator | None = None,
    on_round: RoundHook | None = None,
) -> Result:
    """``full``: the target over its cache (a self-draft shares it); ``drafter`` proposes each round."""

    def one_round(seq: Sequence) -> Round:
        drafts, q_logits = drafter.draft(seq, draft_budget(gamma, max_new_tokens, seq.length - seq.prompt_len))
        p_logits = full.forward(seq.with_drafts(drafts), keep=drafts.numel() + 1)
        tokens = verify(p_logits, q_logits, drafts, sampling, gen)
        return Round(seq.length, tokens, [FULL] * len(tokens))

    return run_rounds(one_round, seq, max_new_tokens, eos_ids, full, drafter, on_round=on_round)

"""Two-tier speculative decoding, lossless: the drafter proposes γ tokens, the target verifies them in one
forward and adds its correction or bonus token. Greedy output equals ``ar``; with sampling the standard
rejection rule keeps the output distribution the target's."""

from __future__ import annotations

import torch
from torch import nn

from .common import (
    FULL,
    GREEDY,
    CachedLM,
    Result,
    Sampling,
    Stats,
    accept_mask,
    correction,
    probs_from_logits,
    run_rounds,
)
from .drafters import Drafter


def verify(
    p_logits: torch.Tensor, q_logits: torch.Tensor | None, drafts: torch.Tensor, sampling: Sampling, gen
) -> list[int]:
    """Target-verify ``drafts`` (k tokens) given the target's logits at the k+1 positions that predict them
    and the next token. Returns the accepted prefix plus the correction (first rejection) or bonus token."""
    k = drafts.numel()
    if sampling.greedy:
        choice = p_logits.argmax(-1)  # [k+1]; where the target agrees, its choice *is* the draft
        n = (choice[:k] == drafts).cumprod(0).sum().view(1)
        n, *choice = torch.cat([n, choice]).tolist()  # one host sync per verification
        return choice[: n + 1]
    p = probs_from_logits(p_logits, sampling)
    q = None if q_logits is None else probs_from_logits(q_logits, sampling)
    n = int(accept_mask(p[:k], q, drafts, sampling, gen).cumprod(0).sum())
    rejected = drafts[n] if n < k else None
    last = correction(p[n], None if q is None or n == k else q[n], rejected, sampling, gen)
    return drafts[:n].tolist() + [int(last)]


def generate(
    target: nn.Module,
    drafter_factory,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    gamma: int,
    sampling: Sampling = GREEDY,
    gen: torch.Generator | None = None,
) -> Result:
    """``drafter_factory(stats) -> Drafter`` builds a fresh drafter bound to this call's stats."""
    stats = Stats()
    full = CachedLM(target, tier="full", stats=stats)
    drafter: Drafter = drafter_factory(stats)

    def one_round(seq: torch.Tensor) -> tuple[list[int], list[int]]:
        drafts, q_logits = drafter.draft(seq, gamma)
        k = drafts.numel()
        p_logits = full.forward(torch.cat([seq, drafts]), keep=k + 1)
        tokens = verify(p_logits, q_logits, drafts, sampling, gen)
        return tokens, [FULL] * len(tokens)

    return run_rounds(one_round, input_ids, max_new_tokens, eos_ids, stats, [full, drafter])

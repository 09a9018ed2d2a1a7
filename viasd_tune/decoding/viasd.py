"""Three-tier VIA-SD decoding: draft → slim verifier (the target with sub-layers skipped) → full target.

One round, top to bottom:
1. the drafter proposes k ≤ γ tokens with distributions q;
2. the slim verifier scores all of them in one forward (its own cache), giving p_slim at each position;
3. D_i = divergence(p_slim_i, q_i) routes each position: D < τ_accept → accepted directly;
   τ_accept ≤ D < τ_escalate → the slim verifier decides (accepts, or emits its own token and ends the
   round); D ≥ τ_escalate → the full target verifies from there on, losslessly (see ``sd.verify``);
4. if every draft token got through without the full target, the slim verifier adds a bonus token.
The full model's cache lags behind tokens the other tiers accepted and catches up in one batched forward the
next time it is called. τ_escalate = 0 sends everything to the full target: plain SD, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..routing import SkipSet
from .common import (
    DIRECT,
    FULL,
    GREEDY,
    SLIM,
    CachedLM,
    Result,
    Sampling,
    Stats,
    accept_mask,
    correction,
    divergence,
    probs_from_logits,
    run_rounds,
)
from .drafters import Drafter
from .sd import verify


@dataclass(frozen=True)
class Routing:
    """Where the slim verifier's layers go and how tokens are routed between the tiers."""

    skip: SkipSet
    tau_accept: float
    tau_escalate: float
    kl: str = "forward"


def generate(
    target: nn.Module,
    drafter_factory,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    gamma: int,
    routing: Routing,
    sampling: Sampling = GREEDY,
    gen: torch.Generator | None = None,
) -> Result:
    stats = Stats()
    full = CachedLM(target, tier="full", stats=stats)
    slim = CachedLM(target, routing.skip, tier="slim", stats=stats)
    drafter: Drafter = drafter_factory(stats)

    def escalate(ext: torch.Tensor, drafts, q_logits, n: int) -> list[int]:
        """Full-target verification of ``drafts[n:]`` (``ext`` = sequence + all drafts)."""
        k = drafts.numel()
        p_logits = full.forward(ext, keep=k - n + 1)
        return verify(p_logits, None if q_logits is None else q_logits[n:], drafts[n:], sampling, gen)

    def one_round(seq: torch.Tensor) -> tuple[list[int], list[int]]:
        drafts, q_logits = drafter.draft(seq, gamma)
        k = drafts.numel()
        ext = torch.cat([seq, drafts])
        if k == 0 or routing.tau_escalate <= 0:  # nothing for the slim tier to do
            tokens = escalate(ext, drafts, q_logits, 0)
            return tokens, [FULL] * len(tokens)

        s_logits = slim.forward(ext, keep=k + 1)  # [k+1, V]: the k draft positions and the bonus position
        d = divergence(s_logits[:k], q_logits, drafts, routing.kl)
        tier = (d >= routing.tau_accept).long() + (d >= routing.tau_escalate).long()  # DIRECT / SLIM / FULL
        p_s = s_logits if sampling.greedy else probs_from_logits(s_logits, sampling)
        q = None if q_logits is None or sampling.greedy else probs_from_logits(q_logits, sampling)
        slim_ok = accept_mask(p_s[:k], q, drafts, sampling, gen)
        ok = (tier == DIRECT) | ((tier == SLIM) & slim_ok)
        n = ok.long().cumprod(0).sum()
        n, *tiers = torch.cat([n.view(1), tier]).tolist()  # one host sync decides the round
        accepted = drafts[:n].tolist()
        labels = [DIRECT if t == DIRECT else SLIM for t in tiers[:n]]

        if n < k and tiers[n] == FULL:
            tokens = escalate(ext, drafts, q_logits, n)
            return accepted + tokens, labels + [FULL] * len(tokens)
        # Slim verifier has the last word: its own token where it rejected draft n, or a bonus after all k.
        rejected = drafts[n] if n < k else None
        last = correction(p_s[n], None if q is None or n == k else q[n], rejected, sampling, gen)
        return accepted + [int(last)], labels + [SLIM]

    return run_rounds(one_round, input_ids, max_new_tokens, eos_ids, stats, [full, slim, drafter])

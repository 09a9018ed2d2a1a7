"""Three-tier VIA-SD decoding: draft → slim verifier (the target with sub-layers skipped) → full target.

The slim verifier is the target under a skip set, over the target's own KV cache: it reads the entries the full
target committed and writes only in the sub-layers it runs. One round, top to bottom:
1. the drafter proposes k ≤ γ tokens with distributions q;
2. the slim verifier scores all of them in one forward, giving p_slim at each position;
3. D_i = divergence(p_slim_i, q_i) routes each position: D < τ_accept → accepted directly;
   τ_accept ≤ D < τ_escalate → the slim verifier decides (accepts, or emits its own token and ends the
   round); D ≥ τ_escalate → the full target verifies from there on, losslessly;
4. if every draft token got through without the full target, the slim verifier adds a bonus token.
Tokens the first two tiers settled get their full-target KV in the target's next batched forward. With
``recheck`` that forward also verifies them, as plain SD verifies drafts: the first one the target would not
emit is replaced by the target's token and everything after it dropped, and before decoding ends a last full
pass checks whatever is still unverified. VIA-SD with recheck is lossless (greedy: the target's output token for
token; sampling: the target's distribution, since each settled token is re-checked against the distribution it
was drawn from, q for a direct accept and p_slim for a slim decision). Without it VIA-SD is lossy.
τ_escalate = 0 sends everything to the full target: plain SD, token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import DecodeConfig
from .common import (
    DIRECT,
    FULL,
    GREEDY,
    LM,
    SLIM,
    Result,
    Round,
    RoundHook,
    Sampling,
    Sequence,
    Stats,
    accept_mask,
    correction,
    divergence,
    draft_budget,
    probs_from_logits,
    run_rounds,
    verify_rows,
)
from .drafters import Drafter


class Proposals:
    """The distribution each not-yet-verified token was drawn from, by position (kept only when sampling with
    recheck: the re-check's acceptance test needs it)."""

    def __init__(self, vocab: int, active: bool):
        self.rows: dict[int, torch.Tensor] = {}
        self.vocab, self.active = vocab, active

    def record(self, start: int, rows: list[torch.Tensor | int]) -> None:
        """Rows for positions ``start, start+1, …``; an int stands for a one-hot proposal of that token."""
        if self.active:
            for i, r in enumerate(rows):
                self.rows[start + i] = r

    def stack(self, start: int, end: int, device) -> torch.Tensor:
        out = [torch.empty(0, self.vocab, device=device)]
        for pos in range(start, end):
            r = self.rows[pos]
            row = F.one_hot(torch.tensor(r, device=device), self.vocab).float() if isinstance(r, int) else r
            out.append(row.view(1, -1))
        return torch.cat(out)

    def forget(self, before: int, after: int) -> None:
        self.rows = {p: r for p, r in self.rows.items() if before <= p < after}


def generate(
    full: LM,
    drafter: Drafter,
    seq: Sequence,
    max_new_tokens: int,
    eos_ids: set[int],
    cfg: DecodeConfig,
    sampling: Sampling = GREEDY,
    gen: torch.Generator | None = None,
    on_round: RoundHook | None = None,
) -> Result:
    """``full``: the target over its cache, already prefilled with all but the prompt's last token."""
    stats: Stats = full.stats
    vocab = full.model.config.vocab_size
    proposals = Proposals(vocab, cfg.recheck and not sampling.greedy)

    def full_verify(seq: Sequence, drafts, q_logits, head: list[int], labels: list[int], settled: list) -> Round:
        """The full target from draft n = len(head) on (the round's first n drafts, ``head``, were settled as
        ``labels`` say). With recheck it also verifies every settled token since its last pass; otherwise it only
        catches up on their KV."""
        k, n, L, c = drafts.numel(), len(head), seq.length, full.committed
        ext = seq.with_drafts(drafts)
        q = None if q_logits is None or sampling.greedy else probs_from_logits(q_logits, sampling)
        if not cfg.recheck:
            p_logits = full.forward(ext, keep=k - n + 1)
            accepted, last = verify_rows(p_logits, None if q is None else q[n:], drafts[n:], sampling, gen)
            return Round(L, head + accepted + [last], labels + [FULL] * (len(accepted) + 1))
        # Everything after the last verified token (c + 1): earlier rounds' settled tokens, then all drafts.
        p_logits = full.forward(ext, keep=L + k - c)
        lag = L - 1 - c
        r = None
        if not sampling.greedy:
            escalated = [q[i] if q is not None else int(drafts[i]) for i in range(n, k)]
            proposals.record(L, settled + escalated)
            r = proposals.stack(c + 1, L + k, ext.device)
        accepted, last = verify_rows(p_logits, r, ext[c + 1 :], sampling, gen)
        m = len(accepted)
        stats.rechecked += lag + n
        if m < lag + n:
            stats.rollbacks += 1
        if m < lag:  # a settled token of an earlier round: drop it and everything after
            stats.rolled_back_tokens += lag - m
            return Round(c + 1 + m, [last], [FULL])
        tiers = (labels + [FULL] * k)[: m - lag]
        return Round(L, accepted[lag:] + [last], tiers + [FULL])

    def one_round(seq: Sequence) -> Round:
        proposals.forget(full.committed + 1, seq.length)
        drafts, q_logits = drafter.draft(seq, draft_budget(cfg.gamma, max_new_tokens, seq.length - seq.prompt_len))
        k, L = drafts.numel(), seq.length
        if k == 0 or cfg.tau_escalate <= 0:  # nothing for the slim tier to do
            return full_verify(seq, drafts, q_logits, [], [], [])

        s_logits = full.speculate(seq.with_drafts(drafts), cfg.skip, tier="slim", keep=k + 1)  # [k+1, V]
        d = divergence(s_logits[:k], q_logits, drafts, cfg.kl)
        tier = (d >= cfg.tau_accept).long() + (d >= cfg.tau_escalate).long()  # DIRECT / SLIM / FULL
        p_s = s_logits if sampling.greedy else probs_from_logits(s_logits, sampling)
        q = None if q_logits is None or sampling.greedy else probs_from_logits(q_logits, sampling)
        slim_ok = accept_mask(p_s[:k], q, drafts, sampling, gen)
        ok = (tier == DIRECT) | ((tier == SLIM) & slim_ok)
        n = ok.long().cumprod(0).sum()
        # One host read decides the round: the count, each position's tier, the drafts, the slim verifier's picks.
        n, *read = torch.cat([n.view(1), tier, drafts, s_logits.argmax(-1)]).tolist()
        tiers, proposed, slim_choice = read[:k], read[k : 2 * k], read[2 * k :]
        labels = [DIRECT if t == DIRECT else SLIM for t in tiers[:n]]
        # What each settled token was drawn from: q for a direct accept, p_slim for the slim tier's decision.
        settled = [] if not proposals.active else [
            (q[i] if q is not None else proposed[i]) if t == DIRECT else p_s[i] for i, t in enumerate(labels)
        ]

        if n < k and tiers[n] == FULL:
            return full_verify(seq, drafts, q_logits, proposed[:n], labels, settled)
        # Slim verifier has the last word: its own token where it rejected draft n, or a bonus after all k.
        if sampling.greedy:
            last = slim_choice[n]
        else:
            rejected = drafts[n] if n < k else None
            last = int(correction(p_s[n], None if q is None or n == k else q[n], rejected, sampling, gen))
            proposals.record(L, settled + [p_s[n]])
        return Round(L, proposed[:n] + [last], labels + [SLIM])

    def flush(seq: Sequence) -> Round | None:
        """Before decoding ends: verify what no full pass has (recheck only)."""
        c, L = full.committed, seq.length
        if not cfg.recheck or c >= L - 1:
            return None
        p_logits = full.forward(seq.ids, keep=L - c)
        r = proposals.stack(c + 1, L, seq.buf.device) if proposals.active else None
        lag = L - 1 - c
        accepted, last = verify_rows(p_logits, r, seq.ids[c + 1 :], sampling, gen)
        m = len(accepted)
        stats.rechecked += lag
        if m == lag:
            return None
        stats.rollbacks += 1
        stats.rolled_back_tokens += lag - m
        return Round(c + 1 + m, [last], [FULL])

    # Without recheck nothing is ever taken back: no flush, and every token is final as soon as it is emitted.
    last_check = flush if cfg.recheck else None
    return run_rounds(one_round, seq, max_new_tokens, eos_ids, full, drafter, last_check, on_round=on_round)

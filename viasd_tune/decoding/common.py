"""Pieces every decoding mode shares: a model with its own lagging KV cache, sampling rules, divergences,
per-tier statistics and the outer loop that stops cleanly on EOS and max-new-tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..routing import SkipAwareCache, SkipSet, skipping

# Tier labels for each emitted token.
DIRECT, SLIM, FULL = 0, 1, 2
TIERS = ("direct", "slim", "full")


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0``; otherwise temperature + nucleus sampling."""

    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = Sampling()


@dataclass
class Stats:
    """What one generate() call did, per tier. Token counts per tier sum to ``new_tokens``."""

    new_tokens: int = 0
    tokens_direct: int = 0
    tokens_slim: int = 0
    tokens_full: int = 0
    draft_calls: int = 0
    slim_calls: int = 0
    full_calls: int = 0
    draft_tokens_processed: int = 0
    slim_tokens_processed: int = 0
    full_tokens_processed: int = 0
    drafted: int = 0
    rounds: int = 0
    draft_time_s: float = 0.0
    slim_time_s: float = 0.0
    full_time_s: float = 0.0
    wall_time_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """New tokens per round (Spec-Bench's τ for plain SD, where every round ends with one full call)."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_full_call(self) -> float:
        """Tokens emitted per full-target forward: the acceptance figure the search maximises."""
        return self.new_tokens / self.full_calls if self.full_calls else float(self.new_tokens)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_accepted_length"] = self.mean_accepted_length
        d["tokens_per_full_call"] = self.tokens_per_full_call
        d["tokens_per_s"] = self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0
        return d


@dataclass
class Result:
    token_ids: list[int]
    stats: Stats
    tiers: list[int] = field(default_factory=list)
    text: str = ""


class CachedLM:
    """A causal LM (optionally with sub-layers skipped) and its own KV cache over a prefix of the sequence.

    ``seen`` counts the tokens already in the cache. :meth:`forward` feeds only the tokens after ``seen``, so a
    tier that sat out some rounds catches up in one batched forward. :meth:`rollback` drops rejected tokens.
    """

    def __init__(
        self, model: nn.Module, skip: SkipSet | None = None, tier: str = "full", stats: Stats | None = None
    ):
        self.model = model
        self.skip = skip
        self.tier = tier
        self.stats = stats if stats is not None else Stats()
        self.cache = SkipAwareCache(model.config, skip)
        self.seen = 0
        self._sync = model.device.type == "cuda"  # wall time per tier is only honest after a sync on GPU

    def forward(self, ids: torch.Tensor, keep: int | None = None) -> torch.Tensor:
        """Feed ``ids[seen:]`` (``ids``: 1-D, the whole sequence); return float logits ``[n_new or keep, V]``."""
        new = ids[self.seen :]
        assert new.numel() > 0, "nothing new to feed"
        start = time.perf_counter()
        pos = torch.arange(self.seen, ids.numel(), device=ids.device).unsqueeze(0)
        with skipping(self.model, self.skip):
            out = self.model(
                input_ids=new.unsqueeze(0),
                position_ids=pos,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=keep or 0,
            )
        self.seen = ids.numel()
        if self._sync:
            torch.cuda.synchronize()
        s = self.stats
        setattr(s, f"{self.tier}_calls", getattr(s, f"{self.tier}_calls") + 1)
        setattr(s, f"{self.tier}_tokens_processed", getattr(s, f"{self.tier}_tokens_processed") + new.numel())
        setattr(s, f"{self.tier}_time_s", getattr(s, f"{self.tier}_time_s") + time.perf_counter() - start)
        return out.logits[0].float()

    def rollback(self, length: int) -> None:
        """Keep the cache for the first ``length`` tokens only."""
        if length < self.seen:
            self.cache.crop(length - self.seen)
            self.seen = length


def probs_from_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature + top-p distribution over the vocabulary (rows of ``logits``)."""
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token once the mass before it already reaches top_p (the top token always survives).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def pick(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row: argmax when greedy, else a sample. Stays on device (no sync)."""
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.multinomial(probs_from_logits(logits, sampling), 1, generator=gen).squeeze(-1)


def residual_sample(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Sample from norm(max(p − q, 0)): the correction that makes rejection sampling exact."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    # p == q leaves nothing to correct with; then p itself is the right distribution.
    r = torch.where(total > 0, r / total.clamp_min(1e-30), p)
    return torch.multinomial(r, 1, generator=gen).squeeze(-1)


def accept_mask(
    p: torch.Tensor,
    q: torch.Tensor | None,
    tokens: torch.Tensor,
    sampling: Sampling,
    gen: torch.Generator | None,
) -> torch.Tensor:
    """Per draft position, whether the verifier with distribution rows ``p`` accepts ``tokens``.

    Greedy: the verifier's argmax equals the token. Sampling: accept with probability min(1, p(x)/q(x)), the
    standard speculative-sampling rule (``q=None`` means a one-hot draft, q(x)=1).
    """
    if sampling.greedy:
        return p.argmax(-1) == tokens
    p_x = p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    q_x = torch.ones_like(p_x) if q is None else q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    u = torch.rand(p_x.shape, device=p_x.device, generator=gen)
    return u * q_x < p_x  # u < p/q without dividing by a zero q


def correction(
    p_row: torch.Tensor, q_row: torch.Tensor | None, token: torch.Tensor | None, sampling: Sampling, gen
) -> torch.Tensor:
    """The verifier's own token at a rejected position (``token`` is the rejected draft) or a bonus position."""
    if sampling.greedy:
        return p_row.argmax(-1)
    if token is None:  # bonus: nothing was rejected here
        return torch.multinomial(p_row, 1, generator=gen).squeeze(-1)
    q_row = F.one_hot(token, p_row.numel()).to(p_row.dtype) if q_row is None else q_row
    return residual_sample(p_row, q_row, gen)


def divergence(
    slim_logits: torch.Tensor, draft_logits: torch.Tensor | None, tokens: torch.Tensor, kind: str
) -> torch.Tensor:
    """D_i between the slim verifier's and the drafter's next-token distributions (temperature 1), ≥ 0.

    forward = KL(p_slim ‖ q_draft), reverse = KL(q_draft ‖ p_slim), js = Jensen–Shannon. A one-hot drafter
    (prompt lookup, ``draft_logits=None``) gives −log p_slim(token) for every kind (its reverse KL; the forward KL
    of a one-hot q is infinite).
    """
    log_p = torch.log_softmax(slim_logits, dim=-1)
    if draft_logits is None:
        return (-log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)).clamp_min(0.0)
    log_q = torch.log_softmax(draft_logits, dim=-1)
    if kind == "forward":
        d = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    elif kind == "reverse":
        d = F.kl_div(log_p, log_q, log_target=True, reduction="none").sum(-1)
    elif kind == "js":
        log_m = torch.logaddexp(log_p, log_q) - torch.log(torch.tensor(2.0, device=log_p.device))
        d = 0.5 * (
            F.kl_div(log_m, log_p, log_target=True, reduction="none").sum(-1)
            + F.kl_div(log_m, log_q, log_target=True, reduction="none").sum(-1)
        )
    else:
        raise ValueError(f"unknown divergence {kind!r}")
    return d.clamp_min(0.0)


RoundFn = Callable[[torch.Tensor], tuple[list[int], list[int]]]


def run_rounds(
    round_fn: RoundFn,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_ids: set[int],
    stats: Stats,
    models: list[CachedLM],
) -> Result:
    """Call ``round_fn(seq) -> (tokens, tiers)`` until EOS or ``max_new_tokens``; truncate the last round there.

    After each round every model's cache is rolled back to the longest prefix that is still valid, i.e. the
    accepted sequence without its last token (which no model has seen yet).
    """
    start = time.perf_counter()
    seq = input_ids
    out: list[int] = []
    tiers: list[int] = []
    while len(out) < max_new_tokens:
        tokens, round_tiers = round_fn(seq)
        stats.rounds += 1
        room = max_new_tokens - len(out)
        tokens, round_tiers = tokens[:room], round_tiers[:room]
        stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        if stop is not None:
            tokens, round_tiers = tokens[: stop + 1], round_tiers[: stop + 1]
        out += tokens
        tiers += round_tiers
        seq = torch.cat([seq, torch.tensor(tokens, dtype=seq.dtype, device=seq.device)])
        for m in models:
            m.rollback(seq.numel() - 1)
        if stop is not None:
            break
    stats.new_tokens = len(out)
    for tier, name in enumerate(TIERS):
        setattr(stats, f"tokens_{name}", sum(1 for t in tiers if t == tier))
    stats.wall_time_s = time.perf_counter() - start
    return Result(out, stats, tiers)

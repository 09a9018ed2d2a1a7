"""Pieces every decoding mode shares: the token buffer, a model over its one shared KV cache, sampling rules,
divergences, per-tier statistics and the outer loop that stops cleanly on EOS and max-new-tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..routing import KVExtents, SharedKVCache, SkipSet, skipping
from . import tree as trees

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
    prefill_calls: int = 0
    draft_tokens_processed: int = 0
    slim_tokens_processed: int = 0
    full_tokens_processed: int = 0
    prefill_tokens_processed: int = 0
    drafted: int = 0
    rounds: int = 0
    rounds_lookup: int = 0  # rounds whose drafts came from prompt lookup (drafter lookup or a hybrid)
    rounds_model: int = 0  # rounds drafted by a model: the draft model or the self-draft
    rechecked: int = 0  # settled tokens a full pass re-checked (recheck on)
    rollbacks: int = 0  # re-checks that found a token the target would not emit
    rolled_back_tokens: int = 0  # emitted tokens those rollbacks removed
    tree_nodes_verified: int = 0  # tree rounds: draft nodes the target scored
    tree_depth_accepted: int = 0  # tree rounds: accepted nodes (the accepted path's depth), summed
    draft_time_s: float = 0.0
    slim_time_s: float = 0.0
    full_time_s: float = 0.0
    prefill_time_s: float = 0.0
    wall_time_s: float = 0.0
    routed_to: str | None = None  # routed profile: the name of the configuration its rule picked

    @property
    def mean_accepted_length(self) -> float:
        """New tokens per round (Spec-Bench's τ for plain SD, where every round ends with one full call)."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_full_call(self) -> float:
        """Tokens emitted per full-target forward: the acceptance figure the search maximises."""
        return self.new_tokens / self.full_calls if self.full_calls else float(self.new_tokens)

    @property
    def mean_accepted_depth(self) -> float:
        """Tree rounds: accepted draft nodes per round (the target's own token after them not counted)."""
        return self.tree_depth_accepted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        """Every count and time (all numbers), and ``routed_to`` when a routed profile served the request."""
        d = asdict(self)
        if d["routed_to"] is None:
            del d["routed_to"]
        d["mean_accepted_length"] = self.mean_accepted_length
        d["mean_accepted_depth"] = self.mean_accepted_depth
        d["tokens_per_full_call"] = self.tokens_per_full_call
        d["tokens_per_s"] = self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0
        return d

    def count(self, tier: str, tokens: int, seconds: float) -> None:
        setattr(self, f"{tier}_calls", getattr(self, f"{tier}_calls") + 1)
        setattr(self, f"{tier}_tokens_processed", getattr(self, f"{tier}_tokens_processed") + tokens)
        setattr(self, f"{tier}_time_s", getattr(self, f"{tier}_time_s") + seconds)


@dataclass
class Result:
    token_ids: list[int]
    stats: Stats
    tiers: list[int] = field(default_factory=list)
    text: str = ""


class Sequence:
    """Prompt and emitted tokens in one preallocated device buffer (as gpt-fast does), so a round writes its drafts
    in place instead of concatenating the whole sequence; ``tokens`` mirrors it on the host for prompt lookup and
    the result, so neither needs a device read."""

    def __init__(self, prompt: torch.Tensor, capacity: int):
        self.buf = torch.zeros(capacity, dtype=torch.long, device=prompt.device)
        self.buf[: prompt.numel()] = prompt
        self.tokens: list[int] = prompt.tolist()
        self.prompt_len = prompt.numel()
        self.tiers: list[int] = []  # one per emitted token

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def ids(self) -> torch.Tensor:
        return self.buf[: self.length]

    @property
    def emitted(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def with_drafts(self, drafts: torch.Tensor) -> torch.Tensor:
        """The sequence followed by ``drafts`` (written into the buffer after it; not committed)."""
        end = self.length + drafts.numel()
        self.buf[self.length : end] = drafts
        return self.buf[:end]

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        del self.tiers[max(0, length - self.prompt_len) :]

    def append(self, tokens: list[int], tiers: list[int]) -> None:
        if tokens:
            self.buf[self.length : self.length + len(tokens)] = torch.tensor(tokens, device="cpu")
            self.tokens += tokens
            self.tiers += tiers


class LM:
    """What the engine asks of a causal LM over its one KV cache, whose entry rules are :class:`KVExtents`'.

    :meth:`forward` is the full pass (under the cache's base skip set, empty for the target): it feeds every token
    after ``committed``, so a full target that sat out some rounds catches up in one batched forward.
    :meth:`speculate` runs the same model with sub-layers skipped over the same cache: it reads the committed
    entries and feeds only what its running layers have not seen. :meth:`rollback` drops rejected tokens.

    Two implementations: :class:`CachedLM` runs the model; the search's replay (``search/replay.py``) serves
    forwards recorded earlier and prices them with a cost model. Both count every pass in ``stats``.
    """

    def __init__(
        self, model: nn.Module, skip: SkipSet | None, tier: str, stats: Stats | None, cache: KVExtents
    ):
        self.model = model
        self.skip = skip or SkipSet()  # the full pass's own skip set (a draft model may run with one)
        self.tier = tier
        self.stats = stats if stats is not None else Stats()
        self.cache = cache

    @property
    def committed(self) -> int:
        """Tokens whose full-pass entries are cached."""
        return self.cache.committed

    seen = committed

    def forward(self, ids: torch.Tensor, keep: int | None = None, tier: str | None = None) -> torch.Tensor:
        """Full pass over ``ids[committed:]`` (``ids``: 1-D, the whole sequence); float logits ``[n_new or keep, V]``."""
        return self._pass(ids, None, tier or self.tier, keep)

    def speculate(self, ids: torch.Tensor, skip: SkipSet, tier: str, keep: int | None = None) -> torch.Tensor:
        """A pass under ``skip`` over the committed entries: feeds only what its running layers have not seen and
        writes speculative entries in those layers alone."""
        return self._pass(ids, self.skip | skip, tier, keep)

    def _pass(self, ids: torch.Tensor, skip: SkipSet | None, tier: str, keep: int | None) -> torch.Tensor:
        start = self.cache.begin(skip, ids.numel())
        logits, seconds = self._logits(ids, start, skip, keep)
        self.stats.count(tier, ids.numel() - start, seconds)
        return logits

    def _logits(
        self, ids: torch.Tensor, start: int, skip: SkipSet | None, keep: int | None
    ) -> tuple[torch.Tensor, float]:
        """The float logits of positions ``start …`` of ``ids`` (the last ``keep``, or all) of a pass under ``skip``
        (its whole skip set; None: the full pass) that feeds ``ids[start:]``, and the seconds it took."""
        raise NotImplementedError

    def forward_tree(
        self, ids: torch.Tensor, tree: trees.Tree, fed: int = 0, tier: str | None = None
    ) -> torch.Tensor:
        """One full pass that scores a token tree below the sequence ``ids`` (1-D, the whole sequence).

        With tokens pending (``ids[committed:]``, at least the last one, and ``fed == 0``): feeds them and every
        node; returns float logits ``[1 + n, V]``: row 0 after the sequence, row ``1 + i`` after node ``i``'s path.
        The pending tokens become committed; the nodes' entries stay beyond ``committed`` until
        :meth:`keep_path` or a rollback. With nothing pending (a drafter growing its tree level by level): nodes
        ``[0, fed)`` are already cached behind the committed sequence; feeds nodes ``fed…`` and returns their
        rows ``[n - fed, V]``.
        """
        base = self.committed
        start = self.cache.begin_tree(ids.numel(), tree.n, fed)
        logits, seconds = self._tree_logits(ids, tree, base, fed)
        self.stats.count(tier or self.tier, ids.numel() + tree.n - start, seconds)
        return logits

    def _tree_logits(
        self, ids: torch.Tensor, tree: trees.Tree, base: int, fed: int
    ) -> tuple[torch.Tensor, float]:
        """The float logits of a tree pass (see :meth:`forward_tree`) over a cache that held ``base`` committed
        tokens before it (and, with ``fed``, that many nodes behind them), and the seconds it took."""
        raise NotImplementedError

    def keep_path(self, cached: int, path: list[int]) -> None:
        """After :meth:`forward_tree`: of the ``cached`` tree nodes behind the committed entries, keep those on
        ``path`` (root to node, ascending) as the sequence's next entries and drop the others; they become
        committed. Gathering them into place is cheaper than rolling back and re-feeding the path
        (benchmarks/tree_compaction.py)."""
        self.cache.keep_path(cached, path)

    def discard(self, skip: SkipSet) -> None:
        """Drop what a pass under ``skip`` wrote beyond the committed entries."""
        self.cache.discard(self.skip | skip)

    def rollback(self, length: int, floor: int | None = None) -> None:
        """Keep the cache for the first ``length`` tokens only (later rollbacks stay at or above ``floor``)."""
        self.cache.rollback(length, floor)


class CachedLM(LM):
    """A causal LM run for real over its :class:`SharedKVCache`. ``clock`` times each pass (wall time; a test may
    pass ``time.thread_time``)."""

    def __init__(
        self,
        model: nn.Module,
        skip: SkipSet | None = None,
        tier: str = "full",
        stats: Stats | None = None,
        sync: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ):
        super().__init__(model, skip, tier, stats, SharedKVCache(model.config, skip))
        self.sync = sync  # per-tier wall time on CUDA is only honest after a synchronize; off unless asked
        self.clock = clock

    def _logits(
        self, ids: torch.Tensor, start: int, skip: SkipSet | None, keep: int | None
    ) -> tuple[torch.Tensor, float]:
        t0 = self.clock()
        pos = torch.arange(start, ids.numel(), device=ids.device).unsqueeze(0)
        with skipping(self.model, self.skip if skip is None else skip):
            out = self.model(
                input_ids=ids[start:].unsqueeze(0),
                position_ids=pos,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=keep or 0,
            )
        if self.sync:
            torch.cuda.synchronize()
        return out.logits[0].float(), self.clock() - t0

    def _tree_logits(
        self, ids: torch.Tensor, tree: trees.Tree, base: int, fed: int
    ) -> tuple[torch.Tensor, float]:
        t0 = self.clock()
        pending = ids.numel() - base
        new = torch.cat([ids[base:], torch.tensor(tree.tokens[fed:], dtype=ids.dtype, device=ids.device)])
        queries = pending + tree.n - fed
        config, dtype = self.model.config, self.model.dtype
        mask = trees.attention_mask(config, pending, tree, base, queries, dtype, ids.device)
        pos = trees.positions(pending, tree, base, fed, ids.device)
        with skipping(self.model, self.skip), trees.widened(self.cache, fed):
            out = self.model(
                input_ids=new.unsqueeze(0),
                position_ids=pos,
                attention_mask=mask,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=queries - pending + int(pending > 0),
            )
        if self.sync:
            torch.cuda.synchronize()
        return out.logits[0].float(), self.clock() - t0


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


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p − q, 0)): what is left of p once a proposal from q was rejected."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    # p == q leaves nothing to correct with; then p itself is the right distribution.
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def residual_sample(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """Sample from norm(max(p − q, 0)): the correction that makes rejection sampling exact."""
    return torch.multinomial(residual(p, q), 1, generator=gen).squeeze(-1)


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


def verify_rows(
    p_logits: torch.Tensor, r: torch.Tensor | None, tokens: torch.Tensor, sampling: Sampling, gen
) -> tuple[list[int], int]:
    """Target-verify ``tokens`` (m proposals) given the target's logits at the m+1 positions that predict them and
    the next token, and the distributions the proposals were drawn from (rows of ``r``; ``None``: greedy, or
    one-hot proposals). Returns (the accepted tokens, the target's token after them: correction or bonus).

    The standard speculative-sampling rule, exact for any proposal that depends only on the prefix; greedy: the
    target's argmax. Greedy costs one host read (the count, the next token and the proposals together).
    """
    m = tokens.numel()
    if sampling.greedy:
        choice = p_logits.argmax(-1)  # [m+1]
        n = (choice[:m] == tokens).cumprod(0).sum()
        n, last, *proposed = torch.cat([n.view(1), choice[n].view(1), tokens]).tolist()
        return proposed[:n], last
    p = probs_from_logits(p_logits, sampling)
    n = int(accept_mask(p[:m], r, tokens, sampling, gen).cumprod(0).sum())
    rejected = tokens[n] if n < m else None
    last = correction(p[n], None if r is None or n == m else r[n], rejected, sampling, gen)
    return tokens[:n].tolist(), int(last)


@dataclass
class Round:
    """What one round decided: keep the sequence's first ``keep`` tokens (fewer than it has when a re-check
    rolled back slim-settled tokens), then append ``tokens``, each decided by the tier in ``tiers``."""

    keep: int
    tokens: list[int]
    tiers: list[int]


RoundFn = Callable[[Sequence], Round]
RoundHook = Callable[[Sequence, int], bool]  # (sequence, emitted tokens that are final) -> stop now


def draft_budget(gamma: int, max_new_tokens: int, produced: int) -> int:
    """γ for one round: drafts past ``max_new_tokens`` would be cut after costing their forwards, so draft at most
    what the round can still emit besides its correction or bonus token (at least 1). HF's assisted generation caps
    its drafts the same way; without it a γ-20 draft ran 48 draft forwards where HF ran 22 (24 new tokens)."""
    return max(1, min(gamma, max_new_tokens - produced - 1))


def run_rounds(
    round_fn: RoundFn,
    seq: Sequence,
    max_new_tokens: int,
    eos_ids: set[int],
    full: LM,
    drafter=None,
    flush: Callable[[Sequence], Round | None] | None = None,
    on_round: RoundHook | None = None,
) -> Result:
    """Call ``round_fn(seq)`` until EOS or ``max_new_tokens``, cutting the last round there. Then, if ``flush`` is
    given (VIA-SD with recheck), let it re-check what no full pass has verified yet; a rollback resumes decoding.

    After each round every model's cache is rolled back to the longest prefix that is still valid, i.e. the
    sequence without its last token (which no model has seen yet); no later rollback goes below what the full
    target has committed.

    ``on_round(seq, final)`` (streaming) sees the sequence after each round and how many emitted tokens are final:
    all of them, except with a ``flush``, where only the full target's committed tokens and its own next one are
    (a re-check may still replace the slim-settled ones after them). It returns True to stop decoding there (a
    stop string, a client gone); the result then holds the final tokens only.
    """
    stats = full.stats

    def final() -> int:
        last = seq.length if flush is None else min(seq.length, full.committed + 1)
        return max(0, last - seq.prompt_len)

    def halted() -> bool:
        if on_round is None or not on_round(seq, final()):
            return False
        seq.truncate(seq.prompt_len + final())
        return True

    def done() -> bool:
        n = seq.length - seq.prompt_len
        return n >= max_new_tokens or (n > 0 and seq.tokens[-1] in eos_ids)

    def apply(r: Round) -> None:
        seq.truncate(r.keep)
        tokens, tiers = r.tokens[: max_new_tokens - (seq.length - seq.prompt_len)], r.tiers
        stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        if stop is not None:
            tokens = tokens[: stop + 1]
        seq.append(tokens, tiers[: len(tokens)])
        full.rollback(seq.length - 1)
        if drafter is not None:
            drafter.rollback(seq.length - 1, floor=full.committed)

    stop = False
    while not stop:
        while not (stop or done()):
            apply(round_fn(seq))
            stats.rounds += 1
            stop = halted()
        r = flush(seq) if flush is not None and not stop else None
        if r is None:
            break
        apply(r)
        stats.rounds += 1
        stop = halted()
    out = seq.emitted
    stats.new_tokens = len(out)
    for tier, name in enumerate(TIERS):
        setattr(stats, f"tokens_{name}", seq.tiers.count(tier))
    return Result(out, stats, list(seq.tiers))

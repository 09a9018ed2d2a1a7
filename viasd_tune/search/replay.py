"""Cheap trial scoring: replay the engine's rounds along the target's own greedy continuation.

For each calibration prompt the target's greedy output is decoded once (:class:`Reference`). The replay then
runs the round logic of ``decoding/viasd.py`` (and ``sd.py``) for a trial's configuration without running the
full target: while the sequence follows that reference, the full target's verdict is the reference token, and
the drafter's and the slim verifier's choices come from teacher-forced arrays, one batched forward each:

- the slim verifier runs over the target's own cache, so its output at a position depends on how much of the
  prefix the full target had committed (its KV) when the round ran: the arrays are per committed length ``c``
  (the target's KV of the reference up to ``c``, then one skip pass over the rest), computed when a round first
  needs that ``c`` and shared by every trial with the same skip set; the self-draft likewise;
- a separate draft model keeps its own cache, so one forward (under its own skip set) serves every round.

Where the arrays cannot answer, the replay computes that round for real with the engine's own drafter and slim
pass (memoized): a draft that left the reference and which the round still needs (the slim tier accepted it, or
``draft_confidence`` must see whether drafting goes on after it), and every round that starts off the reference,
which happens with ``recheck`` after the slim tier settled a token the target would not emit, until the next
full forward rolls it back. So the replay gives the engine's tokens, tier labels and per-round forwards (tier,
tokens fed) exactly, up to float rounding of batched against incremental forwards, in every lossless run (plain
SD, ``recheck``, or a slim tier that never settles a wrong token). Without ``recheck`` a wrongly settled token
would change all that follows; the replay counts it as a disagreement and continues from the reference token
(``Estimate.exact`` is then False), which is why the search confirms promising trials with real decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..config import DecodeConfig, model_drafter
from ..decoding.common import DIRECT, FULL, GREEDY, SLIM, CachedLM, Sequence, Stats, divergence, draft_budget
from ..decoding.drafters import ModelDrafter, prompt_lookup
from ..routing import SkipSet, num_layers

KL = ("forward", "reverse", "js")
DRAFT_MEMO = 4  # drafter logits and draft-model KV snapshots kept per kind (see ReplayCache._draft_logits)


@dataclass
class Reference:
    """One calibration prompt and the target's greedy continuation of it."""

    prompt_id: str
    prompt_ids: torch.Tensor  # 1-D, on the model's device
    output: list[int]
    ar_time_s: float

    @property
    def full(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, torch.tensor(self.output, device=self.prompt_ids.device)])


class _Snapshot:
    """A model's full-pass KV over one token sequence, from which a cache committed to any prefix is made
    without a forward (plain layers: a slice; sliding-window layers: recomputed, as their cache trims)."""

    def __init__(self, model: nn.Module, base: SkipSet, ids: torch.Tensor):
        self.model, self.base, self.ids = model, base, ids
        lm = CachedLM(model, base)
        lm.forward(ids)
        self.sliding = any(getattr(lay, "is_sliding", False) for lay in lm.cache.layers)
        self.kv = [(lay.keys, lay.values) if lay.is_initialized else None for lay in lm.cache.layers]

    def at(self, c: int, stats: Stats | None = None) -> CachedLM:
        """A fresh :class:`CachedLM` whose cache holds the full-pass entries of ``ids[:c]``."""
        lm = CachedLM(self.model, self.base, stats=stats if stats is not None else Stats())
        if c <= 0:
            return lm
        if self.sliding:
            lm.forward(self.ids[:c])
        else:
            for lay, kv in zip(lm.cache.layers, self.kv, strict=True):
                if kv is not None:
                    lay.update(kv[0][..., :c, :], kv[1][..., :c, :])
            lm.cache.committed = c
        return lm


@dataclass
class _Arrays:
    """Teacher-forced choices along the reference, indexed by the position they predict."""

    pick: np.ndarray  # argmax
    prob: np.ndarray  # its probability (drafters: what draft_confidence compares)
    div: dict[str, np.ndarray] | None = None  # slim: D to the drafter per KL kind (model drafters)
    lookup_div: dict[tuple[int, int], float] | None = None  # slim vs prompt lookup: (position, token) -> D
    start: int = 0  # the first predicted position held


class _Missing(Exception):
    """The teacher-forced arrays do not hold what this round needs: compute it for real."""


@dataclass
class _RoundData:
    """What one round's decisions read: the k drafts, and per draft position the slim verifier's choice and D
    (``s``/``d`` hold k + 1 / k entries; fewer where unknown, which a fast round reports as :class:`_Missing`)."""

    drafts: list[int]
    s: list[int]
    d: list[float]
    k: int
    lookup: bool = False  # drafted by prompt lookup (plain, or a hybrid's lookup hit): no draft forward

    def draft(self, t: int) -> int:
        if t >= len(self.drafts):
            raise _Missing
        return self.drafts[t]

    def slim(self, t: int) -> tuple[int, float | None]:
        if t >= len(self.s) or (t < self.k and t >= len(self.d)):
            raise _Missing
        return self.s[t], (self.d[t] if t < self.k else None)


class _Prompt:
    """One reference, extended by the target's next ``cache.tail`` greedy tokens (a last round drafts past the
    output and the engine verifies those drafts too), and the per-prompt snapshots."""

    def __init__(self, cache: ReplayCache, ref: Reference):
        self.ref, self.cache = ref, cache
        self.P, self.n = ref.prompt_ids.numel(), len(ref.output)
        target = cache.target
        lm = CachedLM(target)
        ext = ref.full.tolist()
        with torch.inference_mode():
            logits = lm.forward(ref.full, keep=1)
            for _ in range(cache.tail):
                ext.append(int(logits[-1].argmax()))
                logits = lm.forward(torch.tensor(ext, device=ref.prompt_ids.device), keep=1)
        self.ext = ext
        self.ids = torch.tensor(ext, device=ref.prompt_ids.device)
        self.target = _Snapshot(target, SkipSet(), self.ids)
        self.drafts: dict[SkipSet, _Snapshot] = {}
        self.lookups: dict[int, list[int]] = {}

    def lookup(self, L: int, gamma: int) -> list[int]:
        if L not in self.lookups:
            found = prompt_lookup(torch.tensor(self.ext[:L]), self.cache.tail, prompt_len=self.P)
            self.lookups[L] = found.tolist()
        return self.lookups[L][:gamma]

    def draft_snapshot(self, skip: SkipSet) -> _Snapshot:
        if skip not in self.drafts:
            if len(self.drafts) >= DRAFT_MEMO:  # a KV snapshot per draft skip set: keep the latest few
                self.drafts.pop(next(iter(self.drafts)))
            self.drafts[skip] = _Snapshot(self.cache.draft, skip, self.ids)
        return self.drafts[skip]


def _rows(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    probs = torch.softmax(logits, -1)
    pick = logits.argmax(-1)
    return pick.cpu().numpy(), probs.gather(-1, pick.unsqueeze(-1)).squeeze(-1).cpu().numpy()


class ReplayCache:
    """Per prompt: the extended reference, the target's (and draft model's) KV snapshots and the teacher-forced
    arrays per (skip set, committed length), computed when first needed and reused by every trial."""

    def __init__(
        self,
        target: nn.Module,
        refs: list[Reference],
        draft: nn.Module | None = None,
        max_new_tokens: int | None = None,
        eos: set[int] | None = None,
        gamma_max: int = 15,
    ):
        """``max_new_tokens`` and ``eos``: what the references were decoded with (defaults: the longest output;
        the last token of every shorter one); ``gamma_max``: the largest γ to replay."""
        self.target, self.refs, self.draft = target, refs, draft
        self.num_layers = num_layers(target)
        self.max_new_tokens = max_new_tokens or max((len(r.output) for r in refs), default=1)
        self.eos = (
            set(eos)
            if eos is not None
            else {r.output[-1] for r in refs if r.output and len(r.output) < self.max_new_tokens}
        )
        self._draft_memo: dict[tuple, torch.Tensor] = {}
        self.tail = gamma_max + 1
        self._prompts: dict[int, _Prompt] = {}
        self._arrays: dict[tuple, _Arrays] = {}
        self._real: dict[tuple, _RoundData] = {}

    def prompt(self, i: int) -> _Prompt:
        if i not in self._prompts:
            self._prompts[i] = _Prompt(self, self.refs[i])
        return self._prompts[i]

    # ------------------------------------------------------------------ teacher-forced arrays

    @torch.inference_mode()
    def _draft_logits(self, i: int, drafter: str, draft_skip: SkipSet, c: int) -> torch.Tensor:
        """Drafter logits along the extended reference: a separate draft model's predict positions 1 …, the
        self-draft's (over the target's cache committed to ``c``) c + 1 …. The last few are kept: the draft and
        the slim arrays of one watermark read the same."""
        key = (i, drafter, draft_skip, 0 if drafter == "model" else c)
        if key not in self._draft_memo:
            p = self.prompt(i)
            if drafter == "model":
                logits = CachedLM(self.draft, draft_skip).forward(p.ids)
            else:
                logits = p.target.at(c).speculate(p.ids, draft_skip, tier="draft")
            # Full-vocabulary logits over the whole sequence (a Qwen prompt: ~200 MB each), so only the latest few
            # of each drafter kind stay: a trial reads one prompt's at a time, and a draft forward to redo one is
            # cheap. Unbounded, the draft skip sets a search tries filled 24 GB in 45 Qwen trials.
            same_kind = [k for k in self._draft_memo if k[1] == drafter]
            if len(same_kind) >= DRAFT_MEMO:
                self._draft_memo.pop(same_kind[0])
            self._draft_memo[key] = logits
        return self._draft_memo[key]

    def draft_arrays(self, i: int, drafter: str, draft_skip: SkipSet, c: int) -> _Arrays:
        c = 0 if drafter == "model" else c  # a separate draft model's cache is its own: no watermark
        key = ("draft", i, drafter, draft_skip, c)
        if key not in self._arrays:
            pick, prob = _rows(self._draft_logits(i, drafter, draft_skip, c))
            self._arrays[key] = _Arrays(pick, prob, start=c + 1)
        return self._arrays[key]

    @torch.inference_mode()
    def slim_arrays(self, i: int, skip: SkipSet, drafter: str, draft_skip: SkipSet, c: int) -> _Arrays:
        """The slim verifier over the target's cache committed to ``c``: its choice and D to the drafter."""
        source = model_drafter(drafter)
        key = ("slim", i, skip, drafter, draft_skip if source is not None else None, c)
        if key in self._arrays:
            return self._arrays[key]
        p = self.prompt(i)
        s_logits = p.target.at(c).speculate(p.ids, skip, tier="slim")  # predicts positions c + 1 …
        pick, prob = _rows(s_logits)
        arrays = _Arrays(pick, prob, start=c + 1)
        if source != drafter:  # prompt lookup drafts (some) rounds: plain lookup or a hybrid
            log_p = torch.log_softmax(s_logits, -1)
            table = {}
            for L in range(max(c + 1, p.P), len(p.ext)):
                for t, tok in enumerate(p.lookup(L, self.tail)):
                    pos = L + t
                    if pos < len(p.ext):
                        table[pos, tok] = max(-float(log_p[pos - c - 1, tok]), 0.0)
            arrays.lookup_div = table
        if source is not None:
            q = self._draft_logits(i, source, draft_skip, c)
            q = q[c:] if source == "model" else q  # align: both predict c + 1 …
            tokens = q.argmax(-1)
            arrays.div = {kind: divergence(s_logits, q, tokens, kind).cpu().numpy() for kind in KL}
        self._arrays[key] = arrays
        return arrays

    # ------------------------------------------------------------------ a round computed for real

    @torch.inference_mode()
    def real_round(
        self, i: int, tokens: list[int], c: int, cfg: DecodeConfig, slim: bool, gamma: int
    ) -> _RoundData:
        """The round's drafts (the engine's drafter, up to ``gamma``: the round's draft budget) and, with ``slim``,
        the slim pass over the target's cache committed to ``c`` (the tokens before ``c`` are the reference's:
        the full target verified them)."""
        key = (
            i,
            tuple(tokens),
            c,
            cfg.drafter,
            cfg.draft_skip,
            gamma,
            cfg.draft_confidence,
            slim,
            cfg.skip,
            cfg.kl,  # the divergences depend on it
        )
        if key in self._real:
            return self._real[key]
        p = self.prompt(i)
        dev = p.ids.device
        seq = Sequence(torch.tensor(tokens, device=dev), len(tokens) + gamma + 1)
        target = p.target.at(c)
        source = model_drafter(cfg.drafter)
        proposal = None
        if source != cfg.drafter:
            proposal = prompt_lookup(torch.tensor(tokens), gamma, prompt_len=p.P).to(dev)
        lookup = source is None or (proposal is not None and proposal.numel() >= min(cfg.lookup_min, gamma))
        if lookup:
            drafts, q = proposal, None
        else:
            if source == "self":
                lm, skip = target, cfg.draft_skip
            else:
                same = next(
                    (j for j, (a, b) in enumerate(zip(tokens, p.ext, strict=False)) if a != b), len(tokens)
                )
                lm, skip = p.draft_snapshot(cfg.draft_skip).at(min(same, len(tokens) - 1)), None
            drafter = ModelDrafter(lm, GREEDY, None, Stats(), skip=skip, confidence=cfg.draft_confidence)
            drafts, q = drafter.draft(seq, gamma)
            drafts = drafts.clone()
        k = drafts.numel()
        out = _RoundData(drafts.tolist(), [], [], k, lookup)
        if slim and k:
            s_logits = target.speculate(seq.with_drafts(drafts), cfg.skip, tier="slim", keep=k + 1)
            out.s = s_logits.argmax(-1).tolist()
            out.d = divergence(s_logits[:k], q, drafts, cfg.kl).tolist()
        self._real[key] = out
        return out

    @torch.inference_mode()
    def target_choices(self, i: int, tokens: list[int], c: int) -> list[int]:
        """The full target's greedy choice after each prefix of ``tokens`` longer than ``c`` (index: the position
        it predicts, minus ``c + 1``), over its cache committed to ``c``."""
        p = self.prompt(i)
        lm = p.target.at(c)
        return lm.forward(torch.tensor(tokens, device=p.ids.device)).argmax(-1).tolist()


@dataclass
class Estimate:
    """Replayed outcome of one configuration over all calibration prompts."""

    tokens: int = 0
    agree: int = 0  # emitted tokens the target would have emitted there
    tiers: list[int] = field(default_factory=lambda: [0, 0, 0])  # tokens decided directly / by slim / by full
    rounds: int = 0
    # (tier, tokens fed) of every forward in order, tier one of draft / slim / full / prefill: for the cost model
    calls: list[tuple[str, int]] = field(default_factory=list)
    slim_cost: float = 1.0  # a slim forward in full-target forwards: the share of sub-layers it runs
    rechecked: int = 0
    rollbacks: int = 0
    rolled_back_tokens: int = 0
    drafted: int = 0
    rounds_lookup: int = 0  # rounds drafted by prompt lookup (drafter lookup, or a hybrid's lookup hits)
    exact: bool = True  # False once a settled token left the reference without recheck (see the module doc)
    outputs: list[list[int]] = field(default_factory=list)  # per prompt: the emitted tokens
    tier_labels: list[list[int]] = field(default_factory=list)  # per prompt: each emitted token's tier

    @property
    def fidelity(self) -> float:
        return self.agree / self.tokens if self.tokens else 1.0

    @property
    def acceptance(self) -> float:
        full = sum(1 for t, _ in self.calls if t == "full")
        slim = sum(1 for t, _ in self.calls if t == "slim")
        return acceptance(self.tokens, full, slim, self.slim_cost)


def acceptance(tokens: int, full_calls: int, slim_calls: int, slim_cost: float) -> float:
    """Tokens emitted per full-target-equivalent verification forward, a slim forward counting as the share
    of sub-layers it runs. Counting full calls alone made a slim verifier that skips nothing (a full forward
    under another name) look 2.6x better accepted than plain SD on the Qwen pair while running 0.68x AR."""
    cost = full_calls + slim_calls * slim_cost
    return tokens / cost if cost else float(tokens)


class _Run:
    """One prompt under one configuration: the engine's round loop (``run_rounds``), its caches reduced to
    their lengths (what each forward feeds), its models replaced by the reference and the arrays."""

    def __init__(self, cache: ReplayCache, i: int, cfg: DecodeConfig, est: Estimate):
        self.cache, self.i, self.cfg, self.est = cache, i, cfg, est
        self.p = cache.prompt(i)
        self.tokens = list(self.p.ext[: self.p.P])
        self.labels: list[int] = []
        self.c = 0  # the target's committed length
        self.lengths = np.zeros(cache.num_layers, dtype=np.int64)  # the target's cache, per attention layer
        self.draft_committed = 0  # a separate draft model's cache

    # ------------------------------------------------------------ the caches, as lengths
    def _running(self, skip: SkipSet | None) -> np.ndarray:
        mask = np.ones(len(self.lengths), dtype=bool)
        if skip is not None:
            mask[list(skip.attn)] = False
        return mask

    def full_forward(self, end: int, tier: str = "full") -> None:
        self.est.calls.append((tier, end - self.c))
        self.lengths[:] = end
        self.c = end

    def speculate(self, end: int, skip: SkipSet, tier: str) -> None:
        run = self._running(skip)
        start = int(self.lengths[run].min()) if run.any() else self.c
        self.est.calls.append((tier, end - start))
        self.lengths[run] = end

    def discard(self, skip: SkipSet) -> None:
        run = self._running(skip)
        self.lengths[run] = np.minimum(self.lengths[run], self.c)

    def rollback(self, length: int) -> None:
        np.minimum(self.lengths, length, out=self.lengths)
        self.c = min(self.c, length)
        self.draft_committed = min(self.draft_committed, length)

    # ------------------------------------------------------------ what the models would say
    def gamma(self) -> int:
        """The round's draft budget, as the engine computes it (``common.draft_budget``)."""
        return draft_budget(self.cfg.gamma, self.cache.max_new_tokens, len(self.tokens) - self.p.P)

    def on_reference(self, tokens: list[int]) -> bool:
        return tokens == self.p.ext[: len(tokens)]

    def fast(self) -> _RoundData:
        """The round from the arrays (the sequence follows the reference), as far as they reach."""
        cfg, L, c = self.cfg, len(self.tokens), self.c
        ext, gamma = self.p.ext, self.gamma()
        source = model_drafter(cfg.drafter)
        proposal = self.p.lookup(L, gamma) if source != cfg.drafter else []
        lookup = source is None or len(proposal) >= min(cfg.lookup_min, gamma)
        if lookup:
            drafts = proposal
            k = len(drafts)
        else:
            arr = self.cache.draft_arrays(self.i, source, cfg.draft_skip, c)
            drafts, k = [], None
            for t in range(gamma):
                pos = L + t
                if pos >= len(ext):
                    raise _Missing
                tok, prob = int(arr.pick[pos - arr.start]), float(arr.prob[pos - arr.start])
                drafts.append(tok)
                if cfg.draft_confidence > 0 and prob < cfg.draft_confidence:
                    k = t + 1
                    break
                if tok != ext[pos]:  # later picks follow an off-reference token: not in the arrays
                    break
            if k is None:
                k = len(drafts) if len(drafts) == gamma else gamma if cfg.draft_confidence <= 0 else None
            if k is None:
                raise _Missing  # whether drafting went on after the off-reference pick depends on later picks
        data = _RoundData(drafts, [], [], k, lookup)
        if k and cfg.tau_escalate > 0:
            arr = self.cache.slim_arrays(self.i, cfg.skip, cfg.drafter, cfg.draft_skip, c)
            for t in range(k + 1):  # positions whose prefix is the reference's
                pos = L + t
                if pos >= len(ext) or pos - arr.start >= len(arr.pick):
                    break
                data.s.append(int(arr.pick[pos - arr.start]))
                if t < k:
                    if lookup:
                        data.d.append(arr.lookup_div.get((pos, drafts[t]), float("inf")))
                    else:
                        data.d.append(float(arr.div[cfg.kl][pos - arr.start]))
                if t < len(drafts) and drafts[t] != ext[pos]:
                    break
        return data

    def decide(self, data: _RoundData) -> tuple[list[int], list[int], bool, int | None]:
        """The slim tier's routing (``viasd.one_round``): (head tokens, their labels, escalate?, slim's last)."""
        cfg = self.cfg
        if data.k == 0 or cfg.tau_escalate <= 0:
            return [], [], True, None
        head, labels = [], []
        for t in range(data.k):
            s, d = data.slim(t)
            tier = (d >= cfg.tau_accept) + (d >= cfg.tau_escalate)
            tok = data.draft(t)
            if tier == FULL:
                return head, labels, True, None
            if tier == SLIM and s != tok:
                return head, labels, False, s
            head.append(tok)
            labels.append(DIRECT if tier == DIRECT else SLIM)
        return head, labels, False, data.slim(data.k)[0]

    def verified(self, tokens: list[int], start: int, c: int) -> tuple[int, int]:
        """How many of ``tokens[start:]`` the full target accepts over ``tokens[:start]``, and its next token;
        ``c``: the target's committed length before the verifying forward (whose cache that forward extended)."""
        ext, m = self.p.ext, 0
        if not self.on_reference(tokens[:start]):  # only without recheck: a settled head left the reference
            choice = self.cache.target_choices(self.i, tokens, c)[start - c - 1 :]
            while start + m < len(tokens) and tokens[start + m] == choice[m]:
                m += 1
            return m, choice[m]
        while start + m < len(tokens) and start + m < len(ext) and tokens[start + m] == ext[start + m]:
            m += 1
        if start + m >= len(ext):
            raise RuntimeError("the replay ran past its reference tail; give ReplayCache a larger gamma_max")
        return m, ext[start + m]

    # ------------------------------------------------------------ the engine's round
    def one_round(self) -> tuple[int, list[int], list[int]]:
        cfg, L = self.cfg, len(self.tokens)
        slim_tier = cfg.mode == "viasd" and cfg.tau_escalate > 0
        try:
            if not self.on_reference(self.tokens):
                raise _Missing
            data = self.fast()
            head, labels, escalate, last = self.decide(data) if cfg.mode == "viasd" else ([], [], True, None)
            if escalate:
                drafts = data.drafts  # verify reads them up to the first the target rejects
                if len(drafts) < data.k and (not drafts or drafts[-1] == self.p.ext[L + len(drafts) - 1]):
                    raise _Missing
        except _Missing:
            data = self.cache.real_round(self.i, self.tokens, self.c, cfg, slim_tier, self.gamma())
            head, labels, escalate, last = self.decide(data) if cfg.mode == "viasd" else ([], [], True, None)
        k = data.k
        self.count_drafting(L, k, data.lookup)
        if slim_tier and k:
            self.speculate(L + k, cfg.skip, "slim")
        if not escalate:
            return L, head + [last], labels + [SLIM]
        return self.full_verify(data, head, labels)

    def count_drafting(self, L: int, k: int, lookup: bool) -> None:
        cfg = self.cfg
        self.est.drafted += k
        if lookup:
            self.est.rounds_lookup += 1
            return
        if model_drafter(cfg.drafter) == "self":
            self.discard(cfg.draft_skip)
            for t in range(k):
                self.speculate(L + t, cfg.draft_skip, "draft")
            self.discard(cfg.draft_skip)
            return
        for t in range(k):
            self.est.calls.append(("draft", L + t - self.draft_committed))
            self.draft_committed = L + t

    def full_verify(
        self, data: _RoundData, head: list[int], labels: list[int]
    ) -> tuple[int, list[int], list[int]]:
        cfg, L, c, k, n = self.cfg, len(self.tokens), self.c, data.k, len(head)
        known = data.drafts[:k]
        ext_tokens = self.tokens + known  # drafts past the first rejected one are never read
        if not cfg.recheck or cfg.mode == "sd":
            self.full_forward(L + k)
            m, last = self.verified(ext_tokens, L + n, c)
            return L, head + known[n : n + m] + [last], labels + [FULL] * (m + 1)
        self.full_forward(L + k)
        lag = L - 1 - c
        m, last = self.verified(ext_tokens, c + 1, c)
        self.est.rechecked += lag + n
        if m < lag + n:
            self.est.rollbacks += 1
        if m < lag:
            self.est.rolled_back_tokens += lag - m
            return c + 1 + m, [last], [FULL]
        tiers = (labels + [FULL] * k)[: m - lag]
        return L, ext_tokens[L : c + 1 + m] + [last], tiers + [FULL]

    def flush(self) -> tuple[int, list[int], list[int]] | None:
        c, L = self.c, len(self.tokens)
        if not (self.cfg.mode == "viasd" and self.cfg.recheck) or c >= L - 1:
            return None
        self.full_forward(L)
        lag = L - 1 - c
        m, last = self.verified(self.tokens, c + 1, c)
        self.est.rechecked += lag
        if m == lag:
            return None
        self.est.rollbacks += 1
        self.est.rolled_back_tokens += lag - m
        return c + 1 + m, [last], [FULL]

    # ------------------------------------------------------------ run_rounds
    def done(self) -> bool:
        n = len(self.tokens) - self.p.P
        return n >= self.cache.max_new_tokens or (n > 0 and self.tokens[-1] in self.cache.eos)

    def apply(self, keep: int, tokens: list[int], tiers: list[int]) -> None:
        P, cap = self.p.P, self.cache.max_new_tokens
        del self.tokens[keep:]
        del self.labels[max(0, keep - P) :]
        tokens = tokens[: cap - (len(self.tokens) - P)]
        stop = next((j for j, t in enumerate(tokens) if t in self.cache.eos), None)
        if stop is not None:
            tokens = tokens[: stop + 1]
        if not (self.cfg.recheck and self.cfg.mode == "viasd"):
            # Lossy without recheck: count the disagreement, stay on the reference (see the module doc).
            start = len(self.tokens)
            self.est.agree += sum(t == self.p.ext[start + j] for j, t in enumerate(tokens))
            if tokens != self.p.ext[start : start + len(tokens)]:
                self.est.exact = False
                tokens = self.p.ext[start : start + len(tokens)]
                if any(t in self.cache.eos for t in tokens[:-1]):
                    tokens = tokens[: next(j for j, t in enumerate(tokens) if t in self.cache.eos) + 1]
        self.tokens += tokens
        self.labels += tiers[: len(tokens)]
        self.rollback(len(self.tokens) - 1)

    def run(self) -> None:
        cfg, P = self.cfg, self.p.P
        if (cfg.mode == "viasd" or model_drafter(cfg.drafter) == "self") and P > 1:
            self.full_forward(P - 1, tier="prefill")
        while True:
            while not self.done():
                self.apply(*self.one_round())
                self.est.rounds += 1
            r = self.flush()
            if r is None:
                break
            self.apply(*r)
            self.est.rounds += 1
        out = self.tokens[P:]
        if self.cfg.recheck and self.cfg.mode == "viasd":
            self.est.agree += sum(t == self.p.ext[P + j] for j, t in enumerate(out))
        self.est.tokens += len(out)
        for tier in self.labels:
            self.est.tiers[tier] += 1
        self.est.outputs.append(out)
        self.est.tier_labels.append(list(self.labels))


def simulate(cache: ReplayCache, cfg: DecodeConfig) -> Estimate:
    """Replay a configuration (``sd`` or ``viasd``, greedy) on every calibration prompt."""
    if cfg.mode == "ar":
        raise ValueError("the replay prices speculative configurations; AR is the reference itself")
    if cfg.gamma >= cache.tail:
        raise ValueError(
            f"the replay was built for gamma up to {cache.tail - 1} (ReplayCache's gamma_max); got {cfg.gamma}"
        )
    est = Estimate(slim_cost=1.0 - cfg.skip.fraction(cache.num_layers) if cfg.mode == "viasd" else 1.0)
    with torch.inference_mode():
        for i in range(len(cache.refs)):
            _Run(cache, i, cfg, est).run()
    return est

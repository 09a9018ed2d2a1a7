"""Cheap trial scoring: the decoding engine itself, its model forwards served from recorded ones.

For each calibration prompt the target's greedy output is decoded once (:class:`Reference`). A trial then runs
the real decoder (:class:`Decoder`: ``run_rounds``, the per-mode rounds, the real drafters) on every prompt
with each model behind a :class:`RecordedLM` instead of a :class:`CachedLM`. Its passes follow the engine's cache
rules (:class:`KVExtents`: where a pass starts feeding, what it commits), but their logits come from a memo of
teacher-forced rows, and a clock priced by the cost model (by model, skip set and block size) stands for wall
time. So the replay holds no decoding rule of its own: whatever the engine does, it replays.

A row is keyed by what it depends on (:class:`Stream`, and the token prefix it follows):
- the model and its base skip set (a separate draft model may run with one);
- the pass's whole skip set, and, for a pass that skips more than the base, the committed watermark of the
  cache it reads: it attends to full-pass entries below the watermark and to its own above (a full pass
  attends to full-pass entries only, so its rows depend on the prefix alone);
- the token prefix: row ``p`` holds the logits after ``tokens[: p + 1]``. A tree of candidates verified in
  one forward is served the same way, each node by its path's prefix.
A miss runs the real forward for the rows asked for, resuming the stream's latest real cache where the prefixes
agree (a drafter's next token then costs a one-token forward, as in decoding). Along the reference it
teacher-forces ahead: a full pass the rest of the reference (every trial reads those rows), a skip pass
:data:`LOOKAHEAD` more rows (a self-draft's next picks while it follows the target, a later round's slim
pass). Rows and reference KV snapshots share one LRU bounded in bytes (:data:`MEMO_BYTES`); an evicted entry is
recomputed when next needed. Full-vocabulary rows are large (Qwen's 151,936 logits: 600 KB in fp32) and the
slim verifier's differ per watermark: an earlier replay that kept such logits unbounded filled 24 GB in 45 Qwen
trials.

Greedy only. Exact up to the float rounding of batched against incremental forwards: token for token in fp32;
in bf16 a near-tie may flip, which is why the search confirms promising trials by real decoding.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import DecodeConfig
from ..decoding.common import LM, CachedLM, Result, Stats
from ..decoding.decoder import Decoder
from ..decoding.tree import Tree
from ..decoding.tree_sizing import Calibration, VerifyCost
from ..routing import KVExtents, SkipSet, num_layers
from .costmodel import CostModel

# Rows a skip pass's miss on the reference computes beyond those asked: a bf16 CPU forward of 8 tokens costs
# about one of 1 (SmolLM2-135M: 45 vs 44 ms).
LOOKAHEAD = 8
MEMO_BYTES = 1 << 30  # logit rows and KV snapshots kept across trials; a miss recomputes what was evicted
# Latest real caches kept to resume a stream's forwards (outside the byte budget: a few sequences' KV).
CURSORS = 4


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


@dataclass(frozen=True)
class Stream:
    """What a pass's logits depend on besides the token prefix (see the module doc)."""

    model: str  # "target" or "draft"
    base: SkipSet  # the model's full pass skips these (a draft model's skip set)
    skip: SkipSet  # every sub-layer the pass skips, the base included
    watermark: int | None  # committed length of the cache a skip pass reads; None: a full pass


class Memo:
    """Tensors by key, least recently used first out once their bytes pass ``budget`` (the newest always stays)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.bytes = 0
        self.hits = self.misses = self.evicted = 0
        self._items: OrderedDict[Hashable, tuple[object, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable):
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: Hashable, value, nbytes: int) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._items[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.budget and len(self._items) > 1:
            _, (_, n) = self._items.popitem(last=False)
            self.bytes -= n
            self.evicted += 1


def _common(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ReplayCache:
    """The models, the references and the memo every trial's replay reads (see the module doc)."""

    def __init__(
        self,
        target: nn.Module,
        refs: list[Reference],
        draft: nn.Module | None = None,
        max_new_tokens: int | None = None,
        eos: set[int] | None = None,
        cost: CostModel | None = None,
        budget: int = MEMO_BYTES,
    ):
        """``max_new_tokens`` and ``eos``: what the references were decoded with (defaults: the longest output;
        the last token of every shorter one); ``cost`` prices each forward (None: modelled times are 0)."""
        self.target, self.refs, self.draft, self.cost = target, refs, draft, cost
        self.num_layers = num_layers(target)
        self.max_new_tokens = max_new_tokens or max((len(r.output) for r in refs), default=1)
        self.eos = (
            set(eos)
            if eos is not None
            else {r.output[-1] for r in refs if r.output and len(r.output) < self.max_new_tokens}
        )
        self.tokens = [r.full.tolist() for r in refs]
        self.memo = Memo(budget)
        self._cursors: OrderedDict[tuple, tuple[CachedLM, list[int]]] = OrderedDict()
        self._dtype = {"target": _dtype(target), "draft": _dtype(draft) if draft is not None else None}

    def model(self, name: str) -> nn.Module:
        return self.target if name == "target" else self.draft

    def decoder(self, cfg: DecodeConfig, i: int) -> Decoder:
        """The engine's decoder for ``cfg`` on reference ``i``, its models served from the memo."""
        return Decoder(
            self.target,
            None,
            cfg,
            self.draft,
            self.eos,
            lm=functools.partial(RecordedLM, self, i),
            verify_cost=self.verify_cost if cfg.tree_sizing == "cost" else None,
        )

    @functools.cached_property
    def verify_cost(self) -> VerifyCost:
        """What tree sizing cuts by, derived on the first trial that cuts: the cost model's curve; without a cost
        model every size costs a step, so nothing is cut."""
        return self.cost.verify_cost() if self.cost is not None else VerifyCost((1,), (1.0,))

    # ------------------------------------------------------------------ rows

    @torch.inference_mode()
    def rows(self, stream: Stream, i: int, tokens: list[int], lo: int, hi: int) -> torch.Tensor:
        """Float logits ``[hi - lo, V]`` of ``stream``: row ``p`` (``lo ≤ p < hi``) follows ``tokens[: p + 1]``;
        ``i``: the reference the tokens start from (where a miss teacher-forces ahead)."""
        out = [self.memo.get((stream, tuple(tokens[: p + 1]))) for p in range(lo, hi)]
        missing = next((j for j, row in enumerate(out) if row is None), None)
        if missing is None:
            self.memo.hits += 1
        else:
            self.memo.misses += 1
            out[missing:] = self._compute(stream, i, tokens, lo + missing, hi)
        return torch.stack([row.float() for row in out])

    def _compute(self, stream: Stream, i: int, tokens: list[int], lo: int, hi: int) -> list[torch.Tensor]:
        """Run the real pass for rows ``lo … hi - 1`` (and, on the reference, ahead), record them and return
        those asked for, as recorded."""
        ref = self.tokens[i]
        seq = tokens[:hi]
        if _common(seq, ref) == hi:  # on the reference: teacher-force ahead, later rounds and trials read it
            # A full pass's rows there serve every trial: the rest of the reference at once. A skip pass's serve
            # rounds at its watermark: a few more rows, which cost a CPU forward little more than one.
            seq = ref if stream.watermark is None else ref[: hi + LOOKAHEAD]
        lm = self._cursor(stream, i, seq, lo)
        ids = torch.tensor(seq, device=self.target.device)
        if stream.watermark is None:
            logits = lm.forward(ids, keep=len(seq) - lo)
        else:
            logits = lm.speculate(ids, stream.skip, tier="slim", keep=len(seq) - lo)
        dtype, rows = self._dtype[stream.model], []
        for j, row in enumerate(logits):
            row = row.to(dtype).clone()  # its own storage: evicting it frees it
            prefix = tuple(seq[: lo + j + 1])
            self.memo.put((stream, prefix), row, _nbytes(row) + 8 * len(prefix))  # the key's pointers too
            rows.append(row)
        return rows[: hi - lo]

    @torch.inference_mode()
    def node_rows(self, stream: Stream, i: int, seq: list[int], tree: Tree, nodes: range) -> torch.Tensor:
        """Float full-pass rows ``[len(nodes), V]`` of ``stream`` after each node's path below ``seq`` (what one tree
        forward computes for it). A miss runs the real tree forward once and records every node's row."""
        keys = [(stream, tuple(seq + [tree.tokens[k] for k in tree.path(j)])) for j in nodes]
        out = [self.memo.get(key) for key in keys]
        if all(row is not None for row in out):
            self.memo.hits += 1
        else:
            self.memo.misses += 1
            computed = self._compute_tree(stream, i, seq, tree)
            out = [computed[j] for j in nodes]
        return torch.stack([row.float() for row in out])

    def _compute_tree(self, stream: Stream, i: int, seq: list[int], tree: Tree) -> list[torch.Tensor]:
        """Run the real tree forward below ``seq`` (a full pass of ``stream``), record the row after ``seq`` and
        each node's, and return the nodes' rows, as recorded."""
        lm = self._cursor(stream, i, seq, len(seq) - 1)
        logits = lm.forward_tree(torch.tensor(seq, device=self.target.device), tree)
        dtype, rows = self._dtype[stream.model], []
        for j, row in enumerate(logits):
            row = row.to(dtype).clone()
            prefix = tuple(seq + [tree.tokens[k] for k in tree.path(j - 1)]) if j else tuple(seq)
            self.memo.put((stream, prefix), row, _nbytes(row) + 8 * len(prefix))
            rows.append(row)
        return rows[1:]

    def _cursor(self, stream: Stream, i: int, seq: list[int], lo: int) -> CachedLM:
        """A real cache for ``stream`` holding a prefix of ``seq`` no longer than ``lo`` (and, for a skip pass,
        the full-pass entries of ``seq[:watermark]``): the stream's latest one rolled back where the prefixes
        agree, else one started from the reference's KV snapshot."""
        key = (stream, i)
        need = stream.watermark or 0  # full-pass entries a skip pass reads
        held = self._cursors.pop(key, None)
        if held is not None and _common(held[1], seq) >= need:
            lm = held[0]
            lm.rollback(min(_common(held[1], seq), lo), floor=0)  # floor 0: a later rollback may go below
        else:
            lm = CachedLM(self.model(stream.model), stream.base, stats=Stats())
            shared = min(_common(seq, self.tokens[i]), need if stream.watermark is not None else lo)
            if shared:
                lm.cache.adopt(self._snapshot(stream, i), shared)
            if shared < need:  # a committed prefix off the reference (lossy runs): its KV for real
                lm.forward(torch.tensor(seq[:need], device=self.target.device))
        self._cursors[key] = (lm, list(seq))
        while len(self._cursors) > CURSORS:
            self._cursors.popitem(last=False)
        return lm

    def _snapshot(self, stream: Stream, i: int) -> list:
        """The full pass's KV over reference ``i`` (the model under its base skip set), from the memo."""
        key = ("kv", stream.model, stream.base, i)
        entries = self.memo.get(key)
        if entries is None:
            lm = CachedLM(self.model(stream.model), stream.base, stats=Stats())
            lm.forward(torch.tensor(self.tokens[i], device=self.target.device), keep=1)
            entries = lm.cache.entries()
            self.memo.put(key, entries, sum(_nbytes(k) + _nbytes(v) for k, v in filter(None, entries)))
        return entries

    # ------------------------------------------------------------------ the clock

    def price(self, model: str, tokens: int, skip: SkipSet) -> float:
        """Modelled seconds of a forward of ``tokens`` tokens of ``model`` skipping ``skip`` (its base included)."""
        if self.cost is None:
            return 0.0
        if model == "target":
            return self.cost.target_time(tokens, skip)
        return self.cost.draft_time(tokens, skip)

    def agreement(self, i: int, output: list[int]) -> int:
        """How many ``output`` tokens equal the target's greedy choice given the prompt and the output before
        them (``fidelity.greedy_agreement``, counted), from the target's full-pass rows."""
        if not output:
            return 0
        prompt = self.refs[i].prompt_ids.numel()
        tokens = self.tokens[i][:prompt] + list(output)
        stream = Stream("target", SkipSet(), SkipSet(), None)
        picks = self.rows(stream, i, tokens, prompt - 1, len(tokens) - 1).argmax(-1).tolist()
        return sum(a == b for a, b in zip(picks, output, strict=True))


def _dtype(model: nn.Module) -> torch.dtype:
    """What the model computes its logits in: rows are stored so (float32 rows of a bf16 model hold bf16 values)."""
    return model.get_output_embeddings().weight.dtype


class RecordedLM(LM):
    """The engine's model interface with recorded forwards: the same cache rules, rows from the replay's memo,
    seconds from its cost model. Built as ``Decoder`` builds a :class:`CachedLM` (model, skip, tier, stats)."""

    def __init__(
        self,
        replay: ReplayCache,
        ref: int,
        model: nn.Module,
        skip: SkipSet | None = None,
        tier: str = "full",
        stats: Stats | None = None,
        sync: bool = False,
    ):
        skip = skip or SkipSet()
        super().__init__(model, skip, tier, stats, KVExtents(model.config.num_hidden_layers, skip))
        self.replay, self.ref = replay, ref
        self.name = "target" if model is replay.target else "draft"

    def _logits(
        self, ids: torch.Tensor, start: int, skip: SkipSet | None, keep: int | None
    ) -> tuple[torch.Tensor, float]:
        end = ids.numel()
        n = min(keep, end - start) if keep else end - start
        whole = self.skip if skip is None else skip
        # A skip set no wider than the base is the full pass: the same computation, whatever the watermark.
        watermark = None if whole == self.skip else self.cache.committed
        stream = Stream(self.name, self.skip, whole, watermark)
        rows = self.replay.rows(stream, self.ref, ids.tolist(), end - n, end)
        return rows, self.replay.price(self.name, end - start, whole)

    def _tree_logits(self, ids: torch.Tensor, tree: Tree, base: int, fed: int) -> tuple[torch.Tensor, float]:
        # A tree pass is a full pass: each node's row depends on the token prefix its path spells, nothing else.
        seq = ids.tolist()
        stream = Stream(self.name, self.skip, self.skip, None)
        rows = []
        if len(seq) > base:  # tokens pending: the row after the sequence comes first
            rows.append(self.replay.rows(stream, self.ref, seq, len(seq) - 1, len(seq)))
        if tree.n > fed:
            rows.append(self.replay.node_rows(stream, self.ref, seq, tree, range(fed, tree.n)))
        return torch.cat(rows), self.replay.price(self.name, len(seq) - base + tree.n - fed, self.skip)


@dataclass
class Estimate:
    """The replayed outcome of one configuration over all calibration prompts: the engine's own results (its
    tokens, tier labels and statistics, with modelled per-tier times) and their agreement with the target."""

    slim_cost: float = 1.0  # a slim forward in full-target forwards: the share of sub-layers it runs
    results: list[Result] = field(default_factory=list)
    agree: int = 0  # emitted tokens the target would have chosen given the same prefix

    def total(self, name: str) -> float:
        """A :class:`Stats` field summed over the prompts."""
        return sum(getattr(r.stats, name) for r in self.results)

    @property
    def tokens(self) -> int:
        return int(self.total("new_tokens"))

    @property
    def tiers(self) -> list[int]:
        """Tokens decided directly / by the slim verifier / by the full target."""
        return [int(self.total(f"tokens_{t}")) for t in ("direct", "slim", "full")]

    @property
    def time_s(self) -> float:
        """Modelled seconds of every forward (the cost model's price of each pass)."""
        return sum(self.total(f"{t}_time_s") for t in ("draft", "slim", "full", "prefill"))

    @property
    def outputs(self) -> list[list[int]]:
        return [r.token_ids for r in self.results]

    @property
    def tier_labels(self) -> list[list[int]]:
        return [r.tiers for r in self.results]

    @property
    def fidelity(self) -> float:
        return self.agree / self.tokens if self.tokens else 1.0

    @property
    def acceptance(self) -> float:
        return acceptance(
            self.tokens, int(self.total("full_calls")), int(self.total("slim_calls")), self.slim_cost
        )


def acceptance(tokens: int, full_calls: int, slim_calls: int, slim_cost: float) -> float:
    """Tokens emitted per full-target-equivalent verification forward, a slim forward counting as the share
    of sub-layers it runs. Counting full calls alone made a slim verifier that skips nothing (a full forward
    under another name) look 2.6x better accepted than plain SD on the Qwen pair while running 0.68x AR."""
    cost = full_calls + slim_calls * slim_cost
    return tokens / cost if cost else float(tokens)


def simulate(cache: ReplayCache, cfg: DecodeConfig) -> Estimate:
    """Replay a configuration (greedy) on every calibration prompt."""
    est = Estimate(slim_cost=1.0 - cfg.skip.fraction(cache.num_layers) if cfg.mode == "viasd" else 1.0)
    # One decoder runs every prompt when measured: token recycling's tables and tree sizing's calibration carry over.
    recycled: dict = {}
    calibration = Calibration()
    for i, ref in enumerate(cache.refs):
        decoder = cache.decoder(cfg, i)
        decoder.recycled, decoder.calibration = recycled, calibration
        result = decoder.generate(ref.prompt_ids, max_new_tokens=cache.max_new_tokens)
        est.results.append(result)
        est.agree += cache.agreement(i, result.token_ids)
    return est

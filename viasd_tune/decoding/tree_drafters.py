"""Training-free tree drafters, combined under one node budget.

Three sources each propose scored candidate nodes (score: an estimate of the probability that the target
accepts the node's whole path, a product of per-step probabilities, so a child never outscores its parent):

- :class:`LookupSource`: every distinct continuation of the context's longest repeated suffix in prompt + output,
  from an incremental suffix automaton (a round only appends the new tokens, it never rescans the text); a
  step's score is how often that continuation followed in the text (SAM-Decoding, REST);
- :class:`RecycleSource`: token recycling: each token's top-k successors as the target last predicted them, kept
  in a table that every verification's logits refresh (free: the round computed them) and that the decoder keeps
  across requests;
- :class:`ModelSource`: the draft model expands, level by level in one batched forward each, the most probable
  frontier nodes by their top-k tokens (EAGLE-2's dynamic tree), so it branches where it is unsure.

:class:`CombinedDrafter` merges their proposals into one trie (a node proposed twice keeps its best score) and keeps
the ``budget`` best nodes, each with its parent. :class:`ChainTree` wraps a chain drafter (drafters.py) as a
width-1 tree.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from .common import CachedLM, Sampling, Sequence, Stats, pick
from .drafters import Drafter
from .tree import Tree
from .tree_sizing import Calibration, VerifyCost, cut, subtree


@dataclass
class Proposal:
    """One source's candidate nodes in topological order: token, parent (-1: the root), score; ``q_rows[i]``
    holds the logits node ``i`` was sampled from (``None``: a deterministic node)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    q_rows: list[torch.Tensor | None] = field(default_factory=list)

    def add(self, parent: int, token: int, score: float, q_row: torch.Tensor | None = None) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.scores.append(float(score))
        self.q_rows.append(q_row)
        return len(self.tokens) - 1

    @property
    def n(self) -> int:
        return len(self.tokens)

    def depth(self) -> int:
        """The deepest node's depth (0 when empty)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return max(d, default=0)


# ------------------------------------------------------------------------------------------------ lookup


class SuffixAutomaton:
    """Suffix automaton of a growing token sequence (amortised O(1) states and transitions per token).

    Each state is a class of substrings with the same end positions; ``cnt`` is how many end positions (the
    occurrence count), kept exact as the text grows: a new token ends an occurrence of every suffix of the
    text, i.e. of every state on the new state's suffix-link chain. From the state of a string s, the
    transitions spell exactly the continuations of s that occur in the text, so walking them from the state
    of the context's longest repeated suffix enumerates every distinct continuation.
    """

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.len = [0]
        self.cnt = [0]
        self.last = 0
        self.size = 0  # tokens appended

    def _state(self, length: int, link: int, nxt: dict[int, int], cnt: int) -> int:
        self.next.append(nxt)
        self.link.append(link)
        self.len.append(length)
        self.cnt.append(cnt)
        return len(self.len) - 1

    def extend(self, token: int) -> None:
        cur = self._state(self.len[self.last] + 1, 0, {}, 0)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.len[p] + 1 == self.len[q]:
                self.link[cur] = q
            else:
                clone = self._state(self.len[p] + 1, self.link[q], dict(self.next[q]), self.cnt[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur
        self.size += 1
        v = cur
        while v > 0:
            self.cnt[v] += 1
            v = self.link[v]

    def match(self) -> int:
        """The state of the longest suffix of the text that also occurs earlier with a continuation (0: none)."""
        v = self.last
        while v > 0 and not self.next[v]:
            v = self.link[v]
        return max(v, 0)


class LookupSource:
    """Lookup tree: continuations of the context's longest repeated suffix, best first by how often each
    followed it in the text (a step's score: its count over the count of the string before it)."""

    kind = "lookup"

    def __init__(self, depth: int, width: int):
        self.depth, self.width = depth, width
        self.sam = SuffixAutomaton()
        self.tokens: list[int] = []

    def sync(self, seq: Sequence) -> None:
        """Append the tokens the sequence gained since the last round (rebuild if it was cut)."""
        if seq.tokens[: self.sam.size] != self.tokens:
            self.sam, self.tokens = SuffixAutomaton(), []
        for t in seq.tokens[self.sam.size :]:
            self.sam.extend(t)
        self.tokens = list(seq.tokens)

    def propose(self, seq: Sequence, depth: int, budget: int) -> Proposal:
        self.sync(seq)
        sam, out = self.sam, Proposal()
        v = sam.match()
        if v == 0:
            return out
        heap: list[tuple[float, int, int, int, int, int]] = []  # (-score, order, state, parent, depth, token)
        order = 0

        def push(state: int, parent: int, d: int, score: float) -> None:
            nonlocal order
            if d >= min(self.depth, depth):
                return
            kids = sorted(sam.next[state].items(), key=lambda kv: -sam.cnt[kv[1]])[: self.width]
            for token, u in kids:
                heapq.heappush(heap, (-score * sam.cnt[u] / sam.cnt[state], order, u, parent, d + 1, token))
                order += 1

        push(v, -1, 0, 1.0)
        while heap and out.n < budget:
            neg, _, u, parent, d, token = heapq.heappop(heap)
            node = out.add(parent, token, -neg)
            push(u, node, d, -neg)
        return out


# ------------------------------------------------------------------------------------------------ recycling


class RecycleTable:
    """Each token's top-k successors and their probabilities, as the target last predicted them (host arrays,
    ``[V, k]``; -1: never seen). Refreshed from a round's verification logits with one top-k, no loop over
    the vocabulary."""

    def __init__(self, vocab: int, k: int):
        self.succ = np.full((vocab, k), -1, dtype=np.int64)
        self.prob = np.zeros((vocab, k), dtype=np.float32)

    def update(self, tokens: list[int], logits: torch.Tensor) -> None:
        """``logits[i]``: the target's logits right after ``tokens[i]`` (in some context)."""
        k = self.succ.shape[1]
        top, idx = logits.topk(k, dim=-1)
        prob = torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True))
        rows = np.asarray(tokens, dtype=np.int64)
        self.succ[rows] = idx.cpu().numpy()
        self.prob[rows] = prob.cpu().numpy()


class RecycleSource:
    """Token recycling: from the sequence's last token, follow each token's recorded successors (best first).
    ``table``: one kept from earlier requests (Token Recycling's hot start; see ``Decoder.forget``)."""

    kind = "recycle"

    def __init__(self, vocab: int, depth: int, width: int, table: RecycleTable | None = None):
        self.depth, self.width = depth, width
        self.table = table if table is not None else RecycleTable(vocab, width)

    def propose(self, seq: Sequence, depth: int, budget: int) -> Proposal:
        out = Proposal()
        succ, prob = self.table.succ, self.table.prob
        heap: list[tuple[float, int, int, int, int]] = []  # (-score, order, token, parent, depth)
        order = 0

        def push(token: int, parent: int, d: int, score: float) -> None:
            nonlocal order
            if d >= min(self.depth, depth):
                return
            for nxt, pr in zip(succ[token].tolist(), prob[token].tolist(), strict=True):
                if nxt >= 0:
                    heapq.heappush(heap, (-score * pr, order, nxt, parent, d + 1))
                    order += 1

        push(seq.tokens[-1], -1, 0, 1.0)
        while heap and out.n < budget:
            neg, _, token, parent, d = heapq.heappop(heap)
            node = out.add(parent, token, -neg)
            push(token, node, d, -neg)
        return out

    def observe(self, seq: Sequence, tree: Tree, logits: torch.Tensor) -> None:
        self.table.update([seq.tokens[-1], *tree.tokens], logits)


# ------------------------------------------------------------------------------------------------ draft model


class ModelSource:
    """The draft model's tree: level by level, the ``width`` most probable frontier nodes (by path probability)
    are fed in one batched forward (:meth:`CachedLM.forward_tree`) and each offers its top ``width`` tokens;
    the next frontier is the ``width`` best of those. When sampling, each expanded node also gets one child
    drawn from the draft's distribution (kept whatever it draws, as exactness requires; see
    ``tree_sd.verify_tree``), and its deterministic siblings skip that token. ``confidence`` > 0 stops once the
    best frontier path is less likely than that."""

    kind = "model"

    def __init__(
        self, lm: CachedLM, depth: int, width: int, sampling: Sampling, gen, confidence: float = 0.0
    ):
        self.lm, self.depth, self.width = lm, depth, width
        self.sampling, self.gen, self.confidence = sampling, gen, confidence
        self.fed = 0  # tree nodes in the draft cache behind the committed entries

    def propose(self, seq: Sequence, depth: int, budget: int) -> Proposal:
        out = Proposal()
        tree = Tree([], [])
        rows = self.lm.forward_tree(seq.ids, tree, tier="draft")  # [1, V]: after the sequence's last token
        self.fed = 0
        frontier, scores = [-1], [1.0]
        for level in range(min(self.depth, depth)):
            if level:  # feed the previous level: one batched forward for the whole frontier
                tree = Tree(out.tokens, out.parents)
                rows = self.lm.forward_tree(seq.ids, tree, fed=self.fed, tier="draft")
                self.fed = out.n
            room = budget - out.n
            if room <= 0:
                break
            # Expand the best frontier nodes only (decided before anything below them is drawn).
            order = sorted(range(len(frontier)), key=lambda i: -scores[i])[: min(self.width, room)]
            probs = torch.softmax(rows[order], dim=-1)
            top_p, top_i = probs.topk(self.width, dim=-1)
            drawn = [None] * len(order)
            if not self.sampling.greedy:
                drawn = pick(rows[order], self.sampling, self.gen).tolist()
            top_p, top_i = top_p.tolist(), top_i.tolist()
            cands = []  # (-score, sampled, parent, token, row)
            for j, i in enumerate(order):
                if drawn[j] is not None:
                    cands.append(
                        (-scores[i] * float(probs[j, drawn[j]]), 0, frontier[i], drawn[j], rows[order[j]])
                    )
                for pr, tok in zip(top_p[j], top_i[j], strict=True):
                    if tok != drawn[j]:
                        cands.append((-scores[i] * pr, 1, frontier[i], tok, None))
            sampled = [c for c in cands if c[1] == 0]
            rest = sorted(c for c in cands if c[1] == 1)[: max(0, min(self.width, room) - len(sampled))]
            level_nodes = sorted(sampled + rest, key=lambda c: (c[2], c[1], c[0]))  # by parent, sampled first
            frontier, scores = [], []
            for neg, _, parent, tok, row in level_nodes:
                frontier.append(out.add(parent, tok, -neg, row))
                scores.append(-neg)
            if not frontier or max(scores) < self.confidence:
                break
        return out

    def observe(self, path: list[int]) -> None:
        """Keep the draft cache's entries of the accepted nodes it holds (a prefix of the path)."""
        self.lm.keep_path(self.fed, [i for i in path if i < self.fed])
        self.fed = 0

    def rollback(self, length: int, floor: int) -> None:
        self.lm.rollback(length, floor)


# ------------------------------------------------------------------------------------------------ combined


def merge(proposals: list[Proposal], budget: int) -> tuple[Tree, list[dict[int, int]]]:
    """One tree of at most ``budget`` nodes from the proposals, and per proposal its kept nodes (tree index →
    proposal index).

    A node proposed twice (same parent, same token) is one node with the better score; two *sampled* draws of a
    token both stay (dropping one for its value would bias the sampling rule). Sampled nodes and their ancestors
    are always kept (their inclusion must not depend on what was drawn); the rest of the budget goes to the best
    nodes whose parent is kept. Order: breadth first; siblings sampled first, then by score."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    q_rows: list[torch.Tensor | None] = []
    index: dict[tuple[int, int], int] = {}
    local: list[list[int]] = []  # per proposal: its node i → trie node
    for prop in proposals:
        m: list[int] = []
        for i in range(prop.n):
            parent = -1 if prop.parents[i] < 0 else m[prop.parents[i]]
            key = (parent, prop.tokens[i])
            j = index.get(key)
            row = prop.q_rows[i]
            if j is not None and row is not None and q_rows[j] is not None:
                j = None  # a second draw of the same token: a node of its own
            if j is None:
                j = len(tokens)
                tokens.append(prop.tokens[i])
                parents.append(parent)
                scores.append(prop.scores[i])
                q_rows.append(row)
                index.setdefault(key, j)
            else:
                scores[j] = max(scores[j], prop.scores[i])
                if row is not None:
                    q_rows[j] = row
            m.append(j)
        local.append(m)

    kids: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        kids.setdefault(p, []).append(j)
    keep: set[int] = set()
    for j, row in enumerate(q_rows):
        while row is not None and j >= 0 and j not in keep:
            keep.add(j)
            j = parents[j]
    heap = [(-scores[c], c) for p in [-1, *keep] for c in kids.get(p, []) if c not in keep]
    heapq.heapify(heap)
    while heap and len(keep) < budget:
        _, c = heapq.heappop(heap)
        if c in keep:
            continue
        keep.add(c)
        for g in kids.get(c, []):
            heapq.heappush(heap, (-scores[g], g))

    order: list[int] = []  # breadth first over kept nodes
    new_index: dict[int, int] = {}
    frontier = [-1]
    while frontier:
        nxt = []
        for p in frontier:
            chosen = sorted(
                (c for c in kids.get(p, []) if c in keep), key=lambda c: (q_rows[c] is None, -scores[c], c)
            )
            for c in chosen:
                new_index[c] = len(order)
                order.append(c)
            nxt += chosen
        frontier = nxt
    sampled = [q_rows[j] is not None for j in order]
    q_logits = None
    if any(sampled):
        ref = next(r for r in q_rows if r is not None)
        q_logits = torch.stack([q_rows[j] if q_rows[j] is not None else torch.zeros_like(ref) for j in order])
    tree = Tree(
        [tokens[j] for j in order],
        [-1 if parents[j] < 0 else new_index[parents[j]] for j in order],
        q_logits,
        sampled if any(sampled) else None,
    )
    kept = [{new_index[j]: i for i, j in enumerate(m) if j in new_index} for m in local]
    return tree, kept


class CombinedDrafter:
    """The sources' proposals merged under one node budget (:func:`merge`). As a chain (``chain``: budget γ,
    every source of width 1) the sources are fallbacks instead, as the hybrid chain drafters are: the first
    proposal at least ``lookup_min`` deep (capped at the round's depth) is the round's, the last one in any case;
    a source after it does not run (the draft model costs forwards, lookup and recycling do not)."""

    def __init__(
        self,
        sources: list,
        budget: int,
        stats: Stats,
        lookup_min: int = 1,
        chain: bool = False,
        sizing: tuple[Calibration, VerifyCost] | None = None,
    ):
        self.sources, self.budget, self.stats = sources, budget, stats
        self.lookup_min, self.chain, self.sizing = lookup_min, chain, sizing
        self.kind = "+".join(s.kind for s in sources)
        self._kept: dict[int, dict[int, int]] = {}  # source position → (tree node → the source's node)
        self._learn: tuple[list[str], list[float], list[int]] | None = None  # the round's nodes, for calibration

    def tree(self, seq: Sequence, depth: int) -> Tree:
        ran, proposals = [], []
        for k, source in enumerate(self.sources):
            proposal = source.propose(seq, depth, self.budget)
            ran.append(k)
            proposals.append(proposal)
            if isinstance(source, ModelSource):
                self.stats.rounds_model += 1  # it ran forwards, used or not
            if self.chain and proposal.depth() >= min(self.lookup_min, depth):
                break
        if self.chain:
            ran, proposals = ran[-1:], proposals[-1:]
        if any(self.sources[k].kind == "lookup" and p.n for k, p in zip(ran, proposals, strict=True)):
            self.stats.rounds_lookup += 1
        tree, kept = merge(proposals, self.budget)
        if self.sizing is not None and tree.n:
            tree, kept = self._cut(tree, kept, [self.sources[k].kind for k in ran], proposals)
        self._kept = dict(zip(ran, kept, strict=True))
        self.stats.drafted += tree.n
        return tree

    def _cut(
        self, tree: Tree, kept: list[dict[int, int]], kinds: list[str], proposals: list[Proposal]
    ) -> tuple[Tree, list[dict[int, int]]]:
        """The merged tree cut to the size that pays (:func:`tree_sizing.cut`), and the sources' maps to it."""
        scores, names = [0.0] * tree.n, [[] for _ in range(tree.n)]
        for kind, m, prop in zip(kinds, kept, proposals, strict=True):
            for node, i in m.items():
                scores[node] = max(scores[node], prop.scores[i])
                names[node].append(kind)
        keys = ["+".join(sorted(n)) for n in names]
        calibration, cost = self.sizing
        keep, steps = cut(tree, scores, keys, calibration, cost)
        small = subtree(tree, keep)
        self._learn = ([keys[i] for i in keep], [steps[i] for i in keep], small.parents)
        index = {old: new for new, old in enumerate(keep)}
        return small, [{index[t]: i for t, i in m.items() if t in index} for m in kept]

    def observe(self, seq: Sequence, tree: Tree, logits: torch.Tensor, path: list[int]) -> None:
        if self.sizing is not None and self._learn is not None:
            self.sizing[0].learn(*self._learn, path)
            self._learn = None
        for k, source in enumerate(self.sources):
            if isinstance(source, RecycleSource):
                source.observe(seq, tree, logits)
            elif isinstance(source, ModelSource) and k in self._kept:
                mine = self._kept[k]
                prefix = []
                for node in path:  # the accepted path as far as the draft model proposed it
                    if node not in mine:
                        break
                    prefix.append(mine[node])
                source.observe(prefix)

    def rollback(self, length: int, floor: int) -> None:
        for source in self.sources:
            if isinstance(source, ModelSource):
                source.rollback(length, floor)


class ChainTree:
    """A chain drafter (drafters.py) as a tree drafter: its γ drafts as a width-1 tree, sampled from its logits
    when it returns them."""

    def __init__(self, drafter: Drafter):
        self.drafter, self.kind = drafter, drafter.kind

    def tree(self, seq: Sequence, depth: int) -> Tree:
        drafts, q_logits = self.drafter.draft(seq, depth)
        return Tree.chain(drafts.tolist(), q_logits)

    def observe(self, seq: Sequence, tree: Tree, logits: torch.Tensor, path: list[int]) -> None:
        pass

    def rollback(self, length: int, floor: int) -> None:
        self.drafter.rollback(length, floor)

"""Each round's token tree cut to the size that pays on this host (issue 33; Sequoia sizes a tree to the hardware's
cost curve, EAGLE-2 ranks nodes by path probability).

A node's score from its source (lookup's continuation counts, recycling's past target probabilities) is a
ranking, not a probability: on Qwen2.5-Coder-1.5B a lookup step scored 1.0 is accepted 77 % of the time and one
scored 0.2–0.5 about 5 %. :class:`Calibration` learns, from every verification, how often a node whose parent the
target accepted is accepted too, by what proposed it and its step score; a node's expected acceptance is the
product of those along its path. :func:`cut` then keeps the prefix of the merge's best-first order that maximises
expected tokens per round over the verify forward's cost at that size (:class:`VerifyCost`, measured on this host):
a block of 16 tokens costs ~1.5 single steps on AVX-512-bf16 and ~1.0 with AMX, so the same drafts make a
different tree on each.

Exactness: the cut only drops deterministic nodes, chosen from what was learnt before this round's verification,
so greedy output stays the target's and the sampling rule's conditions hold (``tree_sd.verify_tree``); sampled
nodes and their ancestors are always kept.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .tree import Tree

# Upper edges of the step-score bins (a step's score over its parent's, in [0, 1]); the last bin is "certain".
EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.999])
PRIOR = 2.0  # pseudo-verifications at the raw step score, so an empty bin trusts its source
# Verify blocks timed on load, up to the tree's largest.
MEASURED_BLOCKS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class VerifyCost:
    """A full-target forward's cost by block size (tokens fed), in single-token steps: linear between measured
    sizes, the last segment's slope beyond, never lower for a larger block."""

    blocks: tuple[int, ...]
    costs: tuple[float, ...]

    @classmethod
    def from_times(cls, points: Iterable[tuple[int, float]]) -> VerifyCost:
        """From measured ``(block, seconds)`` pairs (any order), relative to the smallest block's time; a
        larger block that measured faster (noise) costs what the smaller did."""
        pts = sorted(points)
        if not pts or pts[0][1] <= 0:
            raise ValueError("a verify cost needs at least one positive time")
        rel = np.maximum.accumulate(np.array([t for _, t in pts]) / pts[0][1])
        return cls(tuple(int(b) for b, _ in pts), tuple(float(c) for c in rel))

    def __call__(self, block: int) -> float:
        ks, cs = self.blocks, self.costs
        if block <= ks[-1] or len(ks) == 1:
            return float(np.interp(block, ks, cs))
        return cs[-1] + (cs[-1] - cs[-2]) / (ks[-1] - ks[-2]) * (block - ks[-1])


@torch.inference_mode()
def measure_verify_cost(model: nn.Module, max_block: int, context: int = 128, reps: int = 5) -> VerifyCost:
    """Time full forwards of the :data:`MEASURED_BLOCKS` up to ``max_block`` (and it) over a cached
    ``context``-token prefix, every row's logits computed as a verify forward does; the sizes take turns, so a
    burst of load on the host slows them alike, and each keeps its median of ``reps``: ~10 s for a 1.5B model on
    2 CPU cores."""
    from .common import CachedLM  # common imports tree; keep this module importable without a cycle

    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (context + max_block,), generator=gen).to(model.device)
    lm = CachedLM(model)
    lm.forward(prefix[:context], keep=1)
    sizes = sorted({b for b in MEASURED_BLOCKS if b < max_block} | {max_block})
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(reps):
        for k in sizes:
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            lm.forward(prefix[: context + k])  # every row's logits, as a verify forward computes them
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - start)
            lm.rollback(context, 0)
    return VerifyCost.from_times((k, statistics.median(t)) for k, t in times.items())


class Calibration:
    """How often the target accepts a node whose parent it accepted, by the set of sources that proposed the node
    and the bin of its step score; learnt from each round's verification (a node off the path below a rejected
    parent says nothing and is not counted)."""

    def __init__(self) -> None:
        self.counts: dict[str, np.ndarray] = {}  # sources → [bins, 2]: nodes verified, nodes accepted

    def prob(self, key: str, step: float) -> float:
        seen, hit = self.counts.get(key, np.zeros((len(EDGES) + 1, 2)))[_bin(step)]
        return float((hit + PRIOR * step) / (seen + PRIOR))

    def learn(self, keys: list[str], steps: list[float], parents: list[int], path: list[int]) -> None:
        on = set(path)
        for i, (key, step, parent) in enumerate(zip(keys, steps, parents, strict=True)):
            if parent < 0 or parent in on:
                table = self.counts.setdefault(key, np.zeros((len(EDGES) + 1, 2)))
                table[_bin(step)] += (1.0, float(i in on))


def _bin(step: float) -> int:
    return int(np.searchsorted(EDGES, step, side="left"))


def cut(
    tree: Tree,
    scores: list[float],
    keys: list[str],
    calibration: Calibration,
    cost: VerifyCost,
    pending: int = 1,
) -> tuple[list[int], list[float]]:
    """The nodes to verify (ascending) and every node's step score. Sampled nodes and their ancestors stay;
    the others are added best score first (each after its parent, the merge's order) while that raises
    expected tokens (1 + the kept nodes' path probabilities) per unit of :class:`VerifyCost` at
    ``pending`` + kept nodes; the best prefix is kept."""
    steps = [
        s / (scores[p] if p >= 0 and scores[p] > 0 else 1.0)
        for s, p in zip(scores, tree.parents, strict=True)
    ]
    path_prob: list[float] = []
    for i, p in enumerate(tree.parents):
        path_prob.append(
            min(1.0, calibration.prob(keys[i], min(steps[i], 1.0))) * (path_prob[p] if p >= 0 else 1.0)
        )
    forced: set[int] = set()
    for i in range(tree.n):
        j = i
        while tree.sampled is not None and tree.sampled[i] and j >= 0 and j not in forced:
            forced.add(j)
            j = tree.parents[j]
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    gain = 1.0 + sum(path_prob[i] for i in forced)
    best, best_n, order = gain / cost(pending + len(forced)), 0, []
    heap = [(-scores[c], c) for p in [-1, *forced] for c in kids.get(p, []) if c not in forced]
    heapq.heapify(heap)
    while heap:
        _, c = heapq.heappop(heap)
        order.append(c)
        gain += path_prob[c]
        value = gain / cost(pending + len(forced) + len(order))
        if value > best:
            best, best_n = value, len(order)
        for g in kids.get(c, []):
            heapq.heappush(heap, (-scores[g], g))
    return sorted(forced | set(order[:best_n])), steps


def subtree(tree: Tree, keep: list[int]) -> Tree:
    """The nodes ``keep`` (ascending, each with its parent) as a tree of their own, in the same order."""
    index = {old: new for new, old in enumerate(keep)}
    return Tree(
        [tree.tokens[i] for i in keep],
        [-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep],
        None if tree.q_logits is None else tree.q_logits[keep],
        None if tree.sampled is None else [tree.sampled[i] for i in keep],
    )

"""Seeded, not sampled: score every attention and MLP sub-layer by what skipping it alone changes, price it, and
build skip sets from those scores that the study starts from.

TPE's random start-up on the Qwen pair never found a 14-20 sub-layer skip set that settles tokens within the
fidelity bound; ShortGPT and KnapSpec pick layers from measured importance instead. Here one calibration pass,
teacher-forced along the target's own greedy continuations (the replay's references), runs the slim verifier's
pass with one sub-layer skipped over the target's committed KV cache, block by block, exactly as the engine
does (:meth:`CachedLM.speculate`), and compares it with the full pass over the same block: the top-1 agreement
drop is the weight a sub-layer costs, the mean KL(full || skipped) breaks ties among the many sub-layers whose
drop is 0. The cost model prices each sub-layer kind (time saved per forward). Skip sets then come from a 0-1
knapsack (value: time saved, weight: agreement lost; KnapSpec) at several loss budgets and from the
cheapest-per-lost-agreement ranking at several sizes, and are enqueued as the space's params (``params.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import optuna
import torch
from torch import nn
from tqdm.auto import tqdm

from ..decoding.common import CachedLM
from ..routing import SkipSet, num_layers
from . import params
from . import space as spaces
from .costmodel import CostModel
from .records import TrialRecord
from .replay import Reference

BLOCK = 8  # tokens per slim pass: a verify block of gamma + 1 for the spaces' largest gamma
# Blocks scored in all, taken round-robin over the references (each costs a forward per sub-layer scored):
# 16 blocks are about 15 s on SmolLM2-135M and 6 min on Qwen2.5-1.5B in bf16 on 2 CPU cores.
MAX_BLOCKS = 16
LOSS_BUDGETS = (0.0, 0.01, 0.02, 0.05, 0.1)  # agreement the knapsack sets may lose (share of positions)
SIZES = 4  # ranking prefixes, evenly spread over the space's skip-fraction range
MAX_SEEDS = 8


@dataclass
class Importance:
    """Per sub-layer kind, per layer: agreement drop and KL when skipped alone; seconds a forward saves."""

    # kind -> [num_layers]: the share of positions whose top-1 changes, and the mean KL(full || skipped);
    # None where the space may not skip it (protected layers, kinds it leaves out), so it was not scored
    drop: dict[str, list[float | None]]
    kl: dict[str, list[float | None]]
    saved_s: dict[str, float]  # kind -> seconds one skipped sub-layer saves on a BLOCK-token forward
    positions: int  # positions scored (drop is a count over these)
    block: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Importance:
        return cls(**{k: d[k] for k in ("drop", "kl", "saved_s", "positions", "block")})


@torch.inference_mode()
def score_sublayers(
    target: nn.Module,
    refs: list[Reference],
    slots: list[tuple[int, str]] | None = None,
    block: int = BLOCK,
    progress: bool = False,
    max_blocks: int | None = MAX_BLOCKS,
) -> tuple[dict[str, list[float | None]], dict[str, list[float | None]], int]:
    """Top-1 agreement drop and KL(full || skipped) of skipping each sub-layer alone, over every block of every
    reference. Each block is a slim pass over the target's committed KV cache of everything before it (what the
    slim verifier sees); the full pass over the same block is the reference and then commits it. ``slots``:
    the (layer, kind) sub-layers to score (default all); the others are None. At most ``max_blocks`` blocks
    are scored, round-robin over the references (their first blocks first)."""
    n_layers = num_layers(target)
    if slots is None:
        slots = [(i, k) for i in range(n_layers) for k in spaces.SUBLAYERS]
    changed = torch.zeros(len(slots), dtype=torch.long, device=target.device)
    kl_sum = torch.zeros(len(slots), dtype=torch.float64, device=target.device)
    positions = 0
    blocks = [-(-len(r.output) // block) for r in refs]
    picked = [0] * len(refs)  # each reference's first blocks, dealt round-robin
    left = sum(blocks) if max_blocks is None else min(max_blocks, sum(blocks))
    while left:
        for i, n in enumerate(blocks):
            if left and picked[i] < n:
                picked[i] += 1
                left -= 1
    bar = tqdm(total=sum(picked), desc="layer importance", disable=not progress, leave=False, unit="block")
    for ref, count in zip(refs, picked, strict=True):
        if not count:
            continue
        seq, start = ref.full, ref.prompt_ids.numel()
        lm = CachedLM(target)
        lm.forward(seq[:start], keep=1)  # prefill: the first output token is the prefill's, never a slim one
        for w in range(start, seq.numel(), block)[:count]:
            ids = seq[: min(w + block, seq.numel())]
            # The full pass's logits first, uncommitted (a speculative pass that skips nothing), so each
            # skipped pass is compared as soon as it ends and a 150k vocabulary never needs [slots, b, V].
            full = lm.speculate(ids, SkipSet(), "full")
            lm.discard(SkipSet())
            top, log_p = full.argmax(-1), torch.log_softmax(full, -1)
            p = log_p.exp()
            for s, (i, kind) in enumerate(slots):
                skip = SkipSet.of([i]) if kind == "attn" else SkipSet.of((), [i])
                q = lm.speculate(ids, skip, "slim")
                lm.discard(skip)
                changed[s] += (q.argmax(-1) != top).sum()
                kl_sum[s] += (p * (log_p - torch.log_softmax(q, -1))).sum().double()
            lm.forward(ids, keep=1)  # commit the block: the next one reads the target's own KV of it
            positions += full.shape[0]
            bar.update()
    bar.close()
    drop_l, kl_l = changed.tolist(), kl_sum.tolist()  # one device read for the whole pass
    drop: dict[str, list[float | None]] = {k: [None] * n_layers for k in spaces.SUBLAYERS}
    kl: dict[str, list[float | None]] = {k: [None] * n_layers for k in spaces.SUBLAYERS}
    for s, (i, k) in enumerate(slots):
        drop[k][i] = drop_l[s] / max(positions, 1)
        kl[k][i] = max(kl_l[s], 0.0) / max(positions, 1)
    return drop, kl, positions


def price_sublayers(cost: CostModel, block: int = BLOCK) -> dict[str, float]:
    """Seconds one skipped attention / MLP sub-layer saves on a ``block``-token forward (the cost model is
    linear in the running sub-layers of each kind, so this is the same for every layer of a kind)."""
    full = cost.target_time(block, None)
    return {
        "attn": max(full - cost.target_time(block, SkipSet.of([0])), 0.0),
        "mlp": max(full - cost.target_time(block, SkipSet.of((), [0])), 0.0),
    }


def measure(
    target: nn.Module,
    refs: list[Reference],
    cost: CostModel,
    space: spaces.SearchSpace | None = None,
    block: int = BLOCK,
    progress: bool = False,
) -> Importance:
    """Scores and prices of the sub-layers ``space`` may skip, or of all (see :func:`score_sublayers` and
    :func:`price_sublayers`)."""
    n = num_layers(target)
    slots = params.eligible_slots(space, n) if space else None
    drop, kl, positions = score_sublayers(target, refs, slots, block, progress)
    return Importance(drop, kl, price_sublayers(cost, block), positions, block)


# ---------------------------------------------------------------- skip sets from the scores


def _items(imp: Importance, space: spaces.SearchSpace, n_layers: int) -> list[tuple[int, str]]:
    """The sub-layers the space lets the slim verifier skip (protection and kinds respected)."""
    slots = params.eligible_slots(space, n_layers)
    return [(i, k) for i, k in slots if imp.drop.get(k) and imp.drop[k][i] is not None]


def _price(imp: Importance, kind: str) -> float:
    """Seconds a skipped ``kind`` saves, floored at 5 % of the dearer kind: every sub-layer costs something,
    and a noisy fit that prices one kind at 0 must not make all of them free (or worthless)."""
    top = max(imp.saved_s.values(), default=0.0)
    return max(imp.saved_s.get(kind, 0.0), 0.05 * top) if top > 0 else 1.0


def _value(imp: Importance, slot: tuple[int, str]) -> float:
    """Time saved, plus a tiny term for a low KL so that among equal savings the gentler sub-layer wins."""
    i, k = slot
    unit = min(_price(imp, kind) for kind in spaces.SUBLAYERS)
    return _price(imp, k) + unit * 1e-4 * (1.0 - min(imp.kl[k][i], 1.0))


def ranking(imp: Importance, space: spaces.SearchSpace, n_layers: int) -> list[tuple[int, str]]:
    """Eligible sub-layers, cheapest per lost agreement first (agreement lost per second saved; KL, then time
    saved, break ties)."""
    items = _items(imp, space, n_layers)

    def key(slot: tuple[int, str]) -> tuple[float, float, float, int]:
        i, k = slot
        saved = _price(imp, k)
        return (imp.drop[k][i] / saved, imp.kl[k][i] / saved, -saved, i)

    return sorted(items, key=key)


def knapsack(
    imp: Importance, space: spaces.SearchSpace, n_layers: int, loss_budget: float, max_count: int
) -> list[tuple[int, str]]:
    """0-1 knapsack: the sub-layers that save the most time with total agreement drop <= ``loss_budget`` and at
    most ``max_count`` of them. Drops are counts over ``imp.positions``, so the weights are exact integers."""
    items = _items(imp, space, n_layers)
    cap_w = int(np.floor(loss_budget * imp.positions + 1e-9))
    cap_c = max(0, min(max_count, len(items)))
    if not items or cap_c == 0:
        return []
    weights = [round(imp.drop[k][i] * imp.positions) for i, k in items]
    values = [_value(imp, s) for s in items]
    best = np.full((cap_c + 1, cap_w + 1), -np.inf)  # best[c, w]: most value with c items of weight w
    best[0, 0] = 0.0
    took = np.zeros((len(items), cap_c + 1, cap_w + 1), dtype=bool)
    for n, (w, v) in enumerate(zip(weights, values, strict=True)):
        if w > cap_w:
            continue
        cand = np.full_like(best, -np.inf)
        cand[1:, w:] = best[:-1, : cap_w + 1 - w] + v
        took[n] = cand > best
        best = np.where(took[n], cand, best)
    c, w = np.unravel_index(int(np.argmax(best)), best.shape)
    chosen = []
    for n in range(len(items) - 1, -1, -1):
        if took[n, c, w]:
            chosen.append(items[n])
            c, w = c - 1, w - weights[n]
    return sorted(chosen, key=lambda s: (s[0], spaces.SUBLAYERS.index(s[1])))


def _count_range(space: spaces.SearchSpace, slots: int) -> tuple[int, int]:
    """Skip sizes the space's encoding can express (the budget encoding skips round(frac * slots), frac in its
    range, and round is monotonic)."""
    if space.skip.encoding == "budget":
        assert space.skip.budget is not None
        return round(space.skip.budget.low * slots), round(space.skip.budget.high * slots)
    return 0, slots


def seed_skip_sets(imp: Importance, space: spaces.SearchSpace, n_layers: int) -> list[SkipSet]:
    """Distinct, non-empty skip sets to start the study from: knapsack sets at each loss budget (largest size
    the space allows), then ranking prefixes at sizes spread over the space's range; at most ``MAX_SEEDS``."""
    items = _items(imp, space, n_layers)
    lo, hi = _count_range(space, len(params.eligible_slots(space, n_layers)))
    picks: list[list[tuple[int, str]]] = []
    for budget in LOSS_BUDGETS:
        chosen = knapsack(imp, space, n_layers, budget, hi)
        if len(chosen) >= lo:
            picks.append(chosen)
    ranked = ranking(imp, space, n_layers)
    if hi >= max(lo, 1):
        for size in np.linspace(max(lo, 1), hi, SIZES):
            picks.append(ranked[: int(round(size))])
    out: list[SkipSet] = []
    for chosen in picks:
        skip = _as_skip(chosen)
        if chosen and lo <= len(chosen) <= hi and skip not in out and set(chosen) <= set(items):
            out.append(skip)
    return out[:MAX_SEEDS]


def _as_skip(chosen: list[tuple[int, str]]) -> SkipSet:
    return SkipSet.of((i for i, k in chosen if k == "attn"), (i for i, k in chosen if k == "mlp"))


def enqueue_seeds(study: optuna.Study, space: spaces.SearchSpace, n_layers: int, imp: Importance) -> int:
    """Enqueue the seed skip sets (other params left to the sampler); a resumed study does not get them twice.
    Returns how many were enqueued."""
    TS = optuna.trial.TrialState
    live = study.get_trials(deepcopy=False, states=(TS.WAITING, TS.RUNNING, TS.COMPLETE, TS.PRUNED))
    have = [TrialRecord.read(t).enqueued for t in live]
    n = 0
    for skip in seed_skip_sets(imp, space, n_layers):
        point = params.skip_params(space, n_layers, skip)  # VIA-SD: no escalate_all, as sampled trials
        if point not in have:
            params.enqueue(study, point)
            n += 1
    return n

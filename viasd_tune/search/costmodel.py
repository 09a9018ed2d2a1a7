"""A latency model of one forward call, fitted from a short micro-benchmark.

Wall clock on two noisy cores is a poor objective on its own, so the search also reports a *modelled* speedup:
the replay prices every forward a configuration makes (its model, skip set and tokens fed) with a linear model in
the number of running attention and MLP sub-layers and the block size, fitted with scikit-learn on measured
forwards.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.linear_model import LinearRegression
from torch import nn

from ..decoding.common import CachedLM
from ..decoding.tree_sizing import VerifyCost
from ..routing import SkipSet, num_layers

BLOCKS = (1, 4, 8)
SKIP_FRACTIONS = (0.0, 0.25, 0.5)
# Verify block sizes whose full-target cost is measured as a curve (up to the largest block a space verifies):
# a block's cost is far from linear in its size (AVX-512-bf16, Qwen 1.5B: 8 tokens 1.35 steps, 16 1.54, 24 2.01,
# 64 3.50; issue 33), and a token tree's verify block is up to 65 tokens.
CURVE_BLOCKS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def _features(k: np.ndarray, n_attn: np.ndarray, n_mlp: np.ndarray) -> np.ndarray:
    return np.stack([k, n_attn, n_mlp, k * n_attn, k * n_mlp], axis=1).astype(float)


@torch.inference_mode()
def _time_forward(
    model: nn.Module,
    skip: SkipSet | None,
    context: torch.Tensor,
    k: int,
    reps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of a k-token forward on top of a cached ``context``, read from ``clock``."""
    times = []
    for _ in range(reps):
        lm = CachedLM(model, skip)
        lm.forward(context)
        ids = torch.cat([context, context.repeat(k // context.numel() + 1)[:k]])
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = clock()
        lm.forward(ids)
        times.append(clock() - start)
    return statistics.median(times)


@dataclass
class CostModel:
    """Predicts seconds per forward; ``draft_coef`` prices a separate draft model (t = a + b·k) of
    ``draft_layers`` layers, a skip set on it scaling that by the share of sub-layers it still runs.

    ``blocks``: the full target's measured seconds per block size ``((k, s), …)``, ascending. With it a forward
    of ``k`` tokens costs the curve at ``k`` (linear between measured sizes, the last segment's slope beyond),
    scaled for a skip set by the linear model's ratio of that skip set to the full pass at the same ``k``."""

    target: LinearRegression
    n_layers: int
    draft_coef: tuple[float, float] | None = None
    draft_layers: int | None = None
    blocks: tuple[tuple[int, float], ...] | None = None

    def _linear(self, k: int, skip: SkipSet | None) -> float:
        n_attn = self.n_layers - (len(skip.attn) if skip else 0)
        n_mlp = self.n_layers - (len(skip.mlp) if skip else 0)
        x = _features(np.array([k]), np.array([n_attn]), np.array([n_mlp]))[0]
        # LinearRegression.predict, without its input checks: the replay prices every forward it serves
        return max(float(x @ self.target.coef_ + self.target.intercept_), 1e-6)

    def block_time(self, k: int) -> float | None:
        """The measured curve's seconds for a full-target block of ``k`` tokens (None: no curve)."""
        if not self.blocks:
            return None
        ks = [b for b, _ in self.blocks]
        ts = [t for _, t in self.blocks]
        if k <= ks[-1] or len(ks) == 1:
            return float(np.interp(k, ks, ts))
        slope = (ts[-1] - ts[-2]) / (ks[-1] - ks[-2])
        return max(ts[-1] + slope * (k - ks[-1]), 1e-6)

    def target_time(self, k: int, skip: SkipSet | None) -> float:
        linear = self._linear(k, skip)
        curve = self.block_time(k)
        if curve is None:
            return linear
        return curve if skip is None or skip.is_empty else curve * linear / self._linear(k, None)

    def verify_cost(self) -> VerifyCost:
        """The full target's cost by block size, what ``tree_sizing`` ``cost`` cuts trees by: the measured curve,
        or the linear model at the curve's sizes up to 64 where none was measured."""
        points = self.blocks or tuple((k, self._linear(k, None)) for k in CURVE_BLOCKS)
        return VerifyCost.from_times(points)

    def draft_time(self, k: int, skip: SkipSet | None = None) -> float:
        a, b = self.draft_coef or (0.0, 0.0)
        share = 1.0 - skip.fraction(self.draft_layers) if skip is not None and self.draft_layers else 1.0
        return max(a + b * k, 0.0) * share


def fit(
    model: nn.Module,
    draft: nn.Module | None,
    context: torch.Tensor,
    reps: int = 3,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    max_block: int | None = None,
) -> CostModel:
    """Time the target under a few random skip sets and block sizes (and the draft model), fit the model.
    ``clock``: wall time by default; ``time.thread_time`` on one torch thread measures the work alone, which
    other processes on the host cannot inflate (what the tests use on a shared machine). ``max_block``: the
    largest verify block the search can make (γ + 1, or a token tree's nodes + 1); the full target's cost curve
    is measured at the :data:`CURVE_BLOCKS` up to it and at it (None: no curve, the linear model alone)."""
    rng = random.Random(seed)
    n = num_layers(model)
    rows, ys = [], []
    for frac in SKIP_FRACTIONS:
        count = round(frac * (n - 2))
        skip = SkipSet.of(rng.sample(range(1, n - 1), count), rng.sample(range(1, n - 1), count))
        for k in BLOCKS:
            ys.append(_time_forward(model, skip, context, k, reps, clock))
            rows.append((k, n - len(skip.attn), n - len(skip.mlp)))
    arr = np.array(rows)
    reg = LinearRegression(positive=True).fit(_features(arr[:, 0], arr[:, 1], arr[:, 2]), np.array(ys))
    draft_coef = None
    if draft is not None:
        ks = np.array([1, 4, 8, 16])
        ts = np.array([_time_forward(draft, None, context, int(k), reps, clock) for k in ks])
        b, a = np.polyfit(ks, ts, 1)
        draft_coef = (float(a), float(max(b, 0.0)))
    blocks = None
    if max_block is not None:
        sizes = sorted({k for k in CURVE_BLOCKS if k < max_block} | {max(1, max_block)})
        blocks = tuple((k, _time_forward(model, None, context, k, reps, clock)) for k in sizes)
    return CostModel(reg, n, draft_coef, num_layers(draft) if draft is not None else None, blocks)

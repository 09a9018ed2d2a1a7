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
from ..routing import SkipSet, num_layers

BLOCKS = (1, 4, 8)
SKIP_FRACTIONS = (0.0, 0.25, 0.5)


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
        ids = torch.cat([context, context[:k]])
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = clock()
        lm.forward(ids)
        times.append(clock() - start)
    return statistics.median(times)


@dataclass
class CostModel:
    """Predicts seconds per forward; ``draft_coef`` prices a separate draft model (t = a + b·k) of
    ``draft_layers`` layers, a skip set on it scaling that by the share of sub-layers it still runs."""

    target: LinearRegression
    n_layers: int
    draft_coef: tuple[float, float] | None = None
    draft_layers: int | None = None

    def target_time(self, k: int, skip: SkipSet | None) -> float:
        n_attn = self.n_layers - (len(skip.attn) if skip else 0)
        n_mlp = self.n_layers - (len(skip.mlp) if skip else 0)
        x = _features(np.array([k]), np.array([n_attn]), np.array([n_mlp]))[0]
        # LinearRegression.predict, without its input checks: the replay prices every forward it serves
        return max(float(x @ self.target.coef_ + self.target.intercept_), 1e-6)

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
) -> CostModel:
    """Time the target under a few random skip sets and block sizes (and the draft model), fit the model.
    ``clock``: wall time by default; ``time.thread_time`` on one torch thread measures the work alone, which
    other processes on the host cannot inflate (what the tests use on a shared machine)."""
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
    return CostModel(reg, n, draft_coef, num_layers(draft) if draft is not None else None)

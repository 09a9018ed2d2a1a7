"""The latency cost model orders forwards as a direct timing does: block sizes, and skip sets.

A model with a large hidden size makes the differences large (a 32-token block against one token; skipping
none against most sub-layers). Both the fit and the direct timing read the thread's CPU time on one torch
thread (``time.thread_time``): the work itself, which other processes on a shared host (this one runs a
benchmark beside the tests) cannot inflate, where wall time measured their scheduling. The direct timing also
alternates the two forwards it compares and takes medians after a warm-up."""

from __future__ import annotations

import functools
import statistics
import time

import pytest
import torch

from tests.conftest import priced_lm, tiny_model
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.common import CachedLM
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.routing import SkipSet, install_skipping
from viasd_tune.search import costmodel, replay

LAYERS = 6
CLOCK = time.thread_time


@pytest.fixture(scope="module")
def model(one_thread):
    m = tiny_model("llama", seed=0, layers=LAYERS, hidden=512)
    install_skipping(m)
    return m


@pytest.fixture(scope="module")
def context() -> torch.Tensor:
    return torch.arange(3, 67) % 90 + 3  # 64 tokens


@pytest.fixture(scope="module")
def fitted(model, context) -> costmodel.CostModel:
    return costmodel.fit(model, None, context, reps=5, clock=CLOCK)


@torch.inference_mode()
def forward_s(model, context: torch.Tensor, k: int, skip: SkipSet | None) -> float:
    """One k-token forward under ``skip`` over a cached context (what the cost model prices)."""
    lm = CachedLM(model)
    lm.forward(context)
    ids = torch.cat([context, context[:k]])
    start = CLOCK()
    if skip is None:
        lm.forward(ids)
    else:
        lm.speculate(ids, skip, tier="slim")
    return CLOCK() - start


def timed(model, context, a: tuple[int, SkipSet | None], b: tuple[int, SkipSet | None], reps: int = 9):
    """Median seconds of forwards a and b, alternated after a warm-up of each."""
    for k, skip in (a, b):
        forward_s(model, context, k, skip)
    ta, tb = [], []
    for _ in range(reps):
        ta.append(forward_s(model, context, *a))
        tb.append(forward_s(model, context, *b))
    return statistics.median(ta), statistics.median(tb)


MOST = SkipSet.of(range(1, LAYERS - 1), range(1, LAYERS - 1))  # 8 of 12 sub-layers


@pytest.mark.parametrize(
    ("small", "large"),
    [
        ((1, None), (32, None)),  # block size, full pass
        ((1, MOST), (32, MOST)),  # block size, slim pass
        ((16, MOST), (16, None)),  # skip set, same block
        ((4, SkipSet.of(range(1, LAYERS - 1), [])), (4, None)),  # attention sub-layers only
    ],
)
def test_cost_model_orders_forwards_as_timing_does(model, context, fitted, small, large) -> None:
    measured_small, measured_large = timed(model, context, small, large)
    predicted_small, predicted_large = fitted.target_time(*small), fitted.target_time(*large)
    assert measured_small < measured_large  # the pairs are chosen so that timing itself is unambiguous
    assert predicted_small < predicted_large, (
        predicted_small,
        predicted_large,
        measured_small,
        measured_large,
    )


def test_cost_model_ranks_a_ladder_of_skip_sets(model, context, fitted) -> None:
    """Skipping more never predicts slower, as timing says; the full pass is the slowest."""
    ladder = [SkipSet.of(range(1, 1 + j), range(1, 1 + j)) for j in range(LAYERS - 1)]
    predicted = [fitted.target_time(16, s) for s in ladder]
    assert predicted == sorted(predicted, reverse=True)
    full, most = timed(model, context, (16, ladder[0]), (16, ladder[-1]))
    assert most < full and predicted[-1] < predicted[0]


def priced_decoder(model, cost: costmodel.CostModel):
    return functools.partial(
        Decoder,
        model,
        None,
        eos=set(),
        lm=priced_lm(cost, model),
        verify_cost=cost.verify_cost(),
    )


def test_replayed_tiers_cost_what_decoding_measures(model, fitted) -> None:
    """The replay prices each forward by its model, skip set and tokens fed: per tier (the self-draft under its
    skip set, the slim verifier under another, the full target), its modelled seconds are the priced passes
    decoding runs for the same configuration."""
    prompts = [torch.tensor([(7 * i + j) % 90 + 3 for i in range(12 + 5 * j)]) for j in range(3)]
    decoder = priced_decoder(model, fitted)
    refs = [replay.Reference(str(j), p, decoder(DecodeConfig(mode="ar")).generate(p, 16).token_ids, 0.0)
            for j, p in enumerate(prompts)]  # fmt: skip
    cache = replay.ReplayCache(model, refs, max_new_tokens=16, eos=set(), cost=fitted)
    cfg = DecodeConfig(
        gamma=4,
        drafter="self",
        draft_skip=SkipSet.of(range(1, LAYERS - 1), range(1, LAYERS - 1)),
        skip=SkipSet.of([2], [3]),
        tau_accept=0.5,
        tau_escalate=3.0,
        recheck=True,
    )
    est = replay.simulate(cache, cfg)
    decoded = [decoder(cfg).generate(p, 16) for p in prompts]
    assert [r.token_ids for r in decoded] == est.outputs
    for tier in ("prefill", "draft", "slim", "full"):
        modelled, measured = (
            est.total(f"{tier}_time_s"),
            sum(getattr(r.stats, f"{tier}_time_s") for r in decoded),
        )
        assert measured > 0 and modelled == pytest.approx(measured, rel=1e-6), (tier, modelled, measured)


def test_draft_model_skip_set_is_cheaper(model, context) -> None:
    draft = tiny_model("llama", seed=1, layers=4, hidden=64)
    install_skipping(draft)
    cost = costmodel.fit(model, draft, context, reps=1, clock=CLOCK)
    assert cost.draft_layers == 4
    whole, light = cost.draft_time(8), cost.draft_time(8, SkipSet.of([1, 2], [1, 2]))
    assert light == pytest.approx(whole * 0.5)


def test_a_verify_block_is_priced_by_its_size_on_the_measured_curve(model, context) -> None:
    """The full target's block cost is measured at the curve's sizes up to the space's largest block; a block
    between two sizes costs the interpolation, one beyond the last the last segment's slope, and a skip pass
    the curve scaled by the linear model's skip-set ratio. A non-linear curve (issue 33's AVX-512-bf16 host)
    is priced as measured, where the linear model alone cannot bend."""
    fitted = costmodel.fit(model, None, context, reps=3, clock=CLOCK, max_block=20)
    assert [k for k, _ in fitted.blocks] == [1, 2, 4, 8, 12, 16, 20]
    for k, seconds in fitted.blocks:
        assert fitted.target_time(k, None) == pytest.approx(seconds)
    # issue 33's curve, in 1-token steps
    steps = ((1, 1.0), (2, 0.92), (4, 1.16), (8, 1.35), (16, 1.54), (32, 2.37), (64, 3.50))
    curve = costmodel.CostModel(fitted.target, fitted.n_layers, blocks=steps)
    assert curve.target_time(12, None) == pytest.approx((1.35 + 1.54) / 2)
    assert curve.target_time(2, None) < curve.target_time(1, None)  # as measured, not as a line would have it
    assert curve.target_time(80, None) == pytest.approx(3.50 + 16 * (3.50 - 2.37) / 32)
    linear = costmodel.CostModel(fitted.target, fitted.n_layers)
    for k in (1, 9, 40):
        ratio = linear.target_time(k, MOST) / linear.target_time(k, None)
        assert curve.target_time(k, MOST) == pytest.approx(curve.target_time(k, None) * ratio)
    assert fitted.target_time(4, MOST) < fitted.target_time(4, None)
    # what tree sizing cuts by: the curve in steps, never lower for a larger block; the linear model without one
    cost = curve.verify_cost()
    assert cost.blocks == (1, 2, 4, 8, 16, 32, 64) and cost(2) == 1.0 and cost(16) == pytest.approx(1.54)
    line = linear.verify_cost()
    assert line.blocks[-1] == 64 and line(9) == pytest.approx(
        linear.target_time(9, None) / linear.target_time(1, None)
    )


def test_replayed_tree_rounds_cost_what_decoding_measures(model) -> None:
    """A token tree's verify block (the pending token and every node) priced on the curve: the replay's modelled
    full-target seconds of tree configurations, fixed and cut to the cost, are the priced passes decoding runs."""
    prompts = [torch.tensor([(7 * i + j) % 90 + 3 for i in range(12 + 5 * j)]) for j in range(3)]
    cost = costmodel.fit(model, None, prompts[0], reps=3, clock=CLOCK, max_block=33)
    decoder = priced_decoder(model, cost)
    refs = [replay.Reference(str(j), p, decoder(DecodeConfig(mode="ar")).generate(p, 16).token_ids, 0.0)
            for j, p in enumerate(prompts)]  # fmt: skip
    cache = replay.ReplayCache(model, refs, max_new_tokens=16, eos=set(), cost=cost)
    for nodes, sizing in ((8, "fixed"), (32, "fixed"), (32, "cost")):
        cfg = DecodeConfig(
            mode="sd",
            gamma=6,
            drafter="lookup+recycle",
            tree_nodes=nodes,
            tree_recycle_width=4,
            tree_sizing=sizing,
        )
        est = replay.simulate(cache, cfg)
        dec = decoder(cfg)
        decoded = [dec.generate(p, 16) for p in prompts]
        assert [r.token_ids for r in decoded] == est.outputs
        assert est.total("tree_nodes_verified") == sum(r.stats.tree_nodes_verified for r in decoded) > 0
        measured = sum(r.stats.full_time_s for r in decoded)
        assert est.total("full_time_s") == pytest.approx(measured, rel=1e-6), (nodes, sizing)

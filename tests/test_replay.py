"""The replay is the engine over recorded forwards: on tiny fp32 models, real decoding and the replay of the same
configuration give the same tokens, tier labels and statistics (every count: rounds, calls and tokens fed per
tier, drafts, lookup rounds, re-checks and rollbacks) for every mode, drafter (model, self, lookup and the
hybrids) and VIA-SD setting (recheck on and off, thresholds, KL kinds, slim and draft skip sets,
draft_confidence), lossy runs included; its modelled time is what decoding's passes cost under the same cost
model; its memo serves each row as the pass it stands for computes it, and stays within its byte budget."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from conftest import logits_over_committed, noisy_copy, priced_lm, tiny_model

from viasd_tune.config import CHAIN_DRAFTERS, HYBRIDS, DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.decoding.tree_sizing import VerifyCost
from viasd_tune.fidelity import greedy_agreement
from viasd_tune.routing import SkipSet, install_skipping
from viasd_tune.search import costmodel, replay

MAX_NEW = 20
EOS = {2}


@pytest.fixture(scope="module")
def models(one_thread):
    target = tiny_model("llama", seed=0, layers=4)
    install_skipping(target)
    return target, noisy_copy(target, 0.3, seed=1)  # a draft that agrees often, not always


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        # Repeats give prompt lookup something to find.
        base = [rng.randrange(3, 96) for _ in range(rng.randrange(2, 8))]
        out.append(torch.tensor((base * 3)[: rng.randrange(1, 20)]))
    return out


def references(target, ps) -> list[replay.Reference]:
    dec = Decoder(target, None, DecodeConfig(mode="ar"), eos=EOS)
    return [
        replay.Reference(str(j), p, dec.generate(p, max_new_tokens=MAX_NEW).token_ids, 0.0)
        for j, p in enumerate(ps)
    ]


def decode(target, draft, cfg: DecodeConfig, ps, **kw):
    dec = Decoder(target, None, cfg, draft=draft, eos=EOS, **kw)
    return [dec.generate(p, max_new_tokens=MAX_NEW) for p in ps]


def counts(stats) -> dict:
    """Every statistic but the times."""
    return {k: v for k, v in stats.to_dict().items() if not k.endswith("_s")}


def check(cache: replay.ReplayCache, cfg: DecodeConfig, results) -> replay.Estimate:
    """Prompt by prompt, so a difference names its prompt."""
    est = replay.simulate(cache, cfg)
    for i, (r, e) in enumerate(zip(results, est.results, strict=True)):
        where = f"prompt {i}, {cfg}"
        assert e.token_ids == r.token_ids, where
        assert e.tiers == r.tiers, where
        assert counts(e.stats) == counts(r.stats), where
    agree = sum(round(greedy_agreement(cache.target, p.prompt_ids, r.token_ids) * len(r.token_ids)) for p, r in
                zip(cache.refs, results, strict=True))  # fmt: skip
    assert est.agree == agree, cfg
    return est


SKIPS = [SkipSet(), SkipSet.of([1], [2]), SkipSet.of([1, 2], [1, 2]), SkipSet.of([2], [])]
THRESHOLDS = [(0.0, 0.0), (0.05, 0.5), (0.5, 3.0), (2.0, 50.0), (50.0, 50.0)]
SELF_SKIPS = [SkipSet.of([1, 2], [1, 2]), SkipSet.of([2], [1, 3])]
MODEL_SKIPS = [SkipSet(), SkipSet.of([1], [1])]  # a skip set on the separate draft model


def hybrid_only(drafter: str, lookup_min: int) -> int:
    """``lookup_min`` where the drafter reads it (the hybrids), else its default: DecodeConfig refuses it
    elsewhere. Drawn for every drafter, so each drafter's grid draws the same sequence."""
    return lookup_min if drafter in HYBRIDS else 1


def configs(drafter: str, seed: int, n: int) -> list[DecodeConfig]:
    """Plain SD and ``n`` VIA-SD settings drawn from the grid, with ``drafter``."""
    rng = random.Random(seed)
    draft_skips = (
        SELF_SKIPS if drafter.endswith("self") else MODEL_SKIPS if drafter.endswith("model") else [SkipSet()]
    )
    out = [
        DecodeConfig(mode="sd", gamma=g, drafter=drafter, draft_skip=rng.choice(draft_skips),
                     draft_confidence=c if drafter != "lookup" else 0.0, lookup_min=hybrid_only(drafter, rng.choice([1, 3])))
        for g, c in ((1, 0.0), (4, 0.5), (7, 0.0))
    ]  # fmt: skip
    grid = list(itertools.product(SKIPS, THRESHOLDS, [1, 3, 5], ["forward", "reverse", "js"], [False, True]))
    rng.shuffle(grid)
    for skip, (ta, te), gamma, kl, recheck in grid[:n]:
        out.append(
            DecodeConfig(
                mode="viasd",
                gamma=gamma,
                drafter=drafter,
                skip=skip,
                draft_skip=rng.choice(draft_skips),
                tau_accept=ta,
                tau_escalate=te,
                kl=kl,
                recheck=recheck,
                draft_confidence=rng.choice([0.0, 0.0, 0.3, 0.6]) if drafter != "lookup" else 0.0,
                lookup_min=hybrid_only(drafter, rng.choice([1, 2, 4])),
            )
        )
    return out


@pytest.mark.parametrize("drafter", CHAIN_DRAFTERS)
def test_replay_is_the_engine(models, drafter: str) -> None:
    target, draft = models
    ps = prompts(4, seed=CHAIN_DRAFTERS.index(drafter))
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    seen = {"slim": 0, "direct": 0, "rollbacks": 0, "lossy": 0, "lookup": 0, "model": 0, "confidence": 0}
    for cfg in configs(drafter, seed=7, n=16):
        results = decode(target, draft, cfg, ps)
        est = check(cache, cfg, results)
        seen["slim"] += est.tiers[1]
        seen["direct"] += est.tiers[0]
        seen["rollbacks"] += int(est.total("rollbacks"))
        seen["lossy"] += est.fidelity < 1
        seen["lookup"] += int(est.total("rounds_lookup"))
        seen["model"] += int(est.total("rounds_model"))
        seen["confidence"] += cfg.draft_confidence > 0
    # The grid exercised what it is for: both tiers below the target, re-check rollbacks, lossy runs that left
    # the target's output, the drafter's sources and draft_confidence.
    assert seen["slim"] and seen["direct"] and seen["rollbacks"] and seen["lossy"], seen
    assert bool(seen["lookup"]) == drafter.startswith("lookup"), seen
    assert bool(seen["model"]) == (drafter != "lookup"), seen
    assert seen["confidence"] or drafter == "lookup", seen


TREE_DRAFTERS = ["lookup", "recycle", "lookup+recycle", "model", "lookup+model", "lookup+recycle+model"]


def tree_configs(drafter: str, seed: int, n: int) -> list[DecodeConfig]:
    """Token trees (issue 33) of random budgets (chains included) and source shapes, each field set only where
    it acts (a field that does nothing is refused)."""
    rng = random.Random(seed)
    parts = drafter.split("+")
    out = []
    for _ in range(n):
        nodes = rng.choice([1, 4, 12, 24])
        fields: dict = {"mode": "sd", "gamma": rng.choice([2, 4, 6]), "drafter": drafter, "tree_nodes": nodes}
        if nodes > 1 or "recycle" in parts:  # the sources' shapes act on trees only
            for source, depth in (("lookup", (2, 6)), ("recycle", (1, 4)), ("model", (1, 4))):
                if source in parts:
                    fields[f"tree_{source}_depth"] = rng.randint(*depth)
                    fields[f"tree_{source}_width"] = rng.randint(1, 3)
        if "model" in parts:
            fields.update(draft_skip=rng.choice(MODEL_SKIPS), draft_confidence=rng.choice([0.0, 0.3]))
        if drafter in HYBRIDS or "recycle" in parts:
            fields["lookup_min"] = rng.choice([1, 2])
        out.append(DecodeConfig(**fields))
    return out


@pytest.mark.parametrize("drafter", TREE_DRAFTERS)
def test_replay_serves_tree_rounds(models, drafter: str) -> None:
    """Tree rounds through the replay: every node's row served by its path's prefix (the draft model's levels
    too), so the replay gives real decoding's tokens, tier labels and every count (tree nodes verified and
    accepted depth included); a second pass over the same trees is served from the memo alone."""
    target, draft = models
    ps = prompts(4, seed=40 + TREE_DRAFTERS.index(drafter))
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    verified = accepted = 0
    cfgs = tree_configs(drafter, seed=TREE_DRAFTERS.index(drafter), n=5)
    for cfg in cfgs:
        est = check(cache, cfg, decode(target, draft, cfg, ps))
        verified += int(est.total("tree_nodes_verified"))
        accepted += int(est.total("tree_depth_accepted"))
        if cfg.is_tree:
            assert est.total("full_calls") == est.total("rounds")  # one tree forward a round
    assert verified > accepted > 0  # trees were verified, and some of their nodes accepted
    misses = cache.memo.misses
    for cfg in cfgs:
        check(cache, cfg, decode(target, draft, cfg, ps))
    assert cache.memo.misses == misses


@pytest.mark.parametrize("drafter", ["lookup+recycle", "lookup+recycle+model"])
def test_replay_cuts_trees_as_decoding_does(models, drafter: str) -> None:
    """``tree_sizing`` cost through the replay: the same curve and a calibration carried across the prompts as
    one decoder carries it, so real decoding's tokens and counts; the cut verifies fewer nodes than the budget."""
    target, draft = models
    ps = prompts(4, seed=60)
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    cache.verify_cost = VerifyCost((1, 4, 32), (1.0, 1.1, 4.0))
    fixed = sized = 0
    for cfg in (c for c in tree_configs(drafter, seed=9, n=6) if c.tree_nodes > 1):
        cut = DecodeConfig.from_dict({**cfg.to_dict(), "tree_sizing": "cost"})
        sized += int(
            check(cache, cut, decode(target, draft, cut, ps, verify_cost=cache.verify_cost)).total(
                "tree_nodes_verified"
            )
        )
        fixed += int(replay.simulate(cache, cfg).total("tree_nodes_verified"))
    assert 0 < sized < fixed


def test_replay_of_ar_is_the_reference(models) -> None:
    target, draft = models
    ps = prompts(4, seed=5)
    refs = references(target, ps)
    est = replay.simulate(
        replay.ReplayCache(target, refs, draft, max_new_tokens=MAX_NEW, eos=EOS), DecodeConfig(mode="ar")
    )
    assert est.outputs == [r.output for r in refs]
    assert est.fidelity == 1.0 and est.tiers == [0, 0, est.tokens] and est.acceptance == 1.0


def test_replay_matches_decoding_with_sliding_window_layers(one_thread) -> None:
    """Gemma-3's sliding layers (window 16) hold the past beyond the window in the snapshots the memo adopts."""
    target = tiny_model("gemma3", seed=4, layers=4)
    install_skipping(target)
    draft = noisy_copy(target, 0.3, seed=5)
    ps = [torch.tensor([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 9]), torch.tensor([30, 31, 30])]
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    for drafter, recheck in itertools.product(["model", "self", "lookup+self"], [False, True]):
        cfg = DecodeConfig(
            gamma=4,
            drafter=drafter,
            skip=SkipSet.of([1], [2]),
            draft_skip=SkipSet.of([1, 2], [1, 2]) if drafter.endswith("self") else SkipSet(),
            tau_accept=0.05,
            tau_escalate=1.0,
            recheck=recheck,
            draft_confidence=0.3,
        )
        check(cache, cfg, decode(target, draft, cfg, ps))


@torch.inference_mode()
def test_a_row_is_what_its_pass_computes(models) -> None:
    """Each memo row equals the pass its key names, built by hand with a plain transformers cache: the full
    pass over the prefix, or a skip pass over the full model's KV of the prefix up to its watermark; on the
    reference (served ahead) and off it (a drafted token the target would not emit)."""
    target, draft = models
    ps = prompts(2, seed=9)
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    ref = cache.tokens[0]
    off = ref[:-3] + [(ref[-3] + 1) % 96, 7, 8]
    skip = SkipSet.of([1], [2])
    for tokens, c in itertools.product([ref, off], [len(ref) - 8, len(ref) - 5]):
        lo, hi = c + 1, len(tokens)
        full = cache.rows(replay.Stream("target", SkipSet(), SkipSet(), None), 0, tokens, lo, hi)
        slim = cache.rows(replay.Stream("target", SkipSet(), skip, c), 0, tokens, lo, hi)
        torch.testing.assert_close(full, logits_over_committed(target, tokens, 0)[lo:hi], atol=1e-4, rtol=0)
        torch.testing.assert_close(
            slim, logits_over_committed(target, tokens, c, skip)[lo - c : hi - c], atol=1e-4, rtol=0
        )
        base = SkipSet.of([0], [1])  # the separate draft model under a skip set of its own
        drafted = cache.rows(replay.Stream("draft", base, base, None), 0, tokens, lo, hi)
        torch.testing.assert_close(
            drafted, logits_over_committed(draft, tokens, 0, base)[lo:hi], atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("drafter", ["model", "self"])
def test_the_memo_stays_within_its_budget_and_eviction_changes_nothing(models, drafter: str) -> None:
    """A search replays many skip sets over one memo: rows and snapshots are evicted past the byte budget (here
    a few dozen rows), and what was evicted is recomputed to the same results as an unbounded memo gives."""
    target, draft = models
    ps = prompts(3, seed=11)
    refs = references(target, ps)
    budget = 40 * 96 * 4  # 40 fp32 rows of the tiny vocabulary (about 20 with their keys)
    small = replay.ReplayCache(target, refs, draft, max_new_tokens=MAX_NEW, eos=EOS, budget=budget)
    large = replay.ReplayCache(target, refs, draft, max_new_tokens=MAX_NEW, eos=EOS)
    skips = [SkipSet.of(a, m) for a in ([], [0], [1], [3]) for m in ([], [2], [0, 3])]
    for draft_skip in skips[1:] + skips[1:4]:  # the first ones again, after eviction
        cfg = DecodeConfig(
            gamma=3,
            drafter=drafter,
            draft_skip=draft_skip,
            skip=SkipSet.of([1], [2]),
            tau_accept=0.5,
            tau_escalate=3.0,
        )
        a, b = replay.simulate(small, cfg), replay.simulate(large, cfg)
        assert (a.outputs, a.tier_labels, a.agree) == (b.outputs, b.tier_labels, b.agree), draft_skip
        assert [counts(r.stats) for r in a.results] == [counts(r.stats) for r in b.results]
        assert small.memo.bytes <= budget
    assert small.memo.evicted and small.memo.misses > large.memo.misses


def test_modelled_time_tracks_measured_time(one_thread) -> None:
    """The replay prices every forward with the cost model; decoding the same configuration, timed by that cost
    model's price of each pass it runs (``priced_lm``), adds up to the same seconds: the replay feeds each model
    the tokens and skip sets decoding feeds it. (Whether the fit predicts wall time is a property of the host,
    ordered by tests/test_costmodel.py and measured end to end by the search's held-out timing.)"""
    target = tiny_model("llama", seed=2, layers=4, hidden=384)
    install_skipping(target)
    draft = tiny_model("llama", seed=3, layers=2, hidden=192)
    ps = prompts(3, seed=13)
    clock = time.thread_time
    cost = costmodel.fit(target, draft, ps[0].repeat(4), reps=3, clock=clock)
    cache = replay.ReplayCache(
        target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS, cost=cost
    )
    measured_lm = priced_lm(cost, target)
    for cfg in (
        DecodeConfig(mode="ar"),
        DecodeConfig(mode="sd", gamma=4, drafter="model"),
        DecodeConfig(mode="sd", gamma=4, drafter="lookup+self", draft_skip=SkipSet.of([1, 2], [1, 2])),
        DecodeConfig(
            gamma=3,
            drafter="self",
            draft_skip=SkipSet.of([1, 2], [1, 2]),
            skip=SkipSet.of([2], [1]),
            tau_accept=0.5,
            tau_escalate=3.0,
            recheck=True,
        ),  # fmt: skip
    ):
        est = replay.simulate(cache, cfg)
        results = decode(target, draft, cfg, ps, lm=measured_lm)
        measured = sum(
            getattr(r.stats, f"{t}_time_s") for r in results for t in ("draft", "slim", "full", "prefill")
        )
        assert [r.token_ids for r in results] == est.outputs
        assert measured > 0 and est.time_s == pytest.approx(measured, rel=1e-6), cfg

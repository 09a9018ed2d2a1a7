"""The replay follows the engine: on tiny fp32 models, real decoding and the replay of the same configuration
give the same tokens, tier labels and forwards (tier, tokens fed, in order), for plain SD and VIA-SD with and
without recheck and draft_confidence, over skip sets, thresholds, γ, KL kinds and the three drafters."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests.conftest import noisy_copy, tiny_model
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.routing import SkipSet, install_skipping
from viasd_tune.search import replay

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


def decode(target, draft, cfg: DecodeConfig, ps):
    dec = Decoder(target, None, cfg, draft=draft, eos=EOS)
    return [dec.generate(p, max_new_tokens=MAX_NEW) for p in ps]


def calls_of(stats) -> dict:
    return {
        tier: (getattr(stats, f"{tier}_calls"), getattr(stats, f"{tier}_tokens_processed"))
        for tier in ("draft", "slim", "full", "prefill")
    }


def replayed_calls(calls: list[tuple[str, int]]) -> dict:
    return {
        tier: (sum(1 for t, _ in calls if t == tier), sum(k for t, k in calls if t == tier))
        for tier in ("draft", "slim", "full", "prefill")
    }


def check(cache, cfg: DecodeConfig, results) -> replay.Estimate:
    """Prompt by prompt, so a difference names its prompt."""
    est = replay.Estimate()
    for i, r in enumerate(results):
        one = replay.Estimate()
        replay._Run(cache, i, cfg, one).run()
        where = f"prompt {i}, {cfg}"
        assert one.outputs[0] == r.token_ids, where
        assert one.tier_labels[0] == r.tiers, where
        assert replayed_calls(one.calls) == calls_of(r.stats), where
        s = r.stats
        assert (one.rounds, one.drafted, one.rounds_lookup) == (s.rounds, s.drafted, s.rounds_lookup), where
        assert (one.rechecked, one.rollbacks, one.rolled_back_tokens) == (
            s.rechecked,
            s.rollbacks,
            s.rolled_back_tokens,
        ), where
        est.tokens += one.tokens
        est.rollbacks += one.rollbacks
        est.tiers = [a + b for a, b in zip(est.tiers, one.tiers, strict=True)]
    return est


SKIPS = [SkipSet(), SkipSet.of([1], [2]), SkipSet.of([1, 2], [1, 2]), SkipSet.of([2], [])]
THRESHOLDS = [(0.0, 0.0), (0.05, 0.5), (0.5, 3.0), (2.0, 50.0), (50.0, 50.0)]


@pytest.mark.parametrize("drafter", ["model", "self", "lookup", "lookup+model"])
def test_replay_matches_decoding(models, drafter: str) -> None:
    target, draft = models
    ps = prompts(4, seed={"model": 0, "self": 1, "lookup": 2, "lookup+model": 3}[drafter])
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    rng = random.Random(7)
    draft_skips = [SkipSet.of([1, 2], [1, 2])] if drafter.endswith("self") else [SkipSet()]
    if drafter.endswith("model"):
        draft_skips.append(SkipSet.of([1], [1]))  # a skip set on the separate draft model
    seen = {"recheck_rollback": 0, "slim": 0, "direct": 0, "lossy": 0, "confidence": 0}
    grid = list(itertools.product(SKIPS, THRESHOLDS, [1, 3, 5], ["forward", "reverse", "js"], [False, True]))
    rng.shuffle(grid)
    for skip, (ta, te), gamma, kl, recheck in grid[:20]:
        confidence = rng.choice([0.0, 0.0, 0.3, 0.6]) if drafter != "lookup" else 0.0
        draft_skip, lookup_min = rng.choice(draft_skips), rng.choice([1, 2, 4])  # drawn for all: same grid
        cfg = DecodeConfig(
            mode="viasd",
            gamma=gamma,
            drafter=drafter,
            skip=skip,
            draft_skip=draft_skip,
            tau_accept=ta,
            tau_escalate=te,
            kl=kl,
            recheck=recheck,
            draft_confidence=confidence,
            lookup_min=lookup_min if "+" in drafter else 1,  # the hybrids' only
        )
        results = decode(target, draft, cfg, ps)
        if any(r.token_ids != ref.output for r, ref in zip(results, cache.refs, strict=True)):
            assert not recheck  # recheck is lossless
            seen["lossy"] += 1
            # Exact only up to the first wrongly settled token (module doc): the replay says it is not exact.
            assert not replay.simulate(cache, cfg).exact
            continue
        est = check(cache, cfg, results)
        seen["recheck_rollback"] += est.rollbacks
        seen["slim"] += est.tiers[1]
        seen["direct"] += est.tiers[0]
        seen["confidence"] += confidence > 0
    # The grid exercised what it is for: slim and direct tokens, rollbacks under recheck, draft_confidence, and
    # rounds the arrays could not answer (computed for real).
    assert seen["slim"] and seen["direct"] and seen["recheck_rollback"], seen
    assert cache._real and (seen["confidence"] or drafter == "lookup"), seen


@pytest.mark.parametrize("drafter", ["model", "self", "lookup", "lookup+model", "lookup+self"])
def test_replay_matches_plain_sd(models, drafter: str) -> None:
    target, draft = models
    ps = prompts(4, seed=3)
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    draft_skip = SkipSet.of([1, 2], [1, 2]) if drafter.endswith("self") else SkipSet()
    confidences = [0.0] if drafter == "lookup" else [0.0, 0.5]  # prompt lookup has no confidence
    for mode, gamma, confidence in itertools.product(["sd", "viasd"], [1, 4, 7], confidences):
        cfg = DecodeConfig(
            mode=mode, gamma=gamma, drafter=drafter, draft_skip=draft_skip, draft_confidence=confidence
        )
        est = check(cache, cfg, decode(target, draft, cfg, ps))
        assert est.tiers[2] == est.tokens  # every token the full target's


def test_simulate_totals_and_estimate(models) -> None:
    target, draft = models
    ps = prompts(4, seed=5)
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    cfg = DecodeConfig(
        gamma=4, drafter="model", skip=SkipSet.of([1], [2]), tau_accept=0.5, tau_escalate=3.0, recheck=True
    )
    est = replay.simulate(cache, cfg)
    results = decode(target, draft, cfg, ps)
    assert est.outputs == [r.token_ids for r in results]
    assert est.tokens == sum(r.stats.new_tokens for r in results)
    assert est.fidelity == 1.0 and est.exact  # recheck: lossless
    full = sum(r.stats.full_calls for r in results)
    slim = sum(r.stats.slim_calls for r in results)
    assert est.acceptance == pytest.approx(replay.acceptance(est.tokens, full, slim, est.slim_cost))


def test_replay_matches_decoding_with_sliding_window_layers(one_thread) -> None:
    """Gemma-3's sliding layers trim their cache: the replay rebuilds a committed cache by a forward there."""
    target = tiny_model("gemma3", seed=4, layers=4)
    install_skipping(target)
    draft = noisy_copy(target, 0.3, seed=5)
    ps = [torch.tensor([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 9]), torch.tensor([30, 31, 30])]
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    assert cache.prompt(0).target.sliding
    for drafter, recheck in itertools.product(["model", "self"], [False, True]):
        cfg = DecodeConfig(
            gamma=4,
            drafter=drafter,
            skip=SkipSet.of([1], [2]),
            draft_skip=SkipSet.of([1, 2], [1, 2]) if drafter == "self" else SkipSet(),
            tau_accept=0.05,
            tau_escalate=1.0,
            recheck=recheck,
            draft_confidence=0.3,
        )
        results = decode(target, draft, cfg, ps)
        if recheck or all(r.token_ids == ref.output for r, ref in zip(results, cache.refs, strict=True)):
            check(cache, cfg, results)


def test_lossy_escalation_after_a_wrong_head_is_verified_like_a_cache_free_target(models) -> None:
    """Without recheck, the slim tier may settle a wrong token and a later draft of the same round escalate: the
    full target then verifies over that off-reference head. The replay computes that verdict over the cache it
    had before the verifying forward (it once used the cache after it: "nothing new to feed" on every lossy trial
    of the README's search); each verdict must equal a cache-free forward of the target."""
    target, draft = models
    ps = prompts(6, seed=11)
    cache = replay.ReplayCache(target, references(target, ps), draft, max_new_tokens=MAX_NEW, eos=EOS)
    verdicts = []
    original = replay._Run.verified

    def spy(self, tokens, start, c):
        m, last = original(self, tokens, start, c)
        if not self.on_reference(tokens[:start]):
            verdicts.append((list(tokens), start, m, last))
        return m, last

    replay._Run.verified = spy
    try:
        # tau_accept == tau_escalate: a draft is accepted directly or escalates (the tiny models' divergences are
        # small, hence the small thresholds); a heavily skipped self-draft is often wrong.
        for drafter, skip, tau, gamma in itertools.product(
            ["self", "model"], [SkipSet(), SkipSet.of([2], [])], [0.02, 0.05], [3, 5]
        ):
            cfg = DecodeConfig(
                gamma=gamma,
                drafter=drafter,
                skip=skip,
                draft_skip=SkipSet.of([1, 2], [1, 2]) if drafter == "self" else SkipSet(),
                tau_accept=tau,
                tau_escalate=tau,
            )
            replay.simulate(cache, cfg)
    finally:
        replay._Run.verified = original
    assert verdicts, "no round escalated after a wrongly settled head: the grid no longer covers the path"
    for tokens, start, m, last in verdicts:
        with torch.inference_mode():
            choice = target(torch.tensor([tokens])).logits[0].argmax(-1).tolist()  # predicts position j + 1
        expect = 0
        while start + expect < len(tokens) and tokens[start + expect] == choice[start + expect - 1]:
            expect += 1
        assert (m, last) == (expect, choice[start + expect - 1]), (tokens, start)


@pytest.mark.parametrize("drafter", ["model", "self"])
def test_replay_memory_is_bounded_and_eviction_changes_nothing(models, drafter: str) -> None:
    """A search replays many draft skip sets over one cache; full-vocabulary drafter logits and draft KV snapshots
    must not pile up (unbounded, 45 Qwen trials filled 24 GB), and what is evicted is recomputed to the same
    estimate as a fresh cache gives."""
    target, draft = models
    ps = prompts(3, seed=11)
    refs = references(target, ps)
    shared = replay.ReplayCache(target, refs, draft, max_new_tokens=MAX_NEW, eos=EOS)
    skips = [SkipSet.of(a, m) for a in ([], [0], [1], [3]) for m in ([], [2], [0, 3])]
    for draft_skip in skips + skips[:3]:  # the first ones again, after eviction
        cfg = DecodeConfig(
            gamma=3,
            drafter=drafter,
            draft_skip=draft_skip,
            skip=SkipSet.of([1], [2]),
            tau_accept=0.5,
            tau_escalate=3.0,
        )
        fresh = replay.ReplayCache(target, refs, draft, max_new_tokens=MAX_NEW, eos=EOS)
        a, b = replay.simulate(shared, cfg), replay.simulate(fresh, cfg)
        assert (a.outputs, a.tier_labels, a.calls) == (b.outputs, b.tier_labels, b.calls), draft_skip
        assert len(shared._draft_memo) <= replay.DRAFT_MEMO
        assert all(len(shared.prompt(i).drafts) <= replay.DRAFT_MEMO for i in range(len(ps)))

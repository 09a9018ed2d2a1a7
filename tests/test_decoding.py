"""Correctness of the three decoders on tiny random models (fp32, exact)."""

from __future__ import annotations

import random
import sys

import pytest
import torch
from conftest import VOCAB, noisy_copy, tiny_model

from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.common import DIRECT, FULL, SLIM, draft_budget
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.errors import UserError
from viasd_tune.routing import SkipSet

ARCHS = ["llama", "qwen2", "gemma3"]
N_NEW = 24
NEVER = sys.float_info.max  # a threshold no divergence reaches (thresholds must be finite)


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    """(target, model draft that mostly agrees with it)."""
    target = tiny_model(request.param, seed=0, layers=4)
    return target, noisy_copy(target, 0.1, seed=1)


def prompts(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, 20, (1,), generator=g))
        base = torch.randint(3, VOCAB, (length,), generator=g)
        # Repeat a chunk now and then so prompt lookup finds matches.
        out.append(torch.cat([base, base[: length // 2]]) if length % 2 else base)
    return out


def run(target, config: DecodeConfig, ids, draft=None, n=N_NEW, eos=frozenset(), **kw):
    return Decoder(target, None, config, draft=draft, eos=set(eos)).generate(ids, n, **kw)


def greedy_ar(target, ids, n=N_NEW, eos=frozenset()):
    return run(target, DecodeConfig(mode="ar"), ids, n=n, eos=eos).token_ids


def random_skip(rng: random.Random, layers: int = 4) -> SkipSet:
    return SkipSet.of(
        [i for i in range(layers) if rng.random() < 0.4], [i for i in range(1, layers) if rng.random() < 0.4]
    )


def test_ar_matches_transformers_generate(models):
    target, _ = models
    for ids in prompts(4, seed=10):
        ref = target.generate(ids[None], max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
        assert greedy_ar(target, ids) == ref[0, ids.numel() :].tolist()


@pytest.mark.parametrize("drafter", ["model", "self", "lookup"])
def test_sd_greedy_equals_ar(models, drafter):
    target, draft = models
    rng = random.Random(0)
    for i, ids in enumerate(prompts(6, seed=20)):
        gamma = rng.choice([1, 2, 3, 5, 8])
        draft_skip = SkipSet.of([1, 2], [2]) if drafter != "lookup" else SkipSet()  # lookup runs no model
        cfg = DecodeConfig(mode="sd", gamma=gamma, drafter=drafter, draft_skip=draft_skip)
        result = run(target, cfg, ids, draft=draft)
        assert result.token_ids == greedy_ar(target, ids), f"prompt {i}, gamma {gamma}"
        assert result.stats.tokens_full == result.stats.new_tokens == N_NEW


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_viasd_tau_escalate_zero_equals_ar(models, drafter):
    target, draft = models
    rng = random.Random(1)
    for ids in prompts(5, seed=30):
        cfg = DecodeConfig(
            mode="viasd",
            gamma=rng.choice([1, 3, 4, 6]),
            drafter=drafter,
            skip=random_skip(rng),
            tau_accept=0.0,
            tau_escalate=0.0,
            kl=rng.choice(["forward", "reverse", "js"]),
        )
        result = run(target, cfg, ids, draft=draft)
        assert result.token_ids == greedy_ar(target, ids)
        assert result.stats.tokens_full == N_NEW and result.stats.slim_calls == 0


@pytest.mark.parametrize("drafter", ["model", "self", "lookup"])
def test_viasd_empty_skip_is_the_target(models, drafter):
    """With no sub-layer skipped the slim verifier is the target, so (no direct accepts) output == ar."""
    target, draft = models
    rng = random.Random(2)
    slim = full = 0
    # Every τ_escalate on some prompt, NEVER (the slim verifier decides every drafted token) on two.
    taus = [0.01, 0.5, 3.0, NEVER, NEVER]
    for ids, tau_escalate in zip(prompts(5, seed=40), taus, strict=True):
        cfg = DecodeConfig(
            mode="viasd",
            gamma=rng.choice([2, 4, 5]),
            drafter=drafter,
            skip=SkipSet(),
            draft_skip=SkipSet.of([1, 2], [1, 2]) if drafter != "lookup" else SkipSet(),
            tau_accept=0.0,
            tau_escalate=tau_escalate,
            kl=rng.choice(["forward", "js"]),
        )
        result = run(target, cfg, ids, draft=draft)
        assert result.token_ids == greedy_ar(target, ids)
        s = result.stats
        assert s.tokens_direct == 0  # τ_accept = 0: no divergence is below it
        if tau_escalate == NEVER:  # nothing escalates: the slim tier decides, the target never does
            assert s.tokens_slim > 0
            assert s.full_calls == 0 or drafter == "lookup"  # (lookup drafts nothing without a match)
        slim, full = slim + s.tokens_slim, full + s.tokens_full
    assert slim > 0 and full > 0  # both tiers decided tokens, and the output is the target's either way


def test_viasd_infinite_thresholds_accept_every_draft(models):
    """τ_accept = τ_escalate = ∞: every draft token is accepted directly, so the output is the drafter's own
    greedy output, apart from the slim verifier's bonus token that closes each round."""
    target, draft = models
    for gamma in (1, 3, 6):
        for ids in prompts(3, seed=50 + gamma):
            cfg = DecodeConfig(
                mode="viasd",
                gamma=gamma,
                skip=SkipSet.of([1], [2]),
                tau_accept=NEVER,
                tau_escalate=NEVER,
            )
            result = run(target, cfg, ids, draft=draft)
            s = result.stats
            assert s.full_calls == 0 and s.tokens_full == 0
            assert s.tokens_direct == sum(1 for t in result.tiers if t == DIRECT)
            # Each round's last token is the slim bonus, the others the drafter's greedy continuation; a round
            # drafts γ, or what max_new_tokens leaves besides the bonus (draft_budget).
            bonus, produced = set(), 0
            while produced < N_NEW:
                produced += draft_budget(gamma, N_NEW, produced) + 1
                bonus.add(produced - 1)
            seq = ids.tolist()
            for pos, (tok, tier) in enumerate(zip(result.token_ids, result.tiers, strict=True)):
                if pos not in bonus:
                    assert tier == DIRECT
                    assert tok == greedy_ar(draft, torch.tensor(seq), n=1)[0]
                else:
                    assert tier == SLIM
                seq.append(tok)


def test_tier_counts_and_stats_add_up(models):
    target, draft = models
    rng = random.Random(3)
    for ids in prompts(8, seed=60):
        cfg = DecodeConfig(
            mode="viasd",
            gamma=rng.randint(1, 6),
            drafter=rng.choice(["model", "lookup"]),
            skip=random_skip(rng),
            tau_accept=rng.choice([0.0, 0.05, 0.3]),
            tau_escalate=rng.choice([0.3, 1.0, 5.0]),
            kl=rng.choice(["forward", "reverse", "js"]),
        )
        n = rng.randint(1, 30)
        result = run(target, cfg, ids, draft=draft, n=n)
        s = result.stats
        assert s.new_tokens == len(result.token_ids) == n
        assert s.tokens_direct + s.tokens_slim + s.tokens_full == n
        assert [s.tokens_direct, s.tokens_slim, s.tokens_full] == [
            result.tiers.count(t) for t in (DIRECT, SLIM, FULL)
        ]
        assert min(s.to_dict().values()) >= 0
        assert s.full_calls <= s.rounds and s.slim_calls <= s.rounds
        assert s.full_tokens_processed >= s.full_calls
        # A round ends with exactly one slim- or full-decided token, so each round has at least one of them.
        assert s.tokens_slim + s.tokens_full >= s.rounds - 1


@pytest.mark.parametrize("mode", ["sd", "viasd"])
def test_eos_and_max_new_tokens_stop_mid_round(models, mode):
    target, draft = models
    for ids in prompts(4, seed=70):
        ref = greedy_ar(target, ids, n=30)
        eos = ref[13]  # a token the target emits at position 13 (maybe earlier too)
        stop = ref.index(eos)
        skip = SkipSet.of([2], [1]) if mode == "viasd" else SkipSet()  # sd has no slim verifier
        cfg = DecodeConfig(mode=mode, gamma=5, skip=skip, tau_accept=0.0, tau_escalate=0.0)
        assert run(target, cfg, ids, draft=draft, n=30, eos={eos}).token_ids == ref[: stop + 1]
        assert greedy_ar(target, ids, n=30, eos={eos}) == ref[: stop + 1]
        for n in (1, 7, 11):  # max-new-tokens inside a round of 5 drafts
            assert run(target, cfg, ids, draft=draft, n=n).token_ids == ref[:n]


def test_bad_configs_are_refused(models):
    target, draft = models
    ids = prompts(1, seed=80)[0]
    bad = [  # refused where they are built (fields) or by the decoder (the model's layer count)
        lambda: DecodeConfig(mode="viasd", gamma=0),
        lambda: DecodeConfig(mode="viasd", tau_accept=2.0, tau_escalate=1.0),
        lambda: DecodeConfig(mode="viasd", tau_accept=-1.0, tau_escalate=1.0),
        lambda: DecodeConfig(mode="viasd", skip=SkipSet.of([4])),
        lambda: DecodeConfig(mode="viasd", skip=SkipSet.of(range(4), range(4)), tau_escalate=1.0),
        lambda: DecodeConfig(mode="viasd", kl="sideways"),
        lambda: DecodeConfig(mode="sd", drafter="self"),
        lambda: DecodeConfig(mode="warp"),
        lambda: DecodeConfig(mode="sd", draft_skip=SkipSet.of([4])),  # the draft model has 4 layers
    ]
    for make in bad:
        with pytest.raises(UserError) as err:
            run(target, make(), ids, draft=draft)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError):
        run(target, DecodeConfig(mode="sd"), ids)  # drafter 'model' without a draft model


def test_rounds_draft_no_more_than_max_new_tokens_leaves(models):
    """A draft past max_new_tokens would be cut after costing its forwards (a γ-20 draft ran 48 draft forwards
    where HF's assisted generation ran 22 over 24 new tokens): with the target as its own draft, one round of
    γ 20 emits all 5 tokens and drafts 4 of them; a lossless mode still equals greedy."""
    target, _ = models
    for ids in prompts(3, seed=80):
        for mode in ("sd", "viasd"):
            cfg = DecodeConfig(mode=mode, gamma=20, drafter="model")  # viasd: τ 0, so every token is verified
            result = run(target, cfg, ids, draft=target, n=5)
            assert result.token_ids == greedy_ar(target, ids, n=5)
            assert (result.stats.rounds, result.stats.drafted) == (1, 4)
    assert [draft_budget(4, 24, p) for p in (0, 19, 20, 22, 23)] == [4, 4, 3, 1, 1]

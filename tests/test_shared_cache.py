"""The target's one KV cache, shared by the full pass, the slim verifier and the self-draft.

- a skip pass over the shared cache gives the logits of a reference built by hand (the full model's KV of the
  committed prefix in a plain transformers cache, then a skipped forward over the rest);
- during decoding, after every round, the committed entries equal a cache-free recompute of the prefix;
- every token labelled FULL is the target's greedy choice given the emitted prefix, whatever the routing;
- the slim verifier never processes the prompt, and Gemma-3's sliding layers stay bounded by the window.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import VOCAB, logits_over_committed, noisy_copy, tiny_model, valid_config
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from viasd_tune.config import DecodeConfig
from viasd_tune.decoding import ar, common, sd, viasd
from viasd_tune.decoding.common import FULL, CachedLM
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.routing import SkipSet

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: many tiny forwards, one thread

ATOL = 1e-4
LAYERS = 4
WINDOW = 16  # conftest's tiny Gemma-3 sliding window
ARCHS = ("llama", "qwen2", "gemma3")
_targets = {arch: tiny_model(arch, seed=30 + i, layers=LAYERS) for i, arch in enumerate(ARCHS)}
MODELS = {arch: (t, noisy_copy(t, 0.15, seed=40 + i)) for i, (arch, t) in enumerate(_targets.items())}
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None, print_blob=True)
INF = sys.float_info.max  # thresholds are finite; no finite divergence reaches this


skip_sets = st.builds(
    SkipSet.of, st.sets(st.integers(0, LAYERS - 1), max_size=3), st.sets(st.integers(0, LAYERS - 1), max_size=3)
)


@torch.inference_mode()
def full_kv(model, seq: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([seq]), cache=cache, use_cache=True)
    return [(lay.keys, lay.values) for lay in cache.layers]


def check_committed(full: CachedLM, tokens: list[int]) -> None:
    """The committed entries of every layer equal those of a cache-free full forward of that prefix."""
    c = full.committed
    assert c <= len(tokens) - 1, "the full target committed a token the sequence does not hold"
    if c == 0:
        return
    for i, (lay, (k_ref, v_ref)) in enumerate(zip(full.cache.layers, full_kv(full.model, tokens[:c]), strict=True)):
        assert lay.get_seq_length() >= c, f"layer {i} lost committed entries"
        held = lay.keys.shape[-2]
        n = min(c, WINDOW - 1) if lay.is_sliding else c
        end = held - (lay.get_seq_length() - c)  # stored index of position c
        assert end >= n, f"layer {i}: {end} committed positions kept, {n} needed"
        for name, mine, ref in (("keys", lay.keys, k_ref), ("values", lay.values, v_ref)):
            torch.testing.assert_close(
                mine[..., end - n : end, :], ref[..., -n:, :], atol=ATOL, rtol=0, msg=f"layer {i} {name}"
            )
        if lay.is_sliding:  # bounded: the window, plus what the tiers settled since the last full pass
            assert held <= WINDOW - 1 + (lay.get_seq_length() - c) + max(0, len(tokens) - 1 - c)


@pytest.fixture(scope="module")
def checked_rounds():
    """Run ``check_committed`` before every round (i.e. after the previous round's rollback) and at the end."""
    original = common.run_rounds

    def run_rounds(round_fn, seq, max_new_tokens, eos_ids, full, drafter=None, flush=None, **kw):
        def checked(s):
            check_committed(full, s.tokens)
            return round_fn(s)

        result = original(checked, seq, max_new_tokens, eos_ids, full, drafter, flush, **kw)
        full.rollback(seq.length - 1)
        check_committed(full, seq.tokens)
        return result

    with pytest.MonkeyPatch.context() as mp:
        for module in (ar, sd, viasd):
            mp.setattr(module, "run_rounds", run_rounds)
        yield


@st.composite
def configs(draw) -> DecodeConfig:
    a, b = sorted(draw(st.lists(st.sampled_from([0.0, 0.05, 0.5, 2.0, INF]), min_size=2, max_size=2)))
    return valid_config(
        mode=draw(st.sampled_from(["ar", "sd", "viasd", "viasd"])),
        gamma=draw(st.integers(1, 5)),
        drafter=draw(st.sampled_from(["model", "self", "lookup"])),
        draft_skip=draw(skip_sets.filter(lambda s: not s.is_empty)),
        skip=draw(skip_sets),
        tau_accept=a,
        tau_escalate=b,
        kl=draw(st.sampled_from(["forward", "reverse", "js"])),
        recheck=draw(st.booleans()),
        draft_confidence=draw(st.sampled_from([0.0, 0.5])),
    )


@SETTINGS
@given(
    arch=st.sampled_from(ARCHS),
    prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=24),
    config=configs(),
    n=st.integers(1, 24),
)
def test_committed_cache_equals_recompute_after_every_round(checked_rounds, arch, prompt, config, n):
    target, draft = MODELS[arch]
    result = Decoder(target, None, config, draft=draft, eos=set()).generate(prompt, n)
    assert len(result.token_ids) == n


@SETTINGS
@given(
    arch=st.sampled_from(ARCHS),
    prompt=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=16),
    config=configs(),
    n=st.integers(1, 16),
)
@torch.inference_mode()
def test_full_tokens_are_the_targets_greedy_choice(arch, prompt, config, n):
    """Lossy or not, a token the full target decided is its argmax given what was emitted before it."""
    target, draft = MODELS[arch]
    result = Decoder(target, None, config, draft=draft, eos=set()).generate(prompt, n)
    seq = prompt + result.token_ids
    choice = target(input_ids=torch.tensor([seq])).logits[0].argmax(-1)
    for i, tier in enumerate(result.tiers):
        if tier == FULL:
            pos = len(prompt) + i
            assert seq[pos] == int(choice[pos - 1]), f"FULL token {i} is not the target's choice"


@SETTINGS
@given(
    arch=st.sampled_from(ARCHS),
    seq=st.lists(st.integers(3, VOCAB - 1), min_size=4, max_size=30),
    skip=skip_sets,
    data=st.data(),
)
@torch.inference_mode()
def test_skip_pass_over_shared_cache_matches_hand_built_reference(arch, seq, skip, data):
    target, _ = MODELS[arch]
    committed = data.draw(st.integers(1, len(seq) - 2))
    middle = data.draw(st.integers(committed + 1, len(seq) - 1))
    lm = CachedLM(target)
    lm.forward(torch.tensor(seq[:committed]))
    # A first skip pass, then a second that reads the first's speculative entries and feeds only what is new.
    first = lm.speculate(torch.tensor(seq[:middle]), skip, tier="slim")
    torch.testing.assert_close(first, logits_over_committed(target, seq[:middle], committed, skip), atol=ATOL, rtol=0)
    second = lm.speculate(torch.tensor(seq), skip, tier="slim", keep=len(seq) - middle)
    torch.testing.assert_close(second, logits_over_committed(target, seq, committed, skip)[middle - committed :], atol=ATOL, rtol=0)
    assert lm.stats.slim_tokens_processed == len(seq) - committed  # each position once
    # The full pass ignores what the skip passes wrote: it gives the cache-free logits.
    full = lm.forward(torch.tensor(seq), keep=len(seq) - committed)
    torch.testing.assert_close(full, logits_over_committed(target, seq, committed, SkipSet()), atol=ATOL, rtol=0)
    assert lm.committed == len(seq)


def test_slim_tier_never_processes_the_prompt():
    target, draft = MODELS["qwen2"]
    prompt = [(5 * i) % (VOCAB - 3) + 3 for i in range(300)]
    config = DecodeConfig(mode="viasd", gamma=4, skip=SkipSet.of([1], [2]), tau_accept=0.0, tau_escalate=2.0)
    stats = Decoder(target, None, config, draft=draft, eos=set()).generate(prompt, 20).stats
    assert stats.prefill_tokens_processed == len(prompt) - 1 and stats.prefill_calls == 1
    assert 0 < stats.slim_tokens_processed <= stats.slim_calls * (config.gamma + 1)
    assert stats.full_tokens_processed < 20 * (config.gamma + 1)  # the target, too, reads the prompt once


def test_gemma_sliding_layers_stay_bounded_over_a_long_generation(checked_rounds):
    """160 tokens through a window of 16, every tier taking turns: check_committed bounds every sliding layer."""
    target, draft = MODELS["gemma3"]
    for recheck in (False, True):
        config = DecodeConfig(
            mode="viasd", gamma=3, skip=SkipSet.of([1], [0]), tau_accept=0.3, tau_escalate=0.5, recheck=recheck
        )
        result = Decoder(target, None, config, draft=draft, eos=set()).generate([5, 9, 11], 160)
        assert len(result.token_ids) == 160
        assert len(set(result.tiers)) == 3, "the run should exercise all three tiers"

"""KV-cache bookkeeping of CachedLM / SkipAwareCache against a cache-free recompute.

A CachedLM is fed a sequence in chunks, rolled back by random amounts and fed different continuations. After
every step its logits must equal a cache-free forward of the whole sequence under the same skip set, and the
cached keys/values must equal those of a fresh CachedLM that saw the same prefix in one go.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from conftest import VOCAB, tiny_model
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from viasd_tune.decoding.common import CachedLM
from viasd_tune.routing import SkipSet, skipping

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: many tiny forwards, one thread

ATOL = 1e-4
WINDOW = 16  # conftest's tiny Gemma-3 sliding window


def gemma3_mixed(seed: int = 4):
    """A tiny Gemma-3 with two full-attention layers (1 and 3) between sliding ones, so that skipping the first
    full-attention layer leaves another one to size the full-attention mask from."""
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=WINDOW,
        query_pre_attn_scalar=8,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


_MODELS: dict[str, torch.nn.Module] = {}


def get_model(name: str):
    if name not in _MODELS:
        if name == "gemma3-mixed":
            _MODELS[name] = gemma3_mixed()
        elif name == "gemma3":
            # Default Gemma-3 pattern: five sliding layers, then one full-attention layer (index 5).
            _MODELS[name] = tiny_model("gemma3", seed=3, layers=6)
        else:
            _MODELS[name] = tiny_model(name, seed=2, layers=4)
    return _MODELS[name]


CASES = [
    ("llama", SkipSet()),
    ("llama", SkipSet.of([0])),  # layer 0's attention sizes the masks in transformers
    ("llama", SkipSet.of([0, 2], [1, 3])),
    ("llama", SkipSet.of(range(4), [0])),  # no attention at all: the cache stays empty
    ("qwen2", SkipSet()),
    ("qwen2", SkipSet.of([0], [0])),
    ("qwen2", SkipSet.of([1, 3], [2])),
    ("gemma3", SkipSet()),
    ("gemma3", SkipSet.of([0])),  # first sliding layer
    ("gemma3", SkipSet.of([5], [2])),  # the only full-attention layer
    ("gemma3", SkipSet.of([0, 1, 2, 3, 4])),  # every sliding layer
    ("gemma3-mixed", SkipSet()),
    ("gemma3-mixed", SkipSet.of([1])),  # first full-attention layer: layer 3 must size the full mask
    ("gemma3-mixed", SkipSet.of([0, 1], [4])),  # first sliding and first full-attention layer
]


def case_id(case) -> str:
    arch, skip = case
    return f"{arch}-a{''.join(map(str, sorted(skip.attn)))}-m{''.join(map(str, sorted(skip.mlp)))}"


def reference_logits(model, seq: list[int], skip: SkipSet) -> torch.Tensor:
    """Cache-free forward of the whole sequence under ``skip``: logits at every position."""
    with skipping(model, skip):
        return model(input_ids=torch.tensor([seq])).logits[0].float()


def attention_layers(model, skip: SkipSet) -> list[int]:
    return [i for i in range(model.config.num_hidden_layers) if i not in skip.attn]


def is_sliding(model, i: int) -> bool:
    types = getattr(model.config, "layer_types", None)
    return types is not None and types[i] == "sliding_attention"


def check_cache_matches_fresh(model, skip: SkipSet, lm: CachedLM, seq: list[int]) -> None:
    """``lm``'s cached keys/values equal those of a fresh CachedLM that read ``seq[:lm.seen]`` in one go."""
    assert lm.seen <= len(seq)
    fresh = CachedLM(model, skip)
    fresh.forward(torch.tensor(seq[: lm.seen]))
    for i, (mine, ref) in enumerate(zip(lm.cache.layers, fresh.cache.layers, strict=True)):
        if i in skip.attn:
            # A skipped attention never touches the cache.
            assert not mine.is_initialized, f"layer {i}: skipped attention wrote to the cache"
            continue
        assert lm.cache.get_seq_length(i) == lm.seen, f"layer {i}"
        for name in ("keys", "values"):
            a, b = getattr(mine, name), getattr(ref, name)
            if is_sliding(model, i):
                # A sliding layer needs (and after a crop only keeps) the last window-1 positions.
                n = min(lm.seen, WINDOW - 1)
                assert a.shape[-2] >= n, f"layer {i} {name}: {a.shape[-2]} positions cached, need {n}"
                a, b = a[..., a.shape[-2] - n :, :], b[..., b.shape[-2] - n :, :]
            else:
                assert a.shape[-2] == lm.seen, f"layer {i} {name}: {a.shape[-2]} positions, seen {lm.seen}"
            torch.testing.assert_close(
                a, b, atol=ATOL, rtol=0, msg=lambda m, i=i, n=name: f"layer {i} {n}: {m}"
            )
    if attention_layers(
        model, skip
    ):  # with no attention at all nothing is cached, and nothing needs a length
        assert lm.cache.get_seq_length() == lm.seen  # what transformers reads when no position_ids are given


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@torch.inference_mode()
def test_rollback_matches_cache_free_recompute(case):
    arch, skip = case
    model = get_model(arch)
    rng = random.Random(zlib.crc32(case_id(case).encode()))
    lm = CachedLM(model, skip)
    seq = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
    fed_since_crop = 0  # tokens fed since the last rollback: the decoders never roll back past one
    max_len = 0
    for step in range(14):
        # Feed a chunk: the first few rounds grow the sequence past the sliding window.
        chunk = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 7 if step < 6 else 4))]
        old = lm.seen
        seq = seq + chunk
        keep = rng.choice([None, 1, len(seq) - old])
        logits = lm.forward(torch.tensor(seq), keep=keep)
        n_new = len(seq) - old
        assert lm.seen == len(seq)
        assert logits.shape == (keep or n_new, VOCAB)
        ref = reference_logits(model, seq, skip)
        torch.testing.assert_close(logits, ref[len(seq) - (keep or n_new) :], atol=ATOL, rtol=0)
        fed_since_crop += n_new
        max_len = max(max_len, len(seq))
        check_cache_matches_fresh(model, skip, lm, seq)

        # Roll back by a random amount within what was fed since the last rollback (0 included), as the decoders do.
        back = rng.choice([0, rng.randint(0, fed_since_crop)])
        lm.rollback(lm.seen - back)
        assert lm.seen == len(seq) - back
        fed_since_crop = 0
        for i, lay in enumerate(lm.cache.layers):  # bounded by the window however long the sequence grows
            if is_sliding(model, i) and lay.is_initialized:
                assert lay.keys.shape[-2] <= WINDOW - 1, f"layer {i} keeps {lay.keys.shape[-2]} positions"
        if back:
            seq = seq[: lm.seen]
            check_cache_matches_fresh(model, skip, lm, seq)
            # The next forward feeds only the tokens after the rollback point, which may differ from before.
            if rng.random() < 0.5:
                seq = seq + [rng.randrange(3, VOCAB)]
                logits = lm.forward(torch.tensor(seq), keep=1)
                ref = reference_logits(model, seq, skip)
                torch.testing.assert_close(logits, ref[-1:], atol=ATOL, rtol=0)
                fed_since_crop = 1
                check_cache_matches_fresh(model, skip, lm, seq)
    assert max_len > WINDOW + 4, "the sequence never left the sliding window"


@pytest.mark.parametrize("arch", ["llama", "gemma3", "gemma3-mixed"])
@torch.inference_mode()
def test_rollback_at_or_past_seen_only_trims_to_the_window(arch):
    model = get_model(arch)
    skip = SkipSet.of([0])
    seq = [(7 * i) % (VOCAB - 3) + 3 for i in range(WINDOW + 9)]
    lm = CachedLM(model, skip)
    lm.forward(torch.tensor(seq))
    before = [
        (lay.keys.clone(), lay.values.clone()) if lay.is_initialized else None for lay in lm.cache.layers
    ]
    for length in (len(seq), len(seq) + 1, len(seq) + 50):
        lm.rollback(length)
        assert lm.seen == len(seq)
    for i, (lay, kv) in enumerate(zip(lm.cache.layers, before, strict=True)):
        if kv is None:
            assert not lay.is_initialized
        elif is_sliding(model, i):  # only trimmed to the window: the positions it keeps are untouched
            n = lay.keys.shape[-2]
            assert n == WINDOW - 1
            assert torch.equal(lay.keys, kv[0][..., -n:, :]) and torch.equal(lay.values, kv[1][..., -n:, :])
        else:
            assert torch.equal(lay.keys, kv[0]) and torch.equal(lay.values, kv[1])
    # Still consistent: one more token gives the cache-free logits.
    seq.append(5)
    torch.testing.assert_close(
        lm.forward(torch.tensor(seq), keep=1), reference_logits(model, seq, skip)[-1:], atol=ATOL, rtol=0
    )


@torch.inference_mode()
def test_seen_tracks_length_and_forward_needs_new_tokens():
    model = get_model("qwen2")
    lm = CachedLM(model, SkipSet.of([1], [2]))
    assert lm.seen == 0
    seq = torch.arange(3, 3 + 20)
    lm.forward(seq[:5])
    assert lm.seen == 5 and lm.cache.get_seq_length() == 5
    lm.forward(seq[:12])
    assert lm.seen == 12 and lm.cache.get_seq_length() == 12
    lm.rollback(9)
    assert lm.seen == 9 and lm.cache.get_seq_length() == 9
    assert lm.stats.full_calls == 2 and lm.stats.full_tokens_processed == 12
    with pytest.raises(AssertionError):
        lm.forward(seq[:9])  # nothing new to feed
    lm.rollback(0)
    assert lm.seen == 0 and lm.cache.get_seq_length() == 0
    torch.testing.assert_close(
        lm.forward(seq[:4]), reference_logits(model, seq[:4].tolist(), lm.skip), atol=ATOL, rtol=0
    )


@torch.inference_mode()
def test_cache_length_when_no_sliding_attention_runs():
    """Regression: SkipAwareCache.get_seq_length() used to return 0 when every sliding layer's attention was
    skipped, so a forward without explicit position_ids restarted positions at 0."""
    model = get_model("gemma3")  # layers 0-4 sliding, 5 full
    skip = SkipSet.of([0, 1, 2, 3, 4])
    seq = list(range(3, 13))
    lm = CachedLM(model, skip)
    lm.forward(torch.tensor(seq[:9]))
    assert lm.cache.get_seq_length(5) == 9  # the running full-attention layer has all 9 tokens
    # transformers' own default path (no position_ids: positions start at cache.get_seq_length())
    with skipping(model, skip):
        out = model(input_ids=torch.tensor([seq[9:10]]), cache=lm.cache, use_cache=True).logits[0].float()
    torch.testing.assert_close(out, reference_logits(model, seq, skip)[-1:], atol=ATOL, rtol=0)


def test_a_transformers_release_known_to_decode_wrongly_is_refused_in_one_line() -> None:
    """transformers 5.17-5.23 gave plain SD tokens unlike greedy decoding through the shared cache."""
    import pytest

    from viasd_tune.errors import UserError
    from viasd_tune.routing import check_transformers

    with pytest.raises(UserError, match=r"transformers 5\.17\.0 is too old .*needs >= 5\.24") as e:
        check_transformers("5.17.0")
    assert "\n" not in str(e.value) and "pip install -U 'transformers>=5.24,<6'" in str(e.value)
    check_transformers("5.24.0")
    check_transformers("5.25.0.dev0")

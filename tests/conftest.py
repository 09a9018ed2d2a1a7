"""Tiny random models built from a config: fast, exact (fp32) and offline."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config

from viasd_tune.decoding.common import CachedLM

VOCAB = 96


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 4, vocab: int = VOCAB, hidden: int = 32):
    """A random causal LM with `layers` decoder layers, fp32, eval mode, on CPU."""
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "gemma3":
        config = Gemma3TextConfig(**common, head_dim=8, sliding_window=16, query_pre_attn_scalar=8)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits; scale the head so distributions are peaked like a real LM's.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="session")
def llama_pair():
    """(target, draft): two different random Llamas sharing a vocabulary."""
    return tiny_model("llama", seed=0, layers=4), tiny_model("llama", seed=1, layers=2)


@pytest.fixture(scope="session")
def qwen_pair():
    return tiny_model("qwen2", seed=2, layers=4), tiny_model("qwen2", seed=3, layers=2)


def valid_config(**fields):
    """A DecodeConfig from drawn fields, without the ones that do nothing in its mode and drafter (DecodeConfig
    refuses those: e.g. a drawn draft skip set when the drawn drafter is prompt lookup)."""
    from viasd_tune.config import DecodeConfig, applies

    mode, drafter = fields.get("mode", "viasd"), fields.get("drafter", "model")
    return DecodeConfig(**{k: v for k, v in fields.items() if applies(k, mode, drafter)})


def noisy_copy(model, scale: float = 0.1, seed: int = 0):
    """A draft that mostly agrees with ``model``: its weights plus relative Gaussian noise."""
    import copy

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft.eval()


def char_tokenizer():
    """A character-level tokenizer whose ids fit the tiny models' vocabulary (0 pad, 1 bos, 2 eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 32 + VOCAB - 4)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Saved tiny target and draft (Llama, same tokenizer) as local model directories."""
    root = tmp_path_factory.mktemp("tiny")
    target = tiny_model("llama", seed=0, layers=4)
    draft = noisy_copy(target, 0.1, seed=1)
    tok = char_tokenizer()
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
        paths.append(str(root / name))
    return tuple(paths)


@pytest.fixture(scope="module")
def one_thread():
    """Many tiny forwards gain nothing from threads, and thread hand-offs dominate on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@torch.inference_mode()
def logits_over_committed(model, seq: list[int], committed: int, skip=None) -> torch.Tensor:
    """Logits at the positions after ``committed`` of a pass under ``skip`` that reads the full model's KV of
    ``seq[:committed]``: what the slim verifier or self-draft computes over the target's cache, built by hand
    with a plain transformers cache."""
    from transformers import DynamicCache

    from viasd_tune.routing import skipping

    cache = DynamicCache(config=model.config)
    if committed:
        model(input_ids=torch.tensor([seq[:committed]]), cache=cache, use_cache=True)
    with skipping(model, skip):
        out = model(
            input_ids=torch.tensor([seq[committed:]]),
            position_ids=torch.arange(committed, len(seq))[None],
            cache=cache,
            use_cache=True,
        )
    return out.logits[0].float()


class _PricedLM(CachedLM):
    """The engine's own LM whose clock reads the cost model's price of each pass it runs (model, tokens fed, skip
    set) instead of the time the pass took. Decoding then "measures" exactly what the replay should model, so a
    test compares the two to rounding on any host; comparing the fit with a later timing failed on a different
    CI CPU (the self-draft tier modelled 0.45x its timing there)."""

    def __init__(self, model, *args, cost, target, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.cost, self.is_target = cost, model is target

    def _price(self, tokens: int, skip) -> float:
        if self.is_target:
            return self.cost.target_time(tokens, skip)
        return self.cost.draft_time(tokens, skip)

    def _logits(self, ids, start, skip, keep):
        logits, _ = super()._logits(ids, start, skip, keep)
        return logits, self._price(ids.numel() - start, self.skip if skip is None else skip)

    def _tree_logits(self, ids, tree, base, fed):
        logits, _ = super()._tree_logits(ids, tree, base, fed)
        return logits, self._price(ids.numel() - base + tree.n - fed, self.skip)


def priced_lm(cost, target):
    """A ``Decoder(lm=…)`` factory of LMs timed by ``cost`` (a fitted ``CostModel``) over ``target``'s passes."""
    return functools.partial(_PricedLM, cost=cost, target=target)

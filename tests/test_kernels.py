"""Packed bf16 linear weights (kernels.py): bit-identical output to PyTorch's own kernels, so decoding emits the
same tokens packed or stock; stock inside ``kernels.stock`` (the bench's HF methods); left stock where it does
not apply (fp32, autograd, short memory, a shape whose packed output differs)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from torch import nn

from viasd_tune import kernels
from viasd_tune.bench.methods import BASELINE, Method, Runner
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.models import LoadedModel
from viasd_tune.routing import SkipSet, install_skipping

pytestmark = pytest.mark.skipif(not kernels._available(), reason="this torch build has no oneDNN")


def bf16_model(arch: str = "llama", seed: int = 0, hidden: int = 64):
    return tiny_model(arch, seed=seed, layers=3, hidden=hidden).to(torch.bfloat16)


def linears(model) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_packed_logits_equal_stock_bit_for_bit(arch) -> None:
    model = bf16_model(arch)
    assert kernels.pack_linears(model) == len(linears(model)) and kernels.is_packed(model)
    ids = torch.randint(3, 90, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for block in (ids[:, :1], ids):  # one token and a block
            packed = model(block).logits
            with kernels.stock(model):
                plain = model(block).logits
            assert torch.equal(packed, plain)
    assert all("forward" in m.__dict__ for m in linears(model))  # packed again after the stock block


@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig(mode="ar"),
        DecodeConfig(mode="sd", drafter="lookup+recycle", gamma=4, tree_nodes=8),
        DecodeConfig(
            gamma=3,
            drafter="self",
            draft_skip=SkipSet.of([1], [1]),
            skip=SkipSet.of([2], []),
            tau_accept=0.5,
            tau_escalate=3.0,
        ),
    ],
    ids=["ar", "tree", "viasd"],
)
def test_decoding_emits_the_same_tokens_packed_or_stock(cfg) -> None:
    model = bf16_model(seed=3)
    install_skipping(model)
    kernels.pack_linears(model)
    gen = torch.Generator().manual_seed(5)
    for n in (5, 17, 40):
        prompt = torch.randint(3, 90, (n,), generator=gen)
        packed = Decoder(model, None, cfg, eos=set()).generate(prompt, 24).token_ids
        with kernels.stock(model):
            plain = Decoder(model, None, cfg, eos=set()).generate(prompt, 24).token_ids
        assert packed == plain


def test_packed_forward_runs_the_packed_op(monkeypatch) -> None:
    """The speed comes from the packed op: with it broken, a packed model's forward fails and a stock one's
    does not (so the equality tests above compare two different kernels)."""
    model = bf16_model()
    kernels.pack_linears(model)
    monkeypatch.setattr(kernels, "_packed_linear", lambda *a: (_ for _ in ()).throw(RuntimeError("packed")))
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="packed"):
            model(torch.tensor([[5, 6, 7]]))
        with kernels.stock(model):
            model(torch.tensor([[5, 6, 7]]))


def test_not_packed_where_it_does_not_apply(monkeypatch) -> None:
    assert kernels.pack_linears(tiny_model("llama", layers=2)) == 0  # fp32 is never packed (MKL sums in another order than oneDNN)
    assert kernels.pack_linears(bf16_model(), memory=10) == 0  # the packed copies would not fit
    monkeypatch.setattr(kernels, "_same_output", lambda mod, packed: mod.out_features != 96)
    model = bf16_model()
    assert kernels.pack_linears(model) == len(linears(model)) - 1  # the 96-token head differs: left stock
    assert "forward" not in model.lm_head.__dict__
    assert kernels.pack_linears(model) == 0  # packing twice is a no-op


def test_autograd_runs_stock() -> None:
    """The packed op has no backward: with grad enabled a packed model computes (and differentiates) stock."""
    model = bf16_model()
    kernels.pack_linears(model)
    loss = model(torch.tensor([[5, 6, 7]])).logits.float().sum()
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_the_bench_runs_hf_generate_on_stock_kernels(monkeypatch) -> None:
    """HF baselines are what a user's own ``generate`` gets: no packed call while the bench times them."""
    model = bf16_model()
    kernels.pack_linears(model)
    calls = []
    real = kernels._packed_linear
    monkeypatch.setattr(kernels, "_packed_linear", lambda *a: calls.append(1) or real(*a))
    runner = Runner(LoadedModel(model, None, "tiny", {}), None, {2})
    runner.hf_kwargs["pad_token_id"] = 0
    try:
        out, seconds = runner._hf(Method(BASELINE, "hf"), torch.tensor([5, 6, 7, 8]), 6)
    finally:
        runner.close()
    assert len(out) == 6 and seconds > 0 and not calls
    Decoder(model, None, DecodeConfig(mode="ar"), eos=set()).generate(torch.tensor([5, 6, 7, 8]), 6)
    assert calls  # and ours runs packed

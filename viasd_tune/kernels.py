"""bf16 linear layers on the CPU with their weights packed once, at load, into oneDNN's blocked layout.

PyTorch's CPU ``F.linear`` in bf16 hands oneDNN a plain row-major weight on every call. Packing it once
(``torch.ops.mkldnn._reorder_linear_weight``, the op inductor's freezing pass uses) and calling the packed matmul
gives the same output bit for bit, faster: on Qwen2.5-Coder-1.5B on an AVX-512-bf16 host one decode step runs
1.8x and a 17-token verify block 1.6x faster (``benchmarks/bench_kernels.py``; report in
``benchmarks/results/kernels-avx512bf16.md``). Bit-identical output
is checked for every weight shape when packing, and a shape whose packed output differs stays stock, so decoding
emits the same tokens either way.

The packed copy sits beside the weight (the weight stays: tied embeddings and stock calls read it), so a
packed model holds its linear weights twice; packing is skipped, with a log line, where memory is short. It
snapshots the weights: a model whose weights change afterwards must be packed again. HF ``generate`` baselines
run on the stock kernels (:func:`stock`), as a user's own ``generate`` would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
PACKED = "_viasd_packed_weight"  # the packed copy, a plain attribute: not a parameter, buffer or state-dict entry


def _available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` over the packed weight; stock where the packed op does not apply (another device or
    dtype) or autograd records (the packed op has no backward)."""
    if x.device.type != "cpu" or x.dtype != torch.bfloat16 or torch.is_grad_enabled():
        return F.linear(x, self.weight, self.bias)
    return _packed_linear(x, getattr(self, PACKED), self.bias)


def _same_output(mod: nn.Linear, packed: torch.Tensor) -> bool:
    """Whether the packed matmul returns exactly the stock one's output: one token, a verify block, a prefill."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 7, 64):
            x = torch.randn(1, rows, mod.in_features, generator=gen).to(torch.bfloat16)
            if not torch.equal(_packed_linear(x, packed, mod.bias), F.linear(x, mod.weight, mod.bias)):
                return False
    return True


def pack_linears(model: nn.Module, memory: int | None = None) -> int:
    """Pack every bf16 ``nn.Linear`` of a CPU model whose packed output equals the stock one bit for bit;
    returns how many were packed (0 off the CPU, in other dtypes, without oneDNN, or when the packed copies
    would take more than ``memory`` bytes)."""
    linears = [
        m
        for m in model.modules()
        if isinstance(m, nn.Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.bfloat16
        and PACKED not in m.__dict__
    ]
    if not linears or not _available():
        return 0
    need = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if memory is not None and need > memory:
        log.info("linear weights left unpacked: packing needs %.1f GB beside them", need / 1e9)
        return 0
    verdict: dict[tuple, bool] = {}  # per weight shape (and bias or not): packed output bit-identical?
    packed_n = 0
    with torch.inference_mode():
        for mod in linears:
            shape = (*mod.weight.shape, mod.bias is not None)
            if verdict.get(shape) is False:
                continue
            packed = torch.ops.mkldnn._reorder_linear_weight(mod.weight.detach(), 1)
            if shape not in verdict:
                verdict[shape] = _same_output(mod, packed)
            if verdict[shape]:
                setattr(mod, PACKED, packed)
                mod.forward = _forward.__get__(mod)
                packed_n += 1
    left = [s for s, same in verdict.items() if not same]
    if left:
        log.info("linear weights of shapes %s left unpacked: their packed output differs", left)
    return packed_n


def is_packed(model: nn.Module) -> bool:
    return any(PACKED in m.__dict__ for m in model.modules())


@contextmanager
def stock(*models: nn.Module | None) -> Iterator[None]:
    """Run ``models`` on PyTorch's own linear kernels inside the block (what HF ``generate`` gives a user), and
    on the packed ones again after it."""
    saved = [
        (mod, mod.__dict__.pop("forward"))
        for model in models
        if model is not None
        for mod in model.modules()
        if PACKED in mod.__dict__ and "forward" in mod.__dict__
    ]
    try:
        yield
    finally:
        for mod, forward in saved:
            mod.forward = forward

#!/usr/bin/env python
"""What packing the bf16 linear weights at load (viasd_tune/kernels.py) buys per forward: one decode step and
k-token blocks over a cached context, packed against PyTorch's own kernels, interleaved in every repeat (median),
with the logits compared bit for bit.

    python benchmarks/bench_kernels.py --model qwen2.5-coder-1.5b --blocks 1,8,17 --repeats 7 \\
        --out benchmarks/results/kernels-qwen-avx512bf16.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from viasd_tune import host, kernels, models


@torch.inference_mode()
def forward_ms(model, context: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    """One k-token forward after ``context`` is cached (cache cropped back afterwards)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=context[None], past_key_values=cache, use_cache=True)
    block = torch.arange(5, 5 + k)[None]
    start = time.perf_counter()
    out = model(input_ids=block, past_key_values=cache, use_cache=True)
    return (time.perf_counter() - start) * 1e3, out.logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--blocks", default="1,8,17")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = models.load(args.model, "bfloat16", "cpu").model
    if not kernels.is_packed(model):
        raise SystemExit("load did not pack this model's linear weights (see kernels.py): nothing to compare")
    context = torch.arange(100, 100 + args.context)
    blocks = [int(b) for b in args.blocks.split(",")]
    times: dict[tuple[int, str], list[float]] = {}
    equal = True
    for k in blocks:  # warm-up
        forward_ms(model, context, k)
        with kernels.stock(model):
            forward_ms(model, context, k)
    for r in range(args.repeats):
        for k in blocks:
            for kind in ("stock", "packed") if r % 2 == 0 else ("packed", "stock"):
                if kind == "stock":
                    with kernels.stock(model):
                        ms, stock_logits = forward_ms(model, context, k)
                else:
                    ms, packed_logits = forward_ms(model, context, k)
                times.setdefault((k, kind), []).append(ms)
            equal &= torch.equal(stock_logits, packed_logits)
    med = {key: statistics.median(v) for key, v in times.items()}
    step = med[(1, "stock")]
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"`python benchmarks/bench_kernels.py --model {args.model} --blocks {args.blocks} --context {args.context} "
        f"--repeats {args.repeats}`",
        "",
        f"- date: {_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC · host: {host.cpu_name()} · matrix ISA "
        f"**{host.matrix_isa('cpu')}** · {torch.get_num_threads()} threads · torch {torch.__version__} · code {rev}",
        f"- logits packed vs stock bit-identical in every forward: **{'yes' if equal else 'NO'}**",
        "",
        "| block (tokens) | stock ms | packed ms | packed speedup | stock × a stock step | packed × a packed step |",
        "|---|---|---|---|---|---|",
    ]
    for k in blocks:
        s, q = med[(k, "stock")], med[(k, "packed")]
        lines.append(f"| {k} | {s:.0f} | {q:.0f} | {s / q:.2f}× | {s / step:.2f} | {q / med[(1, 'packed')]:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

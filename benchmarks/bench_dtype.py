#!/usr/bin/env python
"""What one target forward costs per dtype and block size: a single decode step vs a k-token verify block.

Speculative decoding trades k single steps for one k-token block, so its speedup rests on how much more a block
costs than a step. That ratio depends on the hardware and the dtype: on a CPU without native bf16
(no AVX-512-bf16 / AMX) PyTorch emulates bf16 matmuls, which is close to free while a step is memory-bound and
expensive once a block makes it compute-bound. This script measures both dtypes side by side: both copies of
the model are loaded, the forwards are interleaved (dtype and block size rotate in every repeat), the KV cache
is cropped back to the same context after each forward, and the median over repeats is reported.

Writes a markdown table (``--out``) and the raw timings next to it (same name, ``.json``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from viasd_tune import host, models

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--blocks", default="1,2,4,6,8", help="block sizes (tokens per forward); 1 is always measured"
    )
    p.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "dtype.md"))
    return p.parse_args(argv)


def timed_block(model: torch.nn.Module, cache: DynamicCache, context: int, k: int) -> float:
    """Seconds for one k-token forward on top of ``context`` cached tokens; the cache is cropped back after."""
    ids = torch.randint(100, 1000, (1, k))
    pos = torch.arange(context, context + k).unsqueeze(0)
    t0 = time.perf_counter()
    model(ids, past_key_values=cache, position_ids=pos, use_cache=True)
    elapsed = time.perf_counter() - t0
    cache.crop(-k)  # transformers 5.x: a negative count removes that many tokens
    return elapsed


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dtypes = args.dtypes.split(",")
    blocks = sorted({1, *(int(b) for b in args.blocks.split(","))})  # 1: the step every ratio divides by
    torch.manual_seed(0)
    loaded, caches = {}, {}
    prefix = torch.randint(100, 1000, (1, args.context))
    with torch.inference_mode():
        for dt in dtypes:
            loaded[dt] = models.load(args.model, dtype=dt, device="cpu").model
            caches[dt] = DynamicCache(config=loaded[dt].config)
            loaded[dt](prefix, past_key_values=caches[dt], use_cache=True)
            for k in blocks:  # warm-up: first calls allocate and pick kernels
                timed_block(loaded[dt], caches[dt], args.context, k)
        times: dict[str, dict[int, list[float]]] = {dt: {k: [] for k in blocks} for dt in dtypes}
        order = [(dt, k) for dt in dtypes for k in blocks]
        for r in range(args.repeats):
            shift = r % len(order)
            for dt, k in order[shift:] + order[:shift]:
                times[dt][k].append(timed_block(loaded[dt], caches[dt], args.context, k))

    med = {dt: {k: statistics.median(v) for k, v in ks.items()} for dt, ks in times.items()}
    machine = {  # the matrix ISA decides what a block costs; torch's capability says "AVX512" for all of them
        "matrix_isa": host.matrix_isa("cpu"),
        "cpu": host.cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    lines = [
        f"# Forward cost per dtype and block size: {args.model}",
        "",
        f"{_dt.date.today()} · matrix ISA **{machine['matrix_isa']}** · {machine['cpu']} · "
        f"{machine['torch_threads']} threads · torch {machine['torch']} · CPU capability "
        f"{machine['torch_cpu_capability']} · context {args.context} tokens · median of {args.repeats} "
        "interleaved repeats",
        "",
        "`" + " ".join(["python benchmarks/bench_dtype.py", *(sys.argv[1:] if argv is None else argv)]) + "`",
        "",
        "| block (tokens) | "
        + " | ".join(f"{dt} ms | {dt} × step" for dt in dtypes)
        + (f" | {dtypes[1]} / {dtypes[0]}" if len(dtypes) == 2 else "")
        + " |",
        "|---" * (1 + 2 * len(dtypes) + (len(dtypes) == 2)) + "|",
    ]
    for k in blocks:
        cells = [f"{med[dt][k] * 1e3:.0f} | {med[dt][k] / med[dt][1]:.2f}" for dt in dtypes]
        if len(dtypes) == 2:
            cells.append(f"{med[dtypes[1]][k] / med[dtypes[0]][k]:.2f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    out.with_suffix(".json").write_text(
        json.dumps({"args": vars(args), "machine": machine, "seconds": times}, indent=1)
    )


if __name__ == "__main__":
    main()

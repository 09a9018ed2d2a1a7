#!/usr/bin/env python
"""Does a token tree pay? A quick sanity check on a small model before the search learns trees (issue 33).

Decodes a few Spec-Bench prompts (one per category, round robin) greedily with plain AR, prompt lookup γ 8 (our
best exported chain) and a few tree configurations, interleaved per prompt (the order rotates), and reports
per method the tokens per target call (the figure to trust on a busy machine) and the wall time relative to AR
and to lookup γ 8 (median over prompts of the paired ratios). Every lossless method must give AR's tokens; the
script counts the prompts where bf16 near-ties made one differ.

Not a benchmark for the README: the coordinator benches on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from viasd_tune import host, models
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder

DATA = Path("/work/shared/data/spec_bench/question.jsonl")

METHODS = {
    "ar": DecodeConfig(mode="ar"),
    "lookup-g8": DecodeConfig(mode="sd", gamma=8, drafter="lookup"),
    "tree-lookup-16": DecodeConfig(mode="sd", gamma=8, drafter="lookup", tree_nodes=16),
    "tree-recycle-16": DecodeConfig(mode="sd", gamma=8, drafter="recycle", tree_nodes=16),
    "tree-lookup+recycle-16": DecodeConfig(mode="sd", gamma=8, drafter="lookup+recycle", tree_nodes=16),
    "tree-lookup+recycle-32": DecodeConfig(mode="sd", gamma=8, drafter="lookup+recycle", tree_nodes=32),
}


def warm_recycling() -> None:
    """Every recycling source shares one table per vocabulary size and width from now on."""
    from viasd_tune.decoding import tree_drafters

    tables: dict[tuple[int, int], tree_drafters.RecycleTable] = {}
    make = tree_drafters.RecycleTable

    def shared(vocab: int, k: int):
        return tables.setdefault((vocab, k), make(vocab, k))

    tree_drafters.RecycleTable = shared


def prompts(path: Path, n: int) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for r in rows:
        by_cat.setdefault(r.get("category", "?"), []).append(r["turns"][0])
    cats = sorted(by_cat)
    return [(cats[i % len(cats)], by_cat[cats[i % len(cats)]][i // len(cats)]) for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--warm-recycle",
        action="store_true",
        help="keep one recycling table across prompts (Token Recycling keeps its matrix across queries)",
    )
    args = p.parse_args(argv)
    if args.warm_recycle:
        warm_recycling()

    lm = models.load(args.model, dtype=args.dtype)
    names = args.methods.split(",")
    decoders = {m: Decoder(lm.model, lm.tokenizer, METHODS[m]) for m in names}
    work = prompts(DATA, args.prompts)
    decoders["ar"].generate(work[0][1], 8)  # warm-up
    wall: dict[str, list[float]] = {m: [] for m in names}
    per_call: dict[str, list[float]] = {m: [] for m in names}
    differ = {m: 0 for m in names}
    for i, (_, text) in enumerate(work):
        order = names[i % len(names) :] + names[: i % len(names)]
        outs = {}
        for m in order:
            t0 = time.perf_counter()
            r = decoders[m].generate(text, args.new_tokens, chat="on")
            wall[m].append(time.perf_counter() - t0)
            per_call[m].append(r.stats.tokens_per_full_call)
            outs[m] = r.token_ids
        for m in names:
            differ[m] += outs[m] != outs["ar"]
        calls = ", ".join(f"{m} {per_call[m][-1]:.2f}" for m in names)
        print(f"prompt {i + 1}/{len(work)} ({work[i][0]}): tokens per target call {calls}", flush=True)
    print(
        f"host {host.matrix_isa()}, {torch.get_num_threads()} threads; {args.model} {args.dtype}; "
        f"{len(work)} prompts x {args.new_tokens} new tokens"
    )
    print(f"{'method':26s} {'tok/call':>8s} {'x AR':>6s} {'x lookup-g8':>11s} {'differ':>6s}")
    for m in names:
        vs_ar = statistics.median(a / b for a, b in zip(wall["ar"], wall[m], strict=True))
        vs_lookup = (
            statistics.median(a / b for a, b in zip(wall["lookup-g8"], wall[m], strict=True))
            if "lookup-g8" in wall
            else float("nan")
        )
        print(f"{m:26s} {statistics.mean(per_call[m]):8.2f} {vs_ar:6.2f} {vs_lookup:11.2f} {differ[m]:6d}")


if __name__ == "__main__":
    main()

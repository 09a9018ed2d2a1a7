"""Tree configurations side by side on one model: tokens per target call, tree size, and wall-time speed relative
to the first configuration, interleaved prompt by prompt (rotated order, median over repeats).

    python benchmarks/tree_explore.py --model qwen2.5-coder-1.5b --prompts 6 --max-new-tokens 64 --repeats 2 \\
        'lookup8|mode=sd,drafter=lookup,gamma=8' \\
        'tree32|mode=sd,drafter=lookup+recycle,gamma=6,tree_nodes=32,tree_recycle_depth=5,tree_recycle_width=3'

Each configuration is ``name|field=value,...`` over DecodeConfig fields; ``warm=1`` keeps the token-recycling
table across the prompts of a repeat as the decoder does by default (Token Recycling's hot start; forgotten at
each repeat so a repeated prompt never drafts from its own earlier output); without it every request starts cold.
An exploration tool: a bench report compares methods with HF.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from viasd_tune import host, models
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.decoding.tree_sizing import EDGES
from viasd_tune.prompts import load_prompts, prompt_task_group, sample_prompts

SPEC_BENCH = "../shared/data/spec_bench/question.jsonl"


def parse(spec: str) -> tuple[str, DecodeConfig, bool]:
    name, _, fields = spec.partition("|")
    kw: dict = {}
    for item in filter(None, fields.split(",")):
        key, value = item.split("=")
        try:
            kw[key] = int(value)
        except ValueError:
            try:
                kw[key] = float(value)
            except ValueError:
                kw[key] = value
    warm = bool(kw.pop("warm", 0))
    return name, DecodeConfig(**kw), warm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default=None, help="a draft model, for configurations with a model drafter")
    p.add_argument("--data", default=SPEC_BENCH)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    target = models.load(args.model, "bfloat16", "cpu")
    draft = models.load(args.draft, "bfloat16", "cpu").model if args.draft else None
    by_group = prompt_task_group if args.data == SPEC_BENCH else None
    prompts = sample_prompts(load_prompts(args.data), args.prompts, 0, key=by_group)
    runs = [
        (name, Decoder(target.model, target.tokenizer, cfg, draft=draft), warm)
        for name, cfg, warm in map(parse, args.configs)
    ]

    wall: dict = defaultdict(lambda: defaultdict(float))
    group_wall: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))  # name → group → repeat → s
    count: dict = defaultdict(lambda: defaultdict(int))
    per_group: dict = defaultdict(dict)
    for r in range(args.repeats):
        for _, dec, _ in runs:
            dec.forget()
        for i, prompt in enumerate(prompts):
            k = (i + r) % len(runs)
            for name, dec, warm in runs[k:] + runs[:k]:
                if not warm:
                    dec.forget()  # each request cold, as before the decoder kept the table
                stats = dec.generate(prompt.text, max_new_tokens=args.max_new_tokens).stats
                group = prompt_task_group(prompt)
                wall[name][r] += stats.wall_time_s
                group_wall[name][group][r] += stats.wall_time_s
                if r == 0:
                    for field in ("full_calls", "new_tokens", "tree_nodes_verified", "rounds"):
                        count[name][field] += getattr(stats, field)
                    g = per_group[name].setdefault(group, [0, 0])
                    g[0] += stats.new_tokens
                    g[1] += stats.full_calls
    print(
        f"matrix ISA {host.matrix_isa('cpu')} · {host.cpu_name()} · {args.model} bf16 · {len(prompts)} prompts · "
        f"{args.max_new_tokens} new tokens · {args.repeats} repeats"
    )
    print(
        "| config | speed vs first, median [min–max] | tokens per target call | nodes per round | "
        "tokens per call by group | speed vs first by group |"
    )
    print("|---|---|---|---|---|---|")
    base = runs[0][0]
    for name, _, _ in runs:
        ratios = [wall[base][r] / wall[name][r] for r in range(args.repeats)]
        c = count[name]
        groups = " ".join(f"{g} {t / max(n, 1):.2f}" for g, (t, n) in per_group[name].items())
        speeds = " ".join(
            f"{g} {statistics.median(group_wall[base][g][r] / t[r] for r in range(args.repeats)):.2f}"
            for g, t in group_wall[name].items()
        )
        print(
            f"| {name} | {statistics.median(ratios):.3f} [{min(ratios):.3f}–{max(ratios):.3f}] | "
            f"{c['new_tokens'] / max(c['full_calls'], 1):.2f} | {c['tree_nodes_verified'] / max(c['rounds'], 1):.1f} "
            f"| {groups} | {speeds} |"
        )
    for name, dec, _ in runs:
        if dec.calibration.counts:  # tree_sizing=cost: what the last repeat learnt of each source's acceptance
            print(f"\n{name}: acceptance of a node whose parent was accepted, by step score (verified / accepted)")
            edges = ["0", *(f"{e:g}" for e in EDGES)]
            for key, table in sorted(dec.calibration.counts.items()):
                cells = [
                    f"≤{edges[b + 1] if b + 1 < len(edges) else '1'}: {int(n)} {hit / n:.2f}"
                    for b, (n, hit) in enumerate(table)
                    if n
                ]
                print(f"  {key}: " + " · ".join(cells))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Which earlier occurrence prompt lookup should continue from: target calls each rule needs on greedy outputs.

The target decodes each prompt greedily once (HF ``generate``); then each rule replays prompt lookup (γ tokens,
n-grams up to 3) against that output and counts target calls: one per round, each round accepting the matching
prefix of the proposal plus the target's own token. No timing, so the host does not matter; fewer calls is
faster on every host. Rules: ``latest`` occurrence, ``earliest`` (HF's prompt lookup), ``ours`` (the latest in
the emitted text, else the earliest in the prompt: ``viasd_tune.decoding.drafters.prompt_lookup``).

    python benchmarks/lookup_occurrence.py --model smollm2-135m --prompts 90 --max-new-tokens 64 \\
        --out benchmarks/results/lookup-occurrence.md
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
from tqdm import tqdm

from viasd_tune import models, prompts
from viasd_tune.decoding.drafters import prompt_lookup


def target_calls(ids: list[int], out: list[int], gamma: int, prompt_len: int) -> int:
    """Rounds of lookup SD that reproduce ``out`` (the prefill emits its first token)."""
    seq, i, calls = ids + out[:1], 1, 1
    while i < len(out):
        proposal = prompt_lookup(torch.tensor(seq), gamma, prompt_len=prompt_len).tolist()
        k = 0
        while k < len(proposal) and i + k < len(out) and proposal[k] == out[i + k]:
            k += 1
        n = min(k + 1, len(out) - i)
        seq, i, calls = seq + out[i : i + n], i + n, calls + 1
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--prompts", type=int, default=90)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    m = models.load(a.model, dtype="float32")
    chosen = prompts.sample_prompts(prompts.load_prompts(a.data), a.prompts, seed=a.seed)
    # ids → rule's prompt_len: latest = no prompt; earliest = all prompt (HF); ours = the real prompt
    rules = {"latest": lambda ids: 0, "earliest": lambda ids: 10**9, "ours": len}
    counts: dict[tuple[int, str], collections.Counter] = collections.defaultdict(collections.Counter)
    for p in tqdm(chosen, desc="greedy outputs"):
        ids = prompts.encode_prompt(m.tokenizer, p.text, "auto")
        with torch.inference_mode():
            out = m.model.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False)
        out = out[0, len(ids) :].tolist()
        for gamma in (4, 8):
            for rule, prompt_len in rules.items():
                n = target_calls(ids, out, gamma, prompt_len(ids))
                counts[gamma, rule][prompts.prompt_task_group(p)] += n
                counts[gamma, rule]["all"] += n
    groups = sorted({g for c in counts.values() for g in c if g != "all"}) + ["all"]
    lines = [
        f"# Prompt lookup: which occurrence\n\n`{a.model}`, {len(chosen)} prompts from `{a.data}` (seed {a.seed}), "
        f"{a.max_new_tokens} greedy new tokens; target calls (fewer is better).\n",
        "| γ | rule | " + " | ".join(groups) + " |",
        "|---|---|" + "---|" * len(groups),
    ]
    for (gamma, rule), c in counts.items():
        lines.append(f"| {gamma} | {rule} | " + " | ".join(str(c[g]) for g in groups) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()

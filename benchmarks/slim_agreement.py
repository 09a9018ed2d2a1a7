#!/usr/bin/env python
"""How often the slim verifier picks the target's token: its own KV cache vs the target's committed cache.

For each prompt the target decodes greedily; then, at every generated position, the slim verifier (the target
under a skip set) predicts the next token in two ways:
- **own cache**: a teacher-forced skip-set forward over the whole sequence, i.e. a slim verifier that keeps its
  own KV cache, built from its own hidden states (the engine before v2);
- **target's cache**: the new token alone, skip set active, over the full target's KV of the prefix (the
  engine now: Self-SD, SWIFT and LayerSkip run their skip passes this way).
Top-1 agreement with the target's own greedy token is reported per skip set, next to the separate draft's.

    python benchmarks/slim_agreement.py --prompts 4 --max-new-tokens 32 --out benchmarks/results/slim-agreement.md
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path

import torch

from viasd_tune import models, prompts
from viasd_tune.config import DecodeConfig
from viasd_tune.decoding.common import CachedLM
from viasd_tune.decoding.decoder import Decoder
from viasd_tune.host import cpu_name, matrix_isa
from viasd_tune.routing import SkipSet, num_layers, skipping

REPO = Path(__file__).resolve().parent.parent


def spread(layers: int, count: int, first: int = 1) -> list[int]:
    """``count`` layer indices evenly spread over 1 .. layers-2 (the first and last layer are kept)."""
    span = layers - 1 - first
    return sorted({first + round(i * span / count) for i in range(count)})


def skip_sets(layers: int, profile: Path | None) -> dict[str, SkipSet]:
    sets = {
        "7 attention + 6 MLP, spread (13 sub-layers)": SkipSet.of(spread(layers, 7), spread(layers, 6, first=2)),
        "8 MLP, spread": SkipSet.of((), spread(layers, 8)),
        "8 attention, spread": SkipSet.of(spread(layers, 8)),
        "alternate layers' attention and MLP (26 sub-layers)": SkipSet.of(
            range(1, layers - 1, 2), range(2, layers - 1, 2)
        ),
    }
    if profile is not None and profile.exists():
        r = json.loads(profile.read_text())["routing"]
        sets = {f"{profile.stem} ({len(r['skip_attn']) + len(r['skip_mlp'])} sub-layers)": SkipSet.of(
            r["skip_attn"], r["skip_mlp"]
        ), **sets}
    return sets


@torch.inference_mode()
def agreement(target, seq: torch.Tensor, start: int, skip: SkipSet) -> tuple[int, int]:
    """(own-cache hits, target's-cache hits) over the generated positions ``start..len-1``."""
    ref = seq[start:]
    with skipping(target, skip):
        own = target(input_ids=seq[None]).logits[0, start - 1 : -1].argmax(-1)
    lm = CachedLM(target)
    lm.forward(seq[: start - 1], keep=1)
    shared = []
    for t in range(start - 1, seq.numel() - 1):  # predict token t+1 from the committed prefix [0, t)
        shared.append(lm.speculate(seq[: t + 1], skip, tier="slim", keep=1)[-1].argmax())
        lm.forward(seq[: t + 1], keep=1)  # commit token t with the full target
    return int((own == ref).sum()), int((torch.stack(shared) == ref).sum())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--data", default=str(REPO.parent / "shared/data/spec_bench/question.jsonl"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--profile", default=str(REPO / "benchmarks/results/profile-qwen-bf16-t9-specbench.json"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/slim-agreement.md"))
    a = p.parse_args(argv)

    target = models.load(a.model, a.dtype, "cpu")
    draft = models.load(a.draft, a.dtype, "cpu") if a.draft else None
    items = prompts.sample_prompts(prompts.load_prompts(a.data), a.prompts, a.seed)
    layers = num_layers(target.model)
    sets = skip_sets(layers, Path(a.profile) if a.profile else None)
    dec = Decoder(target.model, target.tokenizer, DecodeConfig(mode="ar"))
    hits = {name: [0, 0] for name in sets}
    draft_hits, total = 0, 0
    for item in items:
        ids = torch.tensor(prompts.encode_prompt(target.tokenizer, item.text), dtype=torch.long)
        out = dec.generate(ids, a.max_new_tokens).token_ids
        seq = torch.cat([ids, torch.tensor(out, dtype=torch.long)])
        start = ids.numel()
        total += len(out)
        for name, skip in sets.items():
            own, shared = agreement(target.model, seq, start, skip)
            hits[name][0] += own
            hits[name][1] += shared
        if draft is not None:
            with torch.inference_mode():
                pred = draft.model(input_ids=seq[None]).logits[0, start - 1 : -1].argmax(-1)
            draft_hits += int((pred == seq[start:]).sum())
        print(f"{item.id}: {len(out)} positions", flush=True)

    isa = matrix_isa("cpu")
    lines = [
        f"# Slim verifier agreement with the target: own cache vs the target's cache ({_dt.date.today()})",
        "",
        f"Target {a.model} ({layers} layers, {a.dtype}), {len(items)} prompts from {Path(a.data).name} "
        f"(seed {a.seed}), {total} generated positions, greedy. Host: {cpu_name()}, matrix ISA **{isa}**.",
        f"Command: `python benchmarks/slim_agreement.py --prompts {a.prompts} --max-new-tokens {a.max_new_tokens}`",
        "",
        "| skip set | attention skipped | MLP skipped | own cache | target's cache |",
        "|---|---|---|---|---|",
    ]
    for name, skip in sets.items():
        own, shared = hits[name]
        lines.append(
            f"| {name} | {sorted(skip.attn)} | {sorted(skip.mlp)} | {own / total:.3f} | {shared / total:.3f} |"
        )
    if draft is not None:
        lines += ["", f"The separate draft ({a.draft}) agrees on {draft_hits / total:.3f} of the same positions."]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

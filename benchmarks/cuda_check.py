"""The CUDA paths, checked on a GPU machine (CI has none; the test suite runs the same checks on CPU).

1. Lossless modes are token-identical to plain greedy decoding of the target on the GPU (fp32, tiny random
   Llama / Qwen2 / Gemma-3 models, many random prompts): plain SD with every drafter, VIA-SD with recheck.
2. The replay gives the engine's tokens and tier labels on the GPU (lossless configurations).
3. bf16 and sampling run on the GPU (no equality asked: batched and incremental bf16 forwards round apart).
4. What a verify block and a slim pass cost against one decode step, for a Qwen2.5-1.5B-shaped model in bf16
   (random weights: the cost of a forward does not depend on them), timed with CUDA events after warm-up.

Usage: ``python benchmarks/cuda_check.py --out DIR`` (writes cuda-check.json; runs on CPU too, slowly).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import noisy_copy, tiny_model  # noqa: E402
from viasd_tune import host  # noqa: E402
from viasd_tune.config import DecodeConfig  # noqa: E402
from viasd_tune.decoding.common import CachedLM  # noqa: E402
from viasd_tune.decoding.decoder import Decoder  # noqa: E402
from viasd_tune.routing import SkipSet, install_skipping  # noqa: E402
from viasd_tune.search import replay  # noqa: E402

EOS = {2}
T0 = time.perf_counter()
LOSSLESS = [
    DecodeConfig(mode="sd", gamma=4, drafter="model"),
    DecodeConfig(mode="sd", gamma=5, drafter="self", draft_skip=SkipSet.of([1, 3], [2, 4])),
    DecodeConfig(mode="sd", gamma=4, drafter="lookup"),
    DecodeConfig(mode="sd", gamma=4, drafter="lookup+model", draft_confidence=0.4),
    DecodeConfig(
        gamma=4, drafter="model", skip=SkipSet.of([2], [3]), tau_accept=0.05, tau_escalate=1.0, recheck=True
    ),
    DecodeConfig(
        gamma=3,
        drafter="self",
        skip=SkipSet.of([2], []),
        draft_skip=SkipSet.of([1, 3], [2, 4]),
        tau_accept=0.02,
        tau_escalate=0.5,
        recheck=True,
        draft_confidence=0.3,
    ),
    DecodeConfig(
        gamma=6, drafter="lookup+self", draft_skip=SkipSet.of([1, 3], [2, 4]), tau_escalate=2.0, recheck=True
    ),
]


def prompts(n: int, seed: int, dev) -> list[torch.Tensor]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(3, 96) for _ in range(rng.randrange(2, 8))]  # repeats: prompt lookup finds some
        out.append(torch.tensor((base * 4)[: rng.randrange(1, 30)], device=dev))
    return out


def lossless(dev, n_prompts: int, archs: list[str]) -> dict:
    report = {}
    for seed, arch in enumerate(archs):
        target = tiny_model(arch, seed=0, layers=6).to(dev)
        install_skipping(target)
        draft = noisy_copy(target.cpu(), 0.3, seed=1).to(dev)
        target.to(dev)
        ps = prompts(n_prompts, seed=seed, dev=dev)
        ar = Decoder(target, None, DecodeConfig(mode="ar"), eos=EOS)
        refs = [ar.generate(p, max_new_tokens=24).token_ids for p in ps]
        mismatches = {}
        for cfg in LOSSLESS:
            dec = Decoder(target, None, cfg, draft=draft, eos=EOS)
            bad = sum(
                dec.generate(p, max_new_tokens=24).token_ids != r for p, r in zip(ps, refs, strict=True)
            )
            mismatches[f"{cfg.mode}/{cfg.drafter}/recheck={cfg.recheck}"] = bad
            print(
                f"{time.perf_counter() - T0:.0f}s", arch, cfg.mode, cfg.drafter, "mismatches", bad, flush=True
            )
        # The replay of the lossless VIA-SD configurations: the engine's tokens and tier labels.
        cache = replay.ReplayCache(
            target,
            [replay.Reference(str(j), p, r, 0.0) for j, (p, r) in enumerate(zip(ps, refs, strict=True))],
            draft,
            max_new_tokens=24,
            eos=EOS,
        )
        replay_bad = 0
        for cfg in LOSSLESS[4:]:
            est = replay.simulate(cache, cfg)
            dec = Decoder(target, None, cfg, draft=draft, eos=EOS)
            results = [dec.generate(p, max_new_tokens=24) for p in ps]
            replay_bad += est.outputs != [r.token_ids for r in results]
            replay_bad += est.tier_labels != [r.tiers for r in results]
        # bf16 and sampling run (no equality asked).
        t16, d16 = target.to(torch.bfloat16), draft.to(torch.bfloat16)
        sampled = Decoder(t16, None, LOSSLESS[4], draft=d16, eos=EOS).generate(
            ps[0], max_new_tokens=24, temperature=0.8, top_p=0.9
        )
        report[arch] = {
            "prompts": n_prompts,
            "mismatches_vs_ar": mismatches,
            "replay_mismatches": replay_bad,
            "bf16_sampled_tokens": len(sampled.token_ids),
        }
        print(arch, report[arch], flush=True)
    return report


def timed(dev, fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, so the figure is the device's, not the launch's)."""
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def forward_costs(dev, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(  # Qwen2.5-1.5B's shape
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(dev).eval()
    install_skipping(model)
    ctx = torch.randint(3, 150000, (300,), device=dev)

    def cost(block: int, skip: SkipSet) -> float:
        lm = CachedLM(model)
        lm.forward(ctx)

        def one():
            lm.speculate(torch.cat([ctx, ctx[:block]]), skip, tier="slim")
            lm.discard(skip)

        return timed(dev, one, repeats)

    step = cost(1, SkipSet())
    out = {"decode_step_s": step}
    for block in (2, 4, 8, 16):
        out[f"verify_{block}_in_steps"] = cost(block, SkipSet()) / step
    for n in (2, 7, 14):  # attention and MLP sub-layers of the middle layers skipped
        layers = list(range(1, 1 + n))
        out[f"slim_skip_{2 * n}_of_56_in_steps"] = cost(1, SkipSet.of(layers, layers)) / step
    print(out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="artifacts/cuda-check")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--archs", default="llama,qwen2,gemma3", help="tiny model architectures to check")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "matrix_isa": host.matrix_isa(str(dev)),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "forward_costs_bf16": forward_costs(dev, args.repeats),
        "lossless": lossless(dev, args.prompts, args.archs.split(",")),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cuda-check.json").write_text(json.dumps(report, indent=1))
    bad = sum(
        sum(r["mismatches_vs_ar"].values()) + r["replay_mismatches"] for r in report["lossless"].values()
    )
    print("OK: lossless on", report["device"] if not bad else f"FAILED: {bad} mismatches")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

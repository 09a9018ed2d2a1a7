"""What a token-tree verify forward costs beside a causal block of the same size (issue 33): does the 4-D tree
mask (SDPA with an arbitrary mask) cost more than the causal path? Times one target forward over a 256-token
cached context, in steps of a 1-token forward, median of 7.

    python benchmarks/tree_cost.py --model qwen2.5-coder-1.5b --nodes 8,16,32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from viasd_tune import host, models
from viasd_tune.decoding.common import CachedLM
from viasd_tune.decoding.tree import Tree


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--nodes", default="8,16,32")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    rng = random.Random(0)
    lm = CachedLM(models.load(args.model, "bfloat16", "cpu").model)
    prefix = [rng.randrange(100, 30000) for _ in range(args.context)]
    ids = torch.tensor(prefix)
    lm.forward(ids[:-1])

    def timed(fn) -> float:
        out = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            lm.rollback(len(prefix) - 1)
        return statistics.median(out)

    timed(lambda: lm.forward(ids))  # warm-up
    step = timed(lambda: lm.forward(ids))
    print(
        f"matrix ISA {host.matrix_isa('cpu')} · {host.cpu_name()} · {args.model} bf16 · context {args.context}"
    )
    print(f"1-token step {step * 1000:.0f} ms; each figure in steps (median of {args.repeats})\n")
    print("| nodes | causal block | tree forward, a chain | tree forward, 4 branches |")
    print("|---|---|---|---|")
    for n in map(int, args.nodes.split(",")):
        tokens = [rng.randrange(100, 30000) for _ in range(n)]
        chain = Tree(tokens, [i - 1 for i in range(n)])
        bushy = Tree(tokens, [i - 4 if i >= 4 else -1 for i in range(n)])
        block = torch.tensor(prefix + tokens)
        causal = timed(lambda block=block: lm.forward(block))
        as_chain = timed(lambda chain=chain: lm.forward_tree(ids, chain))
        as_bushy = timed(lambda bushy=bushy: lm.forward_tree(ids, bushy))
        print(f"| {n} | {causal / step:.2f} | {as_chain / step:.2f} | {as_bushy / step:.2f} |")


if __name__ == "__main__":
    main()

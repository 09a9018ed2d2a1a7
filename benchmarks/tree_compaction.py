#!/usr/bin/env python
"""After a tree round the target's cache must keep the accepted path only. Two ways:

- gather (what the engine does, ``CachedLM.keep_path``): move the path's entries right behind the committed
  ones in every layer and drop the rest; the next round's forward feeds only the target's own last token;
- re-feed: drop every tree entry; the next round's forward feeds the path again with that token.

This times, on a ``--context``-token cache, the compaction plus the next round's tree forward both ways, for
accepted paths of 1..``--max-path`` nodes, interleaved (the variant order alternates per repeat), and reports
the medians. The re-feed variant costs no copy but makes every next block longer by the path.
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


def bushy_tree(rng: random.Random, n: int, vocab: int) -> Tree:
    """``n`` nodes as four interleaved chains below the root (node i's parent is i - 4): width 4, depth n / 4."""
    return Tree([rng.randrange(100, vocab) for _ in range(n)], [i - 4 if i >= 4 else -1 for i in range(n)])


def one(
    lm: CachedLM, prefix: list[int], tree: Tree, nxt: Tree, path: list[int], variant: str
) -> tuple[float, float]:
    """Wall and process-CPU seconds of the compaction and the next tree forward after ``tree`` (``path``
    accepted); ``lm`` holds the prefix but its last token, and does so again afterwards. CPU time is what this
    process spent (both threads): less disturbed than wall time when other processes share the cores."""
    ids = torch.tensor(prefix)
    lm.forward_tree(ids, tree)
    after = torch.tensor(prefix + [tree.tokens[i] for i in path] + [7])
    t0, c0 = time.perf_counter(), time.process_time()
    if variant == "gather":
        lm.keep_path(tree.n, path)
    else:
        lm.rollback(lm.committed)
    lm.forward_tree(after, nxt)
    out = time.perf_counter() - t0, time.process_time() - c0
    lm.rollback(len(prefix) - 1)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--max-path", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)

    model = models.load(args.model, dtype=args.dtype).model
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(100, vocab) for _ in range(args.context)]
    tree, nxt = bushy_tree(rng, args.nodes, vocab), bushy_tree(rng, args.nodes, vocab)
    paths = {
        m: tree.path(max(i for i in range(tree.n) if tree.depth[i] <= m)) for m in range(1, args.max_path + 1)
    }
    paths = {m: path for m, path in paths.items() if len(path) == m}
    with torch.inference_mode():
        lm = CachedLM(model)
        lm.forward(torch.tensor(prefix[:-1]))
        one(lm, prefix, tree, nxt, paths[1], "gather")  # warm-up
        times = {(m, v): [] for m in paths for v in ("gather", "refeed")}
        for r in range(args.repeats):
            for m, path in paths.items():
                for v in ("gather", "refeed") if r % 2 == 0 else ("refeed", "gather"):
                    times[m, v].append(one(lm, prefix, tree, nxt, path, v))
        gather_only = []  # the gather alone, without the forward
        for _ in range(args.repeats):
            lm.forward_tree(torch.tensor(prefix), tree)
            t0 = time.perf_counter()
            lm.keep_path(tree.n, paths[max(paths)])
            gather_only.append(time.perf_counter() - t0)
            lm.rollback(len(prefix) - 1)
    print(
        f"host {host.matrix_isa()}, {torch.get_num_threads()} threads; {args.model} {args.dtype}; context "
        f"{args.context}, trees of {args.nodes} nodes, medians of {args.repeats}"
    )
    print(
        f"gather alone (path of {max(paths)}): median {1000 * statistics.median(gather_only):.2f} ms, "
        f"min {1000 * min(gather_only):.2f} ms"
    )
    print("wall ms, median / min (the least disturbed run) of compaction + next forward:")
    print("path  gather           refeed           gather/refeed (median, min)")
    for m in paths:
        g = [t[0] for t in times[m, "gather"]]
        f = [t[0] for t in times[m, "refeed"]]
        gm, fm = statistics.median(g), statistics.median(f)
        print(
            f"{m:4d}  {1000 * gm:7.1f} / {1000 * min(g):6.1f}  {1000 * fm:7.1f} / {1000 * min(f):6.1f}  "
            f"{gm / fm:.3f}, {min(g) / min(f):.3f}"
        )
    cpu = {v: statistics.median(t[1] for m in paths for t in times[m, v]) for v in ("gather", "refeed")}
    print(
        f"process CPU ms, median over all paths: gather {1000 * cpu['gather']:.1f}, refeed {1000 * cpu['refeed']:.1f}"
    )


if __name__ == "__main__":
    main()

"""``viasd-tune bench`` on the command line: its flags, and the settings and summary lines they turn into.

The main CLI passes in what it shares with the other commands (the model flags, the default model), so this
package never imports ``viasd_tune.cli``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .. import cliargs, prompts
from ..cliargs import finite_float
from .methods import FIXED_METHODS, HF_ASSISTED_OPT_IN
from .settings import BenchSettings


def add_bench_command(sub, add_model_args: Callable, default_model: str | None = None) -> None:
    """Register ``viasd-tune bench`` on the CLI's sub-parsers; ``add_model_args`` adds --model, --draft, ..."""
    b = sub.add_parser("bench", help="benchmark ar/sd/VIA-SD profiles against HF generate, per task group")
    add_model_args(b)
    b.add_argument(
        "--profile",
        dest="profiles",
        action="extend",
        nargs="+",
        default=[],
        metavar="P",
        help="profile JSON(s) to bench as viasd:<name> (repeatable)",
    )
    b.add_argument("--data", required=True, help="builtin, humaneval, or a .jsonl/.json/.csv/.parquet file")
    b.add_argument("--data-field", help="column holding the prompt text")
    b.add_argument("--categories", help="comma-separated raw categories or task groups to keep")
    b.add_argument("--prompts", type=int, default=12, help="prompts to sample, stratified by task group")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument(
        "--gamma", type=int, default=None, help="γ for sd/hf-assisted/hf-lookup (default: profile's, else 5)"
    )
    b.add_argument(
        "--draft-confidence",
        type=finite_float,
        default=0.0,
        metavar="C",
        help="our sd stops drafting after a pick below this probability, γ stays the cap (0: off; HF uses 0.4)",
    )
    b.add_argument(
        "--tree-nodes",
        type=int,
        default=None,
        metavar="N",
        help="run sd-tree: our lossless SD over a token tree of up to N draft nodes (0..64), depth ≤ γ, from prompt "
        "lookup and token recycling (+ the draft model with --draft); sd-tree named in --methods alone: 16",
    )
    b.add_argument(
        "--methods",
        help=f"comma-separated subset of {', '.join(FIXED_METHODS)}, viasd (all profiles), viasd:<name>, "
        "viasd+recheck (all profiles with recheck on) or viasd+recheck:<name>; "
        f"hf always runs; {' and '.join(HF_ASSISTED_OPT_IN)} run only when named",
    )
    b.add_argument("--chat", choices=list(prompts.CHAT_MODES), default="auto")
    b.add_argument("--seed", type=int, default=0, help="prompt-sampling seed")
    b.add_argument("--warmup-tokens", type=int, default=16, help="max_new_tokens of the untimed warm-up runs")
    b.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    b.add_argument(
        "--wait-idle",
        type=finite_float,
        default=0.0,
        metavar="S",
        help="before each timed run wait up to S seconds for other processes to go idle (default 0: don't wait)",
    )
    b.add_argument(
        "--foreign-max",
        type=finite_float,
        default=0.05,
        metavar="CORES",
        help="a run during which other processes used more cores than this on average is disturbed (0.05)",
    )
    b.add_argument(
        "--retries", type=int, default=0, help="re-run a disturbed run at most this many times (0)"
    )
    b.add_argument("--out", required=True, help="output folder for bench.json, bench.md, bench.html")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench, bench_default_model=default_model)


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    return cliargs.settings_from_args(BenchSettings, args, profiles=list(args.profiles))


def cmd_bench(args: argparse.Namespace) -> int:
    from .run import run_bench

    result = run_bench(settings_from_args(args), default_model=args.bench_default_model)
    isa = result["meta"]["machine"]["matrix_isa"]
    print(f"{result['meta']['dtype']} on {isa}")
    for m, s in result["summary"].items():
        print(
            f"{m:24s} {s['tok_s']['median']:8.2f} tok/s  speedup {s['speedup_vs_hf']['median']:.3f}x  "
            f"exact {s['exact_match']:.0%}  agreement {s['agreement']:.3f}"
        )
    print(f"wrote {', '.join(result['files'].values())}")
    return 0

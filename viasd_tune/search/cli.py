"""Sub-commands around the search: ``search`` and ``export`` (``dashboard`` is the main CLI's: the dashboard sits
above the search)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

from ..cliargs import finite_float
from ..errors import UserError

MAX_JOBS = 256  # worker processes on one machine


def add_search_commands(sub, add_model_args, dashboard=None) -> None:
    """Register ``search`` and ``export``; ``dashboard`` writes a search's dashboard beside its profile (the main
    CLI hands in ``viasd_tune.dashboard.write_beside_profile``, which this package may not import)."""
    s = sub.add_parser("search", help="tune the routing with Optuna and export a profile")
    add_model_args(s)
    s.add_argument(
        "--data", default="builtin", help="builtin, humaneval, or a .jsonl/.json/.csv/.parquet file"
    )
    s.add_argument("--data-field", help="column holding the prompt text")
    s.add_argument("--categories", help="comma-separated categories to keep")
    s.add_argument("--prompts", type=int, default=12, help="prompts to sample (stratified by category)")
    s.add_argument(
        "--held-out", type=finite_float, default=0.25, help="share of prompts kept out for the final report"
    )
    s.add_argument("--chat", choices=["auto", "on", "off"], default="auto")
    s.add_argument(
        "--trials",
        type=int,
        default=20,
        help="trials decoded for real (measured); many more are replay-scored in seconds each and only those "
        "that could enter the feasible front are decoded",
    )
    s.add_argument("--out", default=None, help="output folder (default artifacts/<study name>)")
    s.add_argument("--storage", help="Optuna storage URL (default sqlite in the out folder)")
    s.add_argument("--study-name", help="study name (default: the out folder's name)")
    s.add_argument("--space", default="default", help="search space: default, smoke, or a YAML file")
    s.add_argument("--min-fidelity", type=finite_float, default=0.95)
    s.add_argument("--max-new-tokens", type=int, default=48)
    s.add_argument("--timeout", type=finite_float, help="stop starting trials after this many seconds")
    s.add_argument("--n-jobs", type=int, default=1, help="worker processes on this machine sharing the study")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # run trials only, no export
    s.set_defaults(func=functools.partial(cmd_search, dashboard=dashboard))

    e = sub.add_parser("export", help="re-export a profile from a study")
    e.add_argument("--storage", required=True)
    e.add_argument("--study-name", required=True)
    e.add_argument(
        "--pick",
        default="auto",
        help="auto (fastest; acceptance breaks near-ties), knee, fastest, most-faithful, trial:N, or routed "
        "(configurations and a rule picking one per prompt)",
    )
    e.add_argument("--out", required=True, help="profile JSON path")
    e.set_defaults(func=cmd_export)


def cmd_search(args, dashboard=None) -> int:
    from ..cliargs import settings_from_args
    from ..models import DEFAULT_MODEL
    from .run import SearchSettings, run_search

    if not 1 <= args.n_jobs <= MAX_JOBS:
        bound = "at least 1" if args.n_jobs < 1 else f"at most {MAX_JOBS}"
        raise UserError(f"--n-jobs must be {bound} (got {args.n_jobs}); it is the worker processes to start")
    name = args.study_name or (Path(args.out).name if args.out else "default")
    settings = settings_from_args(
        SearchSettings, args, model=args.model or DEFAULT_MODEL, out=args.out or f"artifacts/{name}"
    )
    if args.n_jobs > 1:
        from .workers import run_workers

        summary = run_workers(settings, args.n_jobs, dashboard)
    else:
        summary = run_search(settings, dashboard)
    if summary:
        print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    m, c = summary["metrics"], summary["config"]
    if m.get("plain_decoding_because"):
        print(f"profile: {summary['profile']}  (mode ar) -- {m['plain_decoding_because']}")
        if summary.get("dashboard"):
            print(f"  dashboard: {summary['dashboard']}")
        return
    if m.get("slower_than_ar"):
        print(
            f"warning: trial {summary['trial']} runs at {m['speedup_measured']:.2f}x plain decoding on held-out prompts"
        )
    vs_sd = f"{m['speedup_vs_sd']:.2f}x" if m.get("speedup_vs_sd") else "n/a"
    print(
        f"profile: {summary['profile']}  (trial {summary['trial']}, {summary['pareto']} on the feasible Pareto front)\n"
        f"  routing: skip attn {c['skip_attn']} mlp {c['skip_mlp']}; tau_accept {c['tau_accept']:.3g}, "
        f"tau_escalate {c['tau_escalate']:.3g}, kl {c['kl']}, gamma {c['gamma']}, drafter {c['drafter']}\n"
        f"  {m.get('evaluated_on')} ({m.get('held_out_prompts', 0)} prompts): speedup vs AR "
        f"{m['speedup_measured']:.2f}x (modelled {m.get('speedup_modelled') or 0:.2f}x), vs SD {vs_sd}, "
        f"acceptance {m['acceptance']:.2f} tok/full-equivalent call, fidelity {m['fidelity']:.3f}\n"
        f"  tier shares: "
        + ", ".join(f"{k} {v:.0%}" for k, v in m["tier_shares"].items())
        + (f"\n  dashboard: {summary['dashboard']}" if summary.get("dashboard") else "")
    )


def cmd_export(args) -> int:
    from ..credentials import check_storage
    from ..fsutil import check_output_file, check_outputs_spare_inputs
    from ..profile import write_profile
    from .export import build_profile, check_pick, pick_trial, routed_profile
    from .records import StudyRecord
    from .storage import load_study, sqlite_file

    check_storage(args.storage)  # all before the study is read
    check_output_file(args.out)
    check_outputs_spare_inputs([("--out", args.out)], [("--storage", sqlite_file(args.storage))])
    check_pick(args.pick)
    study = load_study(args.storage, args.study_name)
    if args.pick == "routed":
        profile = routed_profile(study)
        write_profile(args.out, profile)
        fit = profile["routes"]["fit"]
        print(json.dumps({"profile": args.out, "rule": profile["routes"]["rule"], "fit": fit}, indent=2))
        return 0
    trial = pick_trial(study, args.pick)
    held = StudyRecord.read(study).held_out.get(trial.number)
    profile = build_profile(study, trial, held)
    if held is not None and held["speedup_measured"] < 1.0:
        profile["metrics"]["slower_than_ar"] = True
        print(
            f"warning: trial {trial.number} ran at {held['speedup_measured']:.2f}x plain decoding on held-out prompts",
            file=sys.stderr,
        )
    write_profile(args.out, profile)
    print(json.dumps({"profile": args.out, "trial": trial.number, "metrics": profile["metrics"]}, indent=2))
    return 0


__all__ = ["add_search_commands", "argparse"]

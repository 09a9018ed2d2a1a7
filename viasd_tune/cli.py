"""``viasd-tune`` command line: search, generate, serve, bench, export, dashboard.

Bad input raises :class:`UserError` anywhere below; here it becomes one line on stderr and exit code 2
(``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from dataclasses import fields
from pathlib import Path

from .cliargs import finite_float
from .config import (
    DRAFTERS,
    GAMMA_MAX,
    KL_KINDS,
    MODES,
    TREE_NODES_MAX,
    TREE_SIZINGS,
    TREE_SOURCE_FIELDS,
    DecodeConfig,
    check_applicable,
    check_generation,
    field_scope,
)
from .credentials import ScrubFilter, scrub
from .errors import UserError
from .models import DEFAULT_MODEL
from .prompts import check_text
from .routing import SkipSet

# Named model pairs (packaged checkpoints, see fetch.py): target, draft (None: self-draft / prompt lookup).
PRESETS = {
    "smollm2": ("smollm2-135m", None),
    "qwen-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),  # same tokenizer: the reference pair
}


def _add_model_args(p: argparse.ArgumentParser, draft: bool = True) -> None:
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="named model pair: "
        + "; ".join(f"{k} = {t} + {d or 'no draft'}" for k, (t, d) in PRESETS.items()),
    )
    p.add_argument(
        "--model", help=f"target: packaged name, local dir, .gguf file or hub id (default {DEFAULT_MODEL})"
    )
    if draft:
        p.add_argument(
            "--draft", help="draft model (same tokenizer as the target); packaged name, dir, .gguf, hub id"
        )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)"
    )


def _add_decoder_args(p: argparse.ArgumentParser) -> None:
    """What builds a decoder: models and routing flags, or a tuned profile (``generate`` and ``serve``)."""
    _add_model_args(p)
    _add_decode_args(p)
    p.add_argument(
        "--profile", help="routing profile JSON from `viasd-tune search` (sets models and routing)"
    )
    p.add_argument(
        "--strict-host",
        action="store_true",
        help="with --profile: refuse to serve it on another matrix ISA or device than it was tuned on (default: warn)",
    )


def _add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default=None, help="decoding mode (default viasd)")
    p.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default=None,
        help="draft source (default: model with --draft, self with --draft-skip-*, else lookup)",
    )
    p.add_argument(
        "--gamma",
        type=int,
        default=None,
        help=f"draft tokens per round, 1..{GAMMA_MAX} (the cap with --draft-confidence; default 5)",
    )
    p.add_argument(
        "--skip-attn", default=None, help="slim verifier: attention sub-layers to skip, e.g. 3,5,7 or 3-7"
    )
    p.add_argument("--skip-mlp", default=None, help="slim verifier: MLP sub-layers to skip")
    p.add_argument(
        "--draft-skip-attn",
        "--draft-skip",
        dest="draft_skip_attn",
        default=None,
        help="self-draft (or, with --drafter model, the draft model): attention sub-layers to skip",
    )
    p.add_argument(
        "--draft-skip-mlp", default=None, help="self-draft (or the draft model): MLP sub-layers to skip"
    )
    p.add_argument(
        "--tau-accept", type=finite_float, default=None, help="D below this: accept the draft token directly"
    )
    p.add_argument(
        "--tau-escalate", type=finite_float, default=None, help="D at or above this: the full target verifies"
    )
    p.add_argument("--kl", choices=KL_KINDS, default=None, help="divergence (default forward)")
    p.add_argument(
        "--recheck",
        action="store_true",
        default=None,
        help="viasd: the full target's next batched forward re-checks the slim-settled tokens (lossless)",
    )
    p.add_argument(
        "--draft-confidence",
        type=finite_float,
        default=None,
        metavar="FLOAT",
        help="stop drafting once the drafter's top-1 probability is below this, in [0, 1) (default 0: off)",
    )
    p.add_argument(
        "--lookup-min",
        type=int,
        default=None,
        metavar="N",
        help="drafters lookup+model/lookup+self: use a prompt-lookup proposal of at least N tokens (or of γ), "
        "else the model drafts the round; 1..64 (default 1)",
    )
    p.add_argument(
        "--tree-nodes",
        type=int,
        default=None,
        metavar="N",
        help=f"mode sd: verify a token tree of up to N draft nodes in one target forward, 0..{TREE_NODES_MAX} "
        "(default 1: a chain of --gamma drafts); its depth is at most --gamma",
    )
    p.add_argument(
        "--tree-sizing",
        default=None,
        choices=TREE_SIZINGS,
        help="mode sd with --tree-nodes above 1: fixed verifies the N best nodes every round (default); cost cuts "
        "each round's tree to the size that maximises expected tokens per unit of this host's verify cost "
        "(measured when the model loads, ~10 s for 1.5B on 2 cores)",
    )
    for name in TREE_SOURCE_FIELDS:
        source, what = name.split("_")[1:]
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            metavar="N",
            help=f"token tree: the {source} source's {'depth' if what == 'depth' else 'branching (top-k)'}, "
            f"1..{GAMMA_MAX} (default {getattr(DecodeConfig, name)})",
        )


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (like every other error) and exit code 2; sub-commands
    inherit it."""

    def error(self, message: str):
        message = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="viasd-tune", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt with ar, sd or viasd (or a tuned --profile)")
    _add_decoder_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=finite_float, default=0.0)
    g.add_argument("--top-p", type=finite_float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--category",
        help="the prompt's task category (e.g. qa), read by a routed profile's rule; unused otherwise",
    )
    g.add_argument(
        "--json", action="store_true", help="print one JSON object: token_ids, text, stats, config"
    )
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser(
        "serve", help="serve a tuned --profile (or a decoder set by flags) over the OpenAI HTTP API"
    )
    _add_decoder_args(s)
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)"
    )
    s.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    s.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VIASD_TUNE_API_KEY if set, else none; "
        "the variable keeps the key out of the process list)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests that may wait while one generates (batch 1); more get 429 (default 16)",
    )
    s.set_defaults(func=cmd_serve)

    from .search.cli import add_search_commands

    add_search_commands(sub, _add_model_args, _write_dashboard)
    d = sub.add_parser("dashboard", help="write the Plotly Pareto dashboard of a study")
    d.add_argument("--out-dir", help="a search output folder (reads its study.db)")
    d.add_argument("--storage")
    d.add_argument("--study-name")
    d.add_argument("--out", help="HTML file (default <out-dir>/dashboard.html)")
    d.set_defaults(func=cmd_dashboard)
    from .bench.cli import add_bench_command

    add_bench_command(sub, _add_model_args, DEFAULT_MODEL)
    return parser


def _write_dashboard(study, out_dir, exported):
    """A search's dashboard beside its profile: the search is below the dashboard, so the CLI hands this in."""
    from .dashboard import write_beside_profile

    return write_beside_profile(study, out_dir, exported)


def cmd_dashboard(args) -> int:
    from . import dashboard
    from .credentials import check_storage
    from .fsutil import check_output_file, check_outputs_spare_inputs
    from .search.storage import sqlite_file

    if args.out_dir and (args.storage or args.study_name):
        raise UserError(
            "give --out-dir, or --storage and --study-name, not both: --out-dir reads its own study.db"
        )
    if not args.out_dir and not (args.storage and args.study_name):
        raise UserError("give --out-dir, or --storage and --study-name")
    out = args.out or (str(Path(args.out_dir) / "dashboard.html") if args.out_dir else "dashboard.html")
    if args.out:
        check_output_file(args.out)
    if args.out_dir:
        read = [("--out-dir's study.db", Path(args.out_dir) / "study.db")]
        read.append(("--out-dir's profile.json", Path(args.out_dir) / "profile.json"))
    else:
        read = [("--storage", sqlite_file(check_storage(args.storage)))]
    check_outputs_spare_inputs([("--out", out)], read)  # before the study is read
    if args.out_dir:
        path = dashboard.dashboard_from_out_dir(args.out_dir, args.out)
    else:
        path = dashboard.dashboard_from_storage(args.storage, args.study_name, out)
    print(path)
    return 0


def _given_flags(args) -> list[tuple[str, str]]:
    """``(field, flag)`` for every routing flag given, in DecodeConfig's field order; the flags of each field come
    from its metadata, so a field added to DecodeConfig is covered here without a second list."""
    return [
        (f.name, flag)
        for f in fields(DecodeConfig)
        for flag in field_scope(f)["flags"]
        if getattr(args, flag[2:].replace("-", "_"), None) is not None
    ]


def _decode_config(args) -> DecodeConfig:
    """The flags as a :class:`DecodeConfig`, validated (before any model loads): values first, then every flag
    given where it does nothing (at its default value too), and a --draft no drafter reads."""
    drafter = args.drafter or (
        "model" if args.draft else "self" if (args.draft_skip_attn or args.draft_skip_mlp) else "lookup"
    )

    def given(name: str, default):
        value = getattr(args, name)
        return default if value is None else value

    config = DecodeConfig(
        mode=given("mode", "viasd"),
        gamma=given("gamma", 5),
        drafter=drafter,
        skip=SkipSet.parse(args.skip_attn, args.skip_mlp),
        draft_skip=SkipSet.parse(
            args.draft_skip_attn, args.draft_skip_mlp, ("--draft-skip-attn", "--draft-skip-mlp")
        ),
        tau_accept=given("tau_accept", 0.0),
        tau_escalate=given("tau_escalate", 0.0),
        kl=given("kl", "forward"),
        recheck=given("recheck", False),
        draft_confidence=given("draft_confidence", 0.0),
        lookup_min=given("lookup_min", 1),
        tree_nodes=given("tree_nodes", 1),
        tree_sizing=given("tree_sizing", "fixed"),
        **{name: given(name, getattr(DecodeConfig, name)) for name in TREE_SOURCE_FIELDS},
    )
    check_applicable(config.mode, config.drafter, [name for name, _ in _given_flags(args)])
    if args.draft and (config.mode == "ar" or config.model_drafter != "model"):
        setting = "mode ar" if config.mode == "ar" else f"mode {config.mode} with drafter {config.drafter}"
        raise UserError(
            f"--draft does nothing in {setting}: a draft model drafts for drafter model/lookup+model in mode "
            "sd/viasd only; drop it or pick such a drafter"
        )
    return config


def _check_no_routing_flags(args) -> None:
    """A profile pins the routing; a routing flag next to it would be silently ignored, so it is refused."""
    clash = [flag for _, flag in _given_flags(args)]
    if clash:
        raise UserError(
            f"{', '.join(clash)} cannot be combined with --profile, which sets the routing; drop "
            f"{'them' if len(clash) > 1 else 'it'}, or leave out --profile to set the routing by flags"
        )


def _check_category(args) -> None:
    """``--category`` is read by a routed profile's rule only; anywhere else it would do nothing."""
    if args.category is None:
        return
    from .profile import load_profile

    if not args.profile or "routes" not in load_profile(args.profile):
        raise UserError(
            "--category does nothing here: only a routed profile's rule reads it (export one with "
            "--pick routed); drop it or pass such a --profile"
        )


def _check_decoder_args(args) -> None:
    """Every check of the flags that build a decoder (``generate`` and ``serve``), before any model loads or
    any port is taken: a profile pins the routing, and --strict-host checks a profile's host."""
    if args.profile:
        _check_no_routing_flags(args)
    elif args.strict_host:
        raise UserError(
            "--strict-host does nothing without --profile: it checks the host a profile was tuned on; drop it"
        )
    else:
        _decode_config(args)


def _load_decoder(args):
    """The decoder the flags ask for: a tuned --profile (its routing pinned) or --model/--draft + routing flags."""
    from . import models, runtime
    from .decoding.decoder import Decoder

    _check_decoder_args(args)
    if args.profile:
        return runtime.load(
            args.profile,
            model=args.model,
            draft=args.draft,
            device=args.device,
            dtype=None if args.dtype == "auto" else args.dtype,
            strict=True,
            strict_host=args.strict_host,
        )
    config = _decode_config(args)
    target = models.load(args.model or DEFAULT_MODEL, args.dtype, args.device, args.trust_remote_code)
    draft = None
    if args.draft and config.model_drafter == "model" and config.mode != "ar":
        draft = models.load(args.draft, args.dtype, args.device, args.trust_remote_code)
        models.check_same_tokenizer(target, draft)
    return Decoder(target.model, target.tokenizer, config, draft=draft.model if draft else None)


def cmd_generate(args) -> int:
    from . import runtime

    check_generation(args.max_new_tokens, args.temperature, args.top_p, args.seed)  # before any model loads
    check_text(args.prompt)
    _check_category(args)
    decoder = _load_decoder(args)
    routed = {"category": args.category} if isinstance(decoder, runtime.RoutedDecoder) else {}
    result = decoder.generate(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat="on" if args.chat else "off",
        **routed,
    )
    stats = result.stats.to_dict()
    if args.json:
        out = {"token_ids": result.token_ids, "text": result.text, "stats": stats}
        config = decoder.config_of(result) if routed else decoder.config
        print(json.dumps({**out, "config": config.to_dict()}))
    else:
        print(result.text)
        print(
            f"\n[{stats['new_tokens']} tokens in {stats['wall_time_s']:.2f}s, {stats['tokens_per_s']:.1f} tok/s; "
            f"direct/slim/full {stats['tokens_direct']}/{stats['tokens_slim']}/{stats['tokens_full']}, "
            f"{stats['full_calls']} full calls]",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args) -> int:
    from .profile import load_profile
    from .serve import create_app, listen, run

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be from 0 to 65535 (got {args.port}); 0 picks a free port")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be 0 or more (got {args.max_queue})")
    key = args.api_key if args.api_key is not None else os.environ.get("VIASD_TUNE_API_KEY")
    if key is not None and not key.strip():
        raise UserError(
            "the API key (--api-key or $VIASD_TUNE_API_KEY) is empty; give one or leave both unset"
        )
    _check_decoder_args(args)
    name = args.model or (load_profile(args.profile)["target"]["name"] if args.profile else DEFAULT_MODEL)
    sock = listen(args.host, args.port)  # a taken port fails now, not after the model has loaded
    try:
        app = create_app(_load_decoder(args), name, key, args.max_queue)
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(
        f"viasd-tune: serving {name} at {url}/v1 (batch 1, max queue {args.max_queue})",
        file=sys.stderr,
        flush=True,
    )
    logging.getLogger("viasd_tune.serve").setLevel(logging.INFO)  # one line per request
    run(app, sock)
    return 0


def apply_preset(args: argparse.Namespace) -> None:
    """Fill --model/--draft from --preset; explicit --model/--draft win."""
    preset = getattr(args, "preset", None)
    if preset:
        target, draft = PRESETS[preset]
        args.model = args.model or target
        if hasattr(args, "draft"):
            args.draft = args.draft or draft


def _show_warning(storages: list[str | None]):
    """Warnings as one ``viasd-tune: warning:`` line each on stderr, with any storage secret hidden."""

    def show(message, category, filename, lineno, file=None, line=None):
        text = " ".join(str(message).split())
        print(f"viasd-tune: warning: {scrub(text, storages)}", file=file or sys.stderr)

    return show


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_preset(args)
    logging.basicConfig(level=logging.INFO if args.debug else logging.WARNING, format="%(message)s")
    # Every line this command prints, logs or warns passes the one redaction (credentials.py).
    storages = [getattr(args, "storage", None)]
    hide = ScrubFilter(storages)
    handlers = logging.getLogger().handlers + logging.getLogger("optuna").handlers
    for handler in handlers:
        handler.addFilter(hide)
    shown, warnings.showwarning = warnings.showwarning, _show_warning(storages)
    if not args.debug:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()  # weight-loading bars; our own long steps keep theirs
    try:
        return args.func(args)
    except UserError as e:
        if args.debug:
            raise
        print(f"viasd-tune: error: {scrub(str(e), storages)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("viasd-tune: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = shown
        for handler in handlers:
            handler.removeFilter(hide)


if __name__ == "__main__":
    sys.exit(main())

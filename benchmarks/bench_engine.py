#!/usr/bin/env python
"""Engine benchmark: our ``ar`` / ``sd`` decoders against Hugging Face ``generate`` on the same models.

Methods (all greedy, same dtype/device, same prompts, same ``max_new_tokens``; EOS may stop a run early and the
tokens actually produced are what is counted):

  hf                   target.generate(ids, do_sample=False, max_new_tokens=N)
  ar                   Decoder(target, tok, DecodeConfig(mode="ar"))
  hf-assisted          target.generate(ids, assistant_model=draft, ...) with the draft's generation_config set to
                       num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant" and
                       assistant_confidence_threshold=0 -- i.e. exactly gamma drafts per round, the algorithm ``sd``
                       runs (HF 5.x otherwise stops drafting early once the draft's top-1 probability < 0.4)
  hf-assisted-default  target.generate(ids, assistant_model=draft, ...) with HF's own defaults untouched
                       (transformers 5.24: 20 tokens, schedule "constant", confidence threshold 0.4)
  hf-assisted-conf     (opt-in) gamma tokens, "constant", HF's default confidence threshold 0.4
  hf-assisted-heuristic (opt-in) gamma tokens to start, schedule "heuristic" (reset before every call)
  sd                   Decoder(target, tok, DecodeConfig(mode="sd", gamma=gamma, drafter="model"), draft=draft)

Runs are interleaved: for every repeat and prompt each method runs once, and the method order is rotated from one
(repeat, prompt) to the next so no method always runs first. One untimed warm-up generation per method runs first.

Writes a markdown report (``--out``) and the raw per-run records next to it (same name, ``.json``).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = "/work/shared/data/spec_bench/question.jsonl"
DEFAULT_METHODS = ("hf", "ar", "hf-assisted", "hf-assisted-default", "sd")
ALL_METHODS = (*DEFAULT_METHODS, "hf-assisted-conf", "hf-assisted-heuristic")
OURS = ("ar", "sd")
SPECULATIVE = ("sd", "hf-assisted", "hf-assisted-default", "hf-assisted-conf", "hf-assisted-heuristic")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16", "auto"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=10, help="number of Spec-Bench prompts (category-stratified)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="prompt-sampling seed")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--chat", default="auto", choices=("auto", "on", "off"))
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated subset of {', '.join(ALL_METHODS)} ('hf' is always run: it is the baseline)",
    )
    p.add_argument("--warmup-tokens", type=int, default=16, help="max_new_tokens of the untimed warm-up runs")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=60.0,
        help="before each timed run wait up to this many seconds for other processes to go idle (0: don't wait)",
    )
    p.add_argument(
        "--foreign-max",
        type=float,
        default=0.05,
        help="repeat a run when other processes used more than this many cores on average during it",
    )
    p.add_argument("--retries", type=int, default=3, help="at most this many repeats of a disturbed run")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "engine.md"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ALL_METHODS]
    if bad:
        p.error(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(ALL_METHODS)}")
    if "hf" not in methods:
        methods.insert(0, "hf")
    args.methods = list(dict.fromkeys(methods))
    if any(m in SPECULATIVE for m in args.methods) and not args.draft:
        p.error("the speculative methods need --draft")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Call counting: a forward pre-hook on each model, identical for every method, so HF's target calls can be counted
# the same way as ours (ours also report them in Stats; the JSON keeps both as a cross-check).


class CallCounter:
    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.tokens = 0
        self._h = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        if isinstance(ids, torch.Tensor):
            self.tokens += ids.shape[-1]

    def reset(self) -> None:
        self.calls = self.tokens = 0


# ----------------------------------------------------------------------------------------------------------------
# Contention control. The machine has 2 cores shared with other work; torch's 2 OpenMP threads degrade far more than
# 2x when another process takes a core (each parallel region waits for the descheduled thread). Before every timed
# run we wait until the machine is idle, and during it we measure the CPU time *other* processes used
# (system busy time from /proc/stat minus ours from /proc/self/stat); a run where others used more than
# --foreign-max of a core on average is repeated (up to --retries times) and the record keeps the count.


class CpuMeter:
    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    @staticmethod
    def _busy() -> int:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - (v[4] if len(v) > 4 else 0)  # minus idle and iowait

    @staticmethod
    def _own() -> int:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime, all threads

    def __init__(self):
        try:
            self._busy(), self._own()
            self.ok = True
        except (OSError, ValueError, IndexError):
            self.ok = False

    def snapshot(self) -> tuple[int, int, float]:
        return (self._busy(), self._own(), time.perf_counter()) if self.ok else (0, 0, time.perf_counter())

    def foreign_cores(self, a, b) -> float:
        """Average number of cores other processes kept busy between two snapshots."""
        if not self.ok or b[2] <= a[2]:
            return 0.0
        return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / self.TICK / (b[2] - a[2]))

    def wait_idle(self, max_wait_s: float, threshold: float = 0.05, window_s: float = 0.5, need: int = 2) -> float:
        """Block until others use < ``threshold`` cores for ``need`` consecutive windows; return seconds waited."""
        if not self.ok or max_wait_s <= 0:
            return 0.0
        start, quiet = time.perf_counter(), 0
        while quiet < need and time.perf_counter() - start < max_wait_s:
            a = self.snapshot()
            time.sleep(window_s)
            quiet = quiet + 1 if self.foreign_cores(a, self.snapshot()) < threshold else 0
        return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        from viasd_tune import models
        from viasd_tune.decoding.decoder import DecodeConfig, Decoder

        self.args = args
        t0 = time.perf_counter()
        self.target_lm = models.load(args.target, dtype=args.dtype, device=args.device)
        self.draft_lm = None
        if any(m in SPECULATIVE for m in args.methods):
            self.draft_lm = models.load(args.draft, dtype=args.dtype, device=args.device)
            models.check_same_tokenizer(self.target_lm, self.draft_lm)
        self.load_s = time.perf_counter() - t0
        self.target = self.target_lm.model
        self.draft = self.draft_lm.model if self.draft_lm else None
        self.tok = self.target_lm.tokenizer
        self.eos = sorted(models.eos_ids(self.target, self.tok))
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        self.hf_kwargs = dict(do_sample=False, eos_token_id=self.eos, pad_token_id=pad)

        self.decoders = {}
        if "ar" in args.methods:
            self.decoders["ar"] = Decoder(self.target, self.tok, DecodeConfig(mode="ar"), eos=set(self.eos))
        if "sd" in args.methods:
            self.decoders["sd"] = Decoder(
                self.target,
                self.tok,
                DecodeConfig(mode="sd", gamma=args.gamma, drafter="model"),
                draft=self.draft,
                eos=set(self.eos),
            )

        self.meter = CpuMeter()
        self.t_count = CallCounter(self.target)
        self.d_count = CallCounter(self.draft) if self.draft is not None else None
        if self.draft is not None:
            self.draft_gc0 = copy.deepcopy(self.draft.generation_config)
            self.assist_configs = self._assist_configs()

    def _assist_configs(self) -> dict:
        g = self.args.gamma
        out = {}
        c = copy.deepcopy(self.draft_gc0)
        c.num_assistant_tokens, c.num_assistant_tokens_schedule, c.assistant_confidence_threshold = g, "constant", 0.0
        out["hf-assisted"] = c
        out["hf-assisted-default"] = copy.deepcopy(self.draft_gc0)  # HF fills its defaults in itself
        c = copy.deepcopy(self.draft_gc0)
        c.num_assistant_tokens, c.num_assistant_tokens_schedule = g, "constant"
        out["hf-assisted-conf"] = c  # threshold left unset -> HF default 0.4
        c = copy.deepcopy(self.draft_gc0)
        c.num_assistant_tokens, c.num_assistant_tokens_schedule = g, "heuristic"
        out["hf-assisted-heuristic"] = c
        return out

    def assistant_settings(self, method: str) -> dict:
        """What HF will actually use for this method (after filling in its global defaults)."""
        c = copy.deepcopy(self.assist_configs[method])
        c.update(**c._get_default_generation_params(), defaults_only=True)
        return {
            "num_assistant_tokens": c.num_assistant_tokens,
            "num_assistant_tokens_schedule": c.num_assistant_tokens_schedule,
            "assistant_confidence_threshold": c.assistant_confidence_threshold,
        }

    def run(self, method: str, ids: torch.Tensor, max_new: int, clean: bool = True) -> dict:
        """A timed generation on an idle machine: wait for idle, run, repeat if other processes interfered."""
        a = self.args
        waited, retries = 0.0, 0
        while True:
            if clean:
                waited += self.meter.wait_idle(a.wait_idle)
            before = self.meter.snapshot()
            rec = self._run_once(method, ids, max_new)
            rec["foreign_cores"] = round(self.meter.foreign_cores(before, self.meter.snapshot()), 3)
            if not clean or rec["foreign_cores"] <= a.foreign_max or retries >= a.retries:
                break
            retries += 1
        rec["waited_s"], rec["retries"] = round(waited, 1), retries
        return rec

    def _run_once(self, method: str, ids: torch.Tensor, max_new: int) -> dict:
        """One timed generation; returns tokens, seconds and call counts."""
        self.t_count.reset()
        if self.d_count:
            self.d_count.reset()
        stats = None
        if method in self.decoders:
            dec = self.decoders[method]
            c0, t0 = time.process_time(), time.perf_counter()
            res = dec.generate(ids, max_new_tokens=max_new)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            out = list(res.token_ids)
            stats = res.stats.to_dict()
        else:
            kw = dict(self.hf_kwargs, max_new_tokens=max_new)
            if method != "hf":
                # fresh copy every call: the "heuristic" schedule writes its state back into the draft's config
                self.draft.generation_config = copy.deepcopy(self.assist_configs[method])
                kw["assistant_model"] = self.draft
            inp = ids.unsqueeze(0)
            c0, t0 = time.process_time(), time.perf_counter()
            seq = self.target.generate(inp, attention_mask=torch.ones_like(inp), **kw)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            out = seq[0, inp.shape[1] :].tolist()
            if method != "hf":
                self.draft.generation_config = copy.deepcopy(self.draft_gc0)
        rec = {
            "tokens": len(out),
            "seconds": dt,
            "cpu_seconds": cpu,  # process CPU time; cpu/wall well below the thread count means we were starved
            "target_calls": self.t_count.calls,
            "target_tokens_fed": self.t_count.tokens,
            "draft_calls": self.d_count.calls if self.d_count else 0,
            "ids": out,
        }
        if stats is not None:
            rec["stats"] = stats
        return rec


# ----------------------------------------------------------------------------------------------------------------


def git_state() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "viasd_tune"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return f"{head}{' + uncommitted changes in viasd_tune/' if dirty else ''}" if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def fmt_range(values: list[float], spec: str = ".2f") -> str:
    return f"{statistics.median(values):{spec}} [{min(values):{spec}}–{max(values):{spec}}]"


def summarise(args, bench: Bench, prompts, records: dict) -> dict:
    """records[method][repeat][prompt_index] -> run record."""
    methods, R, P = args.methods, args.repeats, len(prompts)
    summary = {}
    per_rep_tps = {
        m: [
            sum(records[m][r][i]["tokens"] for i in range(P)) / sum(records[m][r][i]["seconds"] for i in range(P))
            for r in range(R)
        ]
        for m in methods
    }
    for m in methods:
        runs = [records[m][r][i] for r in range(R) for i in range(P)]
        tokens = sum(x["tokens"] for x in runs)
        secs = sum(x["seconds"] for x in runs)
        ratios = [per_rep_tps[m][r] / per_rep_tps["hf"][r] for r in range(R)]
        s = {
            "tokens": tokens,
            "seconds": secs,
            "tok_s_total": tokens / secs,
            "tok_s_per_repeat": per_rep_tps[m],
            "speedup_vs_hf_per_repeat": ratios,
            "speedup_vs_hf_median": statistics.median(ratios),
            "target_calls": sum(x["target_calls"] for x in runs),
            "draft_calls": sum(x["draft_calls"] for x in runs),
            # noise-robust view: per prompt the fastest repeat
            "tok_s_best_of_repeats": sum(records[m][0][i]["tokens"] for i in range(P))
            / sum(min(records[m][r][i]["seconds"] for r in range(R)) for i in range(P)),
            "cpu_per_wall_median": statistics.median(x["cpu_seconds"] / x["seconds"] for x in runs),
            "foreign_cores_max": max(x["foreign_cores"] for x in runs),
            "disturbed_runs": sum(x["foreign_cores"] > args.foreign_max for x in runs),
            "retries": sum(x["retries"] for x in runs),
            "waited_s": sum(x["waited_s"] for x in runs),
        }
        if m in SPECULATIVE:
            if m == "sd":
                full_calls = sum(x["stats"]["full_calls"] for x in runs)
                s["accepted_per_call"] = sum(x["stats"]["new_tokens"] for x in runs) / full_calls
                s["stats_full_calls_equal_hook_count"] = full_calls == s["target_calls"]
            else:
                s["accepted_per_call"] = tokens / s["target_calls"]
        # Greedy outputs vs hf greedy, per prompt (repeat 0), and whether a method was stable across repeats.
        same, diffs, unstable = 0, [], []
        for i in range(P):
            a, b = records[m][0][i]["ids"], records["hf"][0][i]["ids"]
            if a == b:
                same += 1
            else:
                diffs.append({"prompt": prompts[i].id, "first_diff": first_diff(a, b), "len": len(a), "hf_len": len(b)})
            if any(records[m][r][i]["ids"] != a for r in range(1, R)):
                unstable.append(prompts[i].id)
        s["identical_to_hf"] = same
        s["diffs"] = diffs
        s["unstable_prompts"] = unstable
        summary[m] = s
    return summary


def render(args, bench: Bench, prompts, prompt_lens, summary, records, wall_s, started) -> str:
    methods, R, P = args.methods, args.repeats, len(prompts)
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    lines = [
        "# Engine benchmark: ours vs Hugging Face generate",
        "",
        f"- command: `{cmd}`",
        f"- date: {started:%Y-%m-%d %H:%M:%S} UTC; wall time {wall_s / 60:.1f} min (models loaded in {bench.load_s:.0f} s)",
        f"- machine: {cpu_name()}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}, "
        f"device {args.device}; torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
        f"Python {platform.python_version()}",
        f"- models: target `{args.target}` ({sum(p.numel() for p in bench.target.parameters()) / 1e6:.0f}M params)"
        + (
            f", draft `{args.draft}` ({sum(p.numel() for p in bench.draft.parameters()) / 1e6:.0f}M params)"
            if bench.draft is not None
            else ""
        )
        + f"; dtype {args.dtype}",
        f"- decoding: greedy, max_new_tokens {args.max_new_tokens} (EOS {bench.eos} may stop earlier; produced "
        f"tokens are counted), gamma {args.gamma}; {P} Spec-Bench prompts (seed {args.seed}, chat template "
        f"{args.chat}), {R} repeats, methods interleaved with rotated order; one untimed warm-up per method",
        f"- engine code: git {git_state()}",
        f"- contention control: each timed run waits (≤ {args.wait_idle:.0f} s) for other processes to go idle and is "
        f"repeated (≤ {args.retries}×) when they used > {args.foreign_max} cores on average during it: "
        f"{sum(summary[m]['retries'] for m in methods)} runs repeated, "
        f"{sum(summary[m]['disturbed_runs'] for m in methods)} of {R * P * len(methods)} kept disturbed, "
        f"{sum(summary[m]['waited_s'] for m in methods) / 60:.1f} min spent waiting; load average at start "
        f"{bench.load_start}, at end {bench.load_end}",
    ]
    if bench.draft is not None:
        for m in methods:
            if m in bench.assist_configs:
                lines.append(f"- `{m}` assistant settings as HF uses them: {bench.assistant_settings(m)}")
    lines += [
        "",
        "| method | tok/s median [min–max] over repeats | tok/s total | speedup vs hf (median [min–max]) | "
        "accepted tokens / target call | outputs identical to hf | tok/s best-of-repeats | CPU/wall | disturbed runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        s = summary[m]
        acc = f"{s['accepted_per_call']:.2f}" if "accepted_per_call" in s else "–"
        ident = "(baseline)" if m == "hf" else f"{s['identical_to_hf']}/{P}"
        lines.append(
            f"| {m} | {fmt_range(s['tok_s_per_repeat'])} | {s['tok_s_total']:.2f} | "
            f"{fmt_range(s['speedup_vs_hf_per_repeat'], '.3f')} | {acc} | {ident} | "
            f"{s['tok_s_best_of_repeats']:.2f} | {s['cpu_per_wall_median']:.2f} | {s['disturbed_runs']}/{R * P} |"
        )
    lines += [
        "",
        "tok/s = tokens produced / wall seconds of the `generate` call (prefill included). *best-of-repeats*: per "
        "prompt the fastest repeat (robust to noise). *CPU/wall*: median process CPU seconds per wall second "
        f"({torch.get_num_threads()} = all threads busy or spinning). *disturbed*: runs during which other processes "
        f"still used > {args.foreign_max} cores after the retries.",
    ]
    lines.append("")
    # Targets of the brief.
    checks = []
    if "ar" in methods:
        r = summary["ar"]["speedup_vs_hf_median"]
        checks.append(f"- `ar` vs `hf`: {r:.3f}× ({(r - 1) * 100:+.1f} %); target within 5 % → "
                      f"{'MET' if r >= 0.95 else 'MISSED'}")
    if "sd" in methods and "hf-assisted" in methods:
        ratios = [
            a / b
            for a, b in zip(summary["sd"]["tok_s_per_repeat"], summary["hf-assisted"]["tok_s_per_repeat"], strict=True)
        ]
        r = statistics.median(ratios)
        checks.append(
            f"- `sd` vs `hf-assisted` (same γ={args.gamma}): {fmt_range(ratios, '.3f')}× (median of per-repeat ratios);"
            f" target ≥ 1 → {'MET' if r >= 1.0 else 'MISSED'}"
        )
    if checks:
        lines += ["**Targets**", "", *checks, ""]
    # Output identity details.
    lines += ["**Greedy outputs vs `hf`** (repeat 1; bf16 near-ties can flip a token between a k-token block and single steps)", ""]
    for m in methods:
        if m == "hf":
            continue
        s = summary[m]
        if s["diffs"]:
            d = "; ".join(
                f"{x['prompt']} diverges at token {x['first_diff']} (len {x['len']} vs hf {x['hf_len']})"
                for x in s["diffs"]
            )
            lines.append(f"- `{m}`: {s['identical_to_hf']}/{P} identical; {d}")
        else:
            lines.append(f"- `{m}`: {P}/{P} identical")
        if s["unstable_prompts"]:
            lines.append(f"  - output changed between repeats on: {', '.join(s['unstable_prompts'])}")
    hf_unstable = summary["hf"]["unstable_prompts"]
    if hf_unstable:
        lines.append(f"- `hf` itself changed output between repeats on: {', '.join(hf_unstable)}")
    lines.append("")
    # Per-prompt table.
    lines += [
        "**Per prompt** (median seconds over repeats / tokens produced in repeat 1)",
        "",
        "| prompt | category | prompt tokens | " + " | ".join(methods) + " |",
        "|---|---|---|" + "---|" * len(methods),
    ]
    for i, p in enumerate(prompts):
        cells = []
        for m in methods:
            secs = statistics.median(records[m][r][i]["seconds"] for r in range(R))
            cells.append(f"{secs:.1f} s / {records[m][0][i]['tokens']}")
        lines.append(f"| {p.id} | {p.category} | {prompt_lens[i]} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import transformers
    from tqdm import tqdm

    from viasd_tune.prompts import encode_prompt, load_prompts, sample_prompts

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    started = _dt.datetime.now(_dt.UTC)
    t_start = time.perf_counter()

    prompts = sample_prompts(load_prompts(args.data), args.prompts, seed=args.seed)
    print(f"loading {args.target}" + (f" + {args.draft}" if args.draft else "") + f" ({args.dtype}) ...", file=sys.stderr)
    load_start = tuple(round(x, 2) for x in os.getloadavg())
    bench = Bench(args)
    bench.load_start = load_start
    device = bench.target.device
    enc = [torch.tensor(encode_prompt(bench.tok, p.text, args.chat), dtype=torch.long, device=device) for p in prompts]
    prompt_lens = [int(e.numel()) for e in enc]
    print(
        f"loaded in {bench.load_s:.0f} s; {len(prompts)} prompts ({', '.join(sorted({p.category for p in prompts}))}), "
        f"prompt tokens {min(prompt_lens)}–{max(prompt_lens)}; methods {', '.join(args.methods)}",
        file=sys.stderr,
    )

    methods, R, P = args.methods, args.repeats, len(prompts)
    records = {m: [[None] * P for _ in range(R)] for m in methods}
    with torch.inference_mode():
        for m in methods:  # untimed warm-up
            bench.run(m, enc[0], args.warmup_tokens, clean=False)
        bar = tqdm(total=R * P * len(methods), disable=args.no_progress, desc="runs", unit="run", dynamic_ncols=True)
        k = 0
        for r in range(R):
            for i in range(P):
                order = methods[k % len(methods) :] + methods[: k % len(methods)]
                k += 1
                for m in order:
                    bar.set_postfix_str(f"rep {r + 1} prompt {i + 1} {m}")
                    records[m][r][i] = bench.run(m, enc[i], args.max_new_tokens)
                    bar.update(1)
        bar.close()

    wall_s = time.perf_counter() - t_start
    bench.load_end = tuple(round(x, 2) for x in os.getloadavg())
    summary = summarise(args, bench, prompts, records)
    report = render(args, bench, prompts, prompt_lens, summary, records, wall_s, started)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report, encoding="utf-8")
    raw = {
        "args": {k: v for k, v in vars(args).items()},
        "argv": sys.argv,
        "started_utc": started.isoformat(),
        "wall_s": wall_s,
        "prompts": [{"id": p.id, "category": p.category, "tokens": n} for p, n in zip(prompts, prompt_lens, strict=True)],
        "summary": summary,
        "records": records,
    }
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str), encoding="utf-8")
    print(report)
    print(f"wrote {out} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

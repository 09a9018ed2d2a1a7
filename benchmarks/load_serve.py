#!/usr/bin/env python
"""Load on `viasd-tune serve`: time to first token, total latency, tokens/s and errors at 1, 4 and 16 clients.

Every client sends streamed chat completions back to back (greedy unless --temperature) and reads them to
``[DONE]``; a level ends when all its clients are done. The server is batch 1, so with more clients than one the
time to first token includes the wait in its queue: that is what a client sees. Each answer's ``viasd`` stats
(the decoder's own tokens/s and tokens per full-target call) are kept beside it, so decode speed and queueing
can be told apart.

Against a running server (loopback only: load tests never leave this host):

    python benchmarks/load_serve.py --url http://127.0.0.1:8000 --label qwen-profile

or starting one from this checkout (stopped with SIGTERM afterwards; its exit status is checked):

    python benchmarks/load_serve.py --serve "--profile benchmarks/results/profile-qwen-specbench.json" \\
        --label qwen-profile

Writes ``serve-load-<label>.md`` and ``.json`` to --out (benchmarks/results) with the host's matrix ISA.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx2 as httpx
import numpy as np

from viasd_tune import host
from viasd_tune.prompts import load_prompts, sample_prompts

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (loopback only)")
    where.add_argument(
        "--serve", metavar="ARGS", help="start `viasd-tune serve ARGS --port 0` here and stop it after"
    )
    p.add_argument("--levels", default="1,4,16", help="concurrent clients per level (default 1,4,16)")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends in a level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--data", default="builtin", help="prompt source: builtin, humaneval or a .jsonl file")
    p.add_argument("--seed", type=int, default=0, help="which prompts are drawn")
    p.add_argument(
        "--api-key", default=os.environ.get("VIASD_TUNE_API_KEY"), help="default $VIASD_TUNE_API_KEY"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds one request may take (queue included)")
    p.add_argument(
        "--start-timeout", type=float, default=900, help="seconds --serve may take to load the model"
    )
    p.add_argument("--label", default="run", help="names the report: serve-load-<label>.md")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]
    if not re.fullmatch(r"[\w.-]+", args.label):
        p.error("--label takes letters, digits, '.', '-' and '_' only")
    if min(args.levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        p.error("--levels, --requests-per-client and --max-tokens must be at least 1")
    if args.serve is None and urlsplit(args.url).hostname not in LOOPBACK:
        p.error(
            f"--url must be a loopback address ({', '.join(sorted(LOOPBACK))}): load tests stay on this host"
        )
    return args


class StartedServer:
    """`viasd-tune serve ARGS --port 0` from this checkout, its output in a temporary log file."""

    def __init__(self, serve_args: str, timeout_s: float):
        self.args = shlex.split(serve_args)
        self.log_path = Path(tempfile.mkstemp(prefix="viasd-serve-", suffix=".log")[1])
        cmd = [
            sys.executable,
            "-m",
            "viasd_tune.cli",
            "serve",
            *self.args,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.url = self._wait(timeout_s)

    def _wait(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(
                    f"the server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            m = re.search(
                r"serving .* at (http://127\.0\.0\.1:\d+)/v1", self.log_path.read_text(errors="replace")
            )
            if m:
                try:
                    if httpx.get(f"{m.group(1)}/health", timeout=5).status_code == 200:
                        return m.group(1)
                except httpx.TransportError:
                    pass
            time.sleep(1)
        self.proc.kill()
        sys.exit(f"the server did not start within {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed chat completion: when its first text came, when it ended, its usage and decoder stats."""
    out: dict = {"ok": False, "ttft_s": None, "latency_s": None, "completion_tokens": 0, "error": None}
    start = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                out["error"] = f"HTTP {r.status_code}: {text[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["ok"] = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out["error"] = f"stream error: {chunk['error'].get('message')}"
                    break
                choices = chunk.get("choices") or []
                if out["ttft_s"] is None and choices and choices[0].get("delta", {}).get("content"):
                    out["ttft_s"] = time.perf_counter() - start
                if "viasd" in chunk:
                    out["stats"] = chunk["viasd"]
                if chunk.get("usage"):
                    out["completion_tokens"] = chunk["usage"]["completion_tokens"]
                    out["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["latency_s"] = time.perf_counter() - start
    if out["ok"] and out["ttft_s"] is None:  # an answer with no text at all
        out["ttft_s"] = out["latency_s"]
    return out


async def run_level(url: str, model: str, clients: int, prompts: list[str], args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as http:

        async def client(c: int) -> list[dict]:
            records = []
            for k in range(args.requests_per_client):
                text = prompts[(c * args.requests_per_client + k) % len(prompts)]
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": args.max_tokens,
                    "temperature": args.temperature,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                records.append({"client": c, **await one_request(http, url, body)})
            return records

        start = time.perf_counter()
        records = [r for rs in await asyncio.gather(*(client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    return summarise(clients, records, wall)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(clients: int, records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["ok"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    decode = [r["stats"]["tokens_per_s"] for r in ok if r.get("stats")]
    per_call = [r["stats"]["tokens_per_full_call"] for r in ok if r.get("stats")]
    errors: dict[str, int] = {}
    for r in records:
        if not r["ok"]:
            kind = (r["error"] or "unknown").split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    return {
        "clients": clients,
        "requests": len(records),
        "ok": len(ok),
        "errors": errors,
        "wall_s": wall,
        "ttft_p50_s": _pct([r["ttft_s"] for r in ok], 50),
        "ttft_p95_s": _pct([r["ttft_s"] for r in ok], 95),
        "latency_p50_s": _pct([r["latency_s"] for r in ok], 50),
        "latency_p95_s": _pct([r["latency_s"] for r in ok], 95),
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "decode_tokens_per_s_median": _pct(decode, 50),
        "tokens_per_full_call_mean": float(np.mean(per_call)) if per_call else None,
        "records": records,
    }


def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def report(meta: dict, levels: list[dict]) -> str:
    m = meta
    lines = [
        f"# `viasd-tune serve` under load: {m['label']}",
        "",
        f"- date: {m['date']}; command: `{m['command']}`",
        f"- host: {m['cpu']} · matrix ISA **{m['matrix_isa']}** · {m['cores']} cores · load average at start "
        f"{m['load_start']}, at end {m['load_end']} · "
        + ", ".join(f"{k}={v}" for k, v in m["env"].items() if v is not None),
        f"- server: model `{m['model']}`"
        + (f", started as `viasd-tune serve {m['serve']}`" if m["serve"] else ""),
        f"- each client: {m['requests_per_client']} streamed chat completion(s) in turn, max_tokens "
        f"{m['max_tokens']}, temperature {m['temperature']}, prompts from `{m['data']}`",
        "- batch 1: one generation at a time, the rest queue, so time to first token (TTFT) includes the queue; "
        "tokens/s is all clients' completion tokens over the level's wall time; decode tok/s is the decoder's "
        "own speed per answer (its `viasd.tokens_per_s`, median)",
        "",
        "| clients | requests | ok | errors | TTFT p50 s | TTFT p95 s | latency p50 s | latency p95 s "
        "| tokens/s | decode tok/s | tokens per full call |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        errors = ", ".join(f"{k} ×{v}" for k, v in lv["errors"].items()) or "0"
        lines.append(
            f"| {lv['clients']} | {lv['requests']} | {lv['ok']} | {errors} | {_f(lv['ttft_p50_s'])} "
            f"| {_f(lv['ttft_p95_s'])} | {_f(lv['latency_p50_s'])} | {_f(lv['latency_p95_s'])} "
            f"| {_f(lv['tokens_per_s'], 1)} | {_f(lv['decode_tokens_per_s_median'], 1)} "
            f"| {_f(lv['tokens_per_full_call_mean'])} |"
        )
    if m.get("server_exit") is not None:
        lines += ["", f"The server was stopped with SIGTERM and exited with status {m['server_exit']}."]
    return "\n".join(lines) + "\n"


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pool = load_prompts(args.data)
    n = max(args.levels) * args.requests_per_client
    prompts = [p.text for p in sample_prompts(pool, min(n, len(pool)), args.seed)]
    started = StartedServer(args.serve, args.start_timeout) if args.serve else None
    url = started.url if started else args.url.rstrip("/")
    meta = {
        "label": args.label,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/load_serve.py", *sys.argv[1:]]),
        "cpu": host.cpu_name(),
        "matrix_isa": host.matrix_isa("cpu"),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "serve": args.serve,
        "requests_per_client": args.requests_per_client,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "data": args.data,
        # libgomp's default spin-wait makes torch many times slower on a host other processes keep busy;
        # OMP_WAIT_POLICY=PASSIVE avoids that there (see docs/serve.md), so the report says which was in force
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")},
        "load_start": _load(),
        "server_exit": None,
    }
    levels = []
    try:
        health = httpx.get(f"{url}/health", timeout=30).json()
        meta["model"] = health["model"]
        warm = asyncio.run(run_level(url, health["model"], 1, prompts[:1], _one(args)))  # first-call costs
        if warm["ok"] != 1:
            sys.exit(f"the warm-up request failed: {warm['records'][0]['error']}")
        for clients in args.levels:
            print(f"{clients} clients...", file=sys.stderr, flush=True)
            levels.append(asyncio.run(run_level(url, health["model"], clients, prompts, args)))
    finally:
        if started is not None:
            meta["server_exit"] = started.stop()
    meta["load_end"] = _load()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = report(meta, levels)
    (out / f"serve-load-{args.label}.md").write_text(md)
    (out / f"serve-load-{args.label}.json").write_text(json.dumps({"meta": meta, "levels": levels}, indent=1))
    print(md)
    return 0 if all(lv["ok"] == lv["requests"] for lv in levels) else 1


def _one(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "requests_per_client": 1})


if __name__ == "__main__":
    sys.exit(main())

"""``--n-jobs J``: J worker processes on one storage (Optuna coordinates them); this process is one of them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from .run import SearchSettings, run_search


def run_workers(s: SearchSettings, n_jobs: int) -> dict:
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    storage = s.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    s = replace(s, storage=storage, study_name=s.study_name or out.name)
    argv = [arg for arg in sys.argv[1:] if arg != "--debug"]
    argv = _set(argv, "--n-jobs", "1")
    argv = _set(_set(argv, "--storage", storage), "--study-name", s.study_name)
    argv = _set(argv, "--out", str(out))
    procs = [
        subprocess.Popen([sys.executable, "-m", "viasd_tune.cli", *argv, "--no-progress", "--worker"])
        for _ in range(n_jobs - 1)
    ]
    try:
        summary = run_search(s)  # this process counts toward the trials too, and exports at the end
    finally:
        for p in procs:
            p.wait()
    return summary


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    """Replace or append ``flag value`` in an argv list."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == flag:
            skip = i + 1 < len(argv)
            continue
        if arg.startswith(flag + "="):
            continue
        out.append(arg)
    return [*out, flag, value]

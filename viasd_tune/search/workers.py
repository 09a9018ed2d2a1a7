"""``--n-jobs J``: J worker processes on one storage (Optuna coordinates them); this process is one of them.

The others get this process's :class:`SearchSettings` (as JSON on their stdin, so a storage password never
shows in ``ps``), with the storage and study name fixed, ``worker=True`` (they only run trials; this process
exports) and no progress bar.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from ..credentials import ScrubFilter, scrub
from ..errors import UserError
from .export import DashboardWriter
from .run import SearchSettings, run_search


def worker_settings(s: SearchSettings) -> SearchSettings:
    """What every process runs: ``s`` with the storage and study name it would default to made explicit."""
    out = Path(s.out)
    storage = s.storage or f"sqlite:///{(out / 'study.db').resolve()}"
    return dataclasses.replace(s, storage=storage, study_name=s.study_name or out.name)


def run_workers(s: SearchSettings, n_jobs: int, dashboard: DashboardWriter | None = None) -> dict:
    """Run the search in this process and ``n_jobs - 1`` worker processes; returns this process's summary
    (this process exports, with the dashboard when given its writer)."""
    if n_jobs < 1:
        raise UserError(f"--n-jobs must be at least 1 (got {n_jobs})")
    s = worker_settings(s)  # each process creates the folder once its own checks pass
    payload = json.dumps(dataclasses.asdict(dataclasses.replace(s, worker=True, progress=False)))
    procs = []
    try:
        for _ in range(n_jobs - 1):
            p = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, text=True)
            procs.append(p)
            p.stdin.write(payload)
            p.stdin.close()
        return run_search(s, dashboard)  # this process counts toward the trials too, and exports at the end
    finally:
        for p in procs:
            p.wait()


def main() -> int:
    """A worker: settings as JSON on stdin; exit 2 with one line on bad input, 130 on Ctrl-C, like the CLI."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    raw = json.load(sys.stdin)
    storages = [raw.get("storage")] if isinstance(raw, dict) else []
    for handler in logging.getLogger().handlers:
        handler.addFilter(ScrubFilter(storages))
    try:
        s = SearchSettings(**raw)
        run_search(s)
    except UserError as e:
        print(f"viasd-tune worker: error: {scrub(str(e), storages)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("viasd-tune worker: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

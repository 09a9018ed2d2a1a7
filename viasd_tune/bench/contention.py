"""How busy the rest of the machine was during a timed run, and waiting until it is quiet.

On a small shared CPU machine torch's OpenMP threads slow down far more than in proportion when another process
takes a core (each parallel region waits for the descheduled thread). The meter measures the CPU time *other*
processes used during a run (the system's busy time from ``/proc/stat`` minus ours from ``/proc/self/stat``),
so a disturbed run can be counted, repeated, or avoided by waiting for quiet first. Where ``/proc`` is missing
(not Linux) it measures nothing and never waits.
"""

from __future__ import annotations

import os
import time

Snapshot = tuple[int, int, float]  # system busy ticks, our ticks, perf_counter seconds


class CpuMeter:
    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self) -> None:
        try:
            self._busy(), self._own()
            self.ok = True
        except (OSError, ValueError, IndexError):
            self.ok = False

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

    def snapshot(self) -> Snapshot:
        return (self._busy(), self._own(), time.perf_counter()) if self.ok else (0, 0, time.perf_counter())

    def foreign_cores(self, a: Snapshot, b: Snapshot) -> float:
        """Average number of cores other processes kept busy between two snapshots."""
        if not self.ok or b[2] <= a[2]:
            return 0.0
        return max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / self.TICK / (b[2] - a[2]))

    def wait_idle(
        self, max_wait_s: float, threshold: float = 0.05, window_s: float = 0.5, need: int = 2
    ) -> float:
        """Block until others use < ``threshold`` cores for ``need`` consecutive windows (at most ``max_wait_s``);
        return the seconds waited."""
        if not self.ok or max_wait_s <= 0:
            return 0.0
        start, quiet = time.perf_counter(), 0
        while quiet < need and time.perf_counter() - start < max_wait_s:
            a = self.snapshot()
            time.sleep(window_s)
            quiet = quiet + 1 if self.foreign_cores(a, self.snapshot()) < threshold else 0
        return time.perf_counter() - start


def load_average() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None

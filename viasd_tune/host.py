"""What the host computes matrices with: the one fact that decides whether a verify block costs about a step.

torch reports "AVX512" for AMX, AVX-512-bf16 and plain AVX-512 CPUs alike, yet a bf16 8-token verify block costs
0.99 of a step with AMX and 3.3 without native bf16 (shared/NOTES.md). Every figure we print carries this label.
"""

from __future__ import annotations

import functools
import platform
import re
from pathlib import Path

import torch

# Strongest first: the first flag set present names the host.
_ISA_FLAGS = (
    ("amx-bf16", ("amx_bf16",)),
    ("avx512-bf16", ("avx512_bf16",)),
    ("avx512", ("avx512f",)),
    ("avx2", ("avx2",)),
)


def _cpu_flags(cpuinfo: str) -> set[str]:
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_matrix_isa(cpuinfo: str | None = None) -> str:
    """``amx-bf16`` / ``avx512-bf16`` / ``avx512`` / ``avx2`` from the CPU flags, else the machine name."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    flags = _cpu_flags(cpuinfo)
    for name, needed in _ISA_FLAGS:
        if all(f in flags for f in needed):
            return name
    return platform.machine() or "unknown"


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True where bf16 matmuls run in hardware (AMX or AVX-512-bf16), so bf16 beats fp32."""
    return cpu_matrix_isa(cpuinfo) in ("amx-bf16", "avx512-bf16")


def cpu_name(cpuinfo: str | None = None) -> str:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    return m.group(1).strip() if m else (platform.processor() or "unknown")


@functools.cache
def matrix_isa(device: str = "cpu") -> str:
    """The label to record beside a figure measured on ``device``: the CPU's ISA, or ``cuda:<GPU name>``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return cpu_matrix_isa()


def memory_gb() -> tuple[float, float]:
    """(resident, peak resident) memory of this process in GB; zeros where the OS does not say."""
    try:
        import resource

        pages = int(Path("/proc/self/statm").read_text().split()[1])
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
        return pages * resource.getpagesize() / 1e9, peak_kb * 1024 / 1e9
    except (OSError, ImportError, ValueError, IndexError):
        return 0.0, 0.0


def release_memory() -> None:
    """Hand freed heap back to the OS between trials: each trial allocates tensors of new shapes (its γ, its
    skip set), and glibc keeps the freed chunks, so a long search's resident memory climbs though little is live."""
    import contextlib
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)

"""The host's matrix ISA label: the flags decide it, strongest first (torch's capability string cannot)."""

from viasd_tune.host import cpu_has_native_bf16, cpu_matrix_isa

FLAGS = "processor : 0\nmodel name : Test CPU\nflags : fpu sse2 avx2 {extra}\n"


def test_isa_from_flags_strongest_first():
    assert cpu_matrix_isa(FLAGS.format(extra="avx512f avx512_bf16 amx_bf16 amx_tile")) == "amx-bf16"
    assert cpu_matrix_isa(FLAGS.format(extra="avx512f avx512_bf16")) == "avx512-bf16"
    assert cpu_matrix_isa(FLAGS.format(extra="avx512f")) == "avx512"
    assert cpu_matrix_isa(FLAGS.format(extra="")) == "avx2"


def test_native_bf16_only_with_amx_or_avx512_bf16():
    assert cpu_has_native_bf16(FLAGS.format(extra="avx512f amx_bf16"))
    assert cpu_has_native_bf16(FLAGS.format(extra="avx512f avx512_bf16"))
    assert not cpu_has_native_bf16(FLAGS.format(extra="avx512f"))
    assert not cpu_has_native_bf16(FLAGS.format(extra=""))


def test_release_memory_returns_freed_heap_to_the_os():
    """A search trims the heap after each trial; on Linux (glibc) that gives back what a large freed buffer held."""
    import sys

    import pytest
    import torch

    from viasd_tune.host import memory_gb, release_memory

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    release_memory()
    before, peak = memory_gb()
    assert before > 0 and peak > 0
    # 1 GB in 64 kB pieces (below glibc's mmap threshold, so on the heap); the last one stays live, so a plain
    # free cannot shrink the heap from the top: only a trim returns the pages under the freed pieces.
    chunks = [torch.ones(16 * 1024) for _ in range(16 * 1024)]
    last = chunks[-1]
    held, _ = memory_gb()
    del chunks
    release_memory()
    assert last.sum() == 16 * 1024
    after, peak = memory_gb()
    assert held - before > 0.9 and after - before < 0.2
    assert peak > 0.9 * held  # the kernel updates the peak lazily

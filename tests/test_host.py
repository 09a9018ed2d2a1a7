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

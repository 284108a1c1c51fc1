"""The choice of a bfloat16 linear's kernel (tsterm_kernels.cpu_select's "bf16" classes) on fake CPUs: AMX granted,
AMX refused by the OS, AVX-512 with BF16 but no AMX, AVX2 only, aarch64; the invariance rule (torch's bfloat16
matmul, the fastest on some shapes, is reported, never chosen where a C arithmetic exists), and the override."""
from __future__ import annotations

from dataclasses import replace

import pytest
from tsterm_kernels import cpu_select
from tsterm_kernels.cpu_select import ENV, CpuInfo, ShapeClass

AVX2 = CpuInfo("x86_64", "AMD Ryzen 7 5800X", frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}))
ZEN4 = CpuInfo("x86_64", "AMD Ryzen 9 7950X", AVX2.flags | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
SPR_REFUSED = CpuInfo("x86_64", "Intel Xeon Platinum 8480+", ZEN4.flags | {"amx_tile", "amx_bf16", "amx_int8"},
                      amx_allowed=False)
SPR = replace(SPR_REFUSED, amx_allowed=True)
ARM = CpuInfo("aarch64", "Apple M2", frozenset({"fp", "asimd", "asimddp", "bf16", "i8mm"}))
QKV = ShapeClass("bf16", (1536, 576))


def _timer(seconds: dict[str, float]):
    return lambda shape, candidates: {name: seconds[name] for name in candidates}


def test_the_bf16_candidates_follow_the_cpu_the_os_and_the_build():
    assert cpu_select.bf16_available(SPR, 3) == ("c-amx", "c-bf16", "torch")
    # the OS refused the tile state: no AMX, whatever the build reports
    assert cpu_select.bf16_available(SPR_REFUSED, 3) == ("c-bf16", "torch")
    assert cpu_select.bf16_available(SPR_REFUSED, 1) == ("c-bf16", "torch")
    assert cpu_select.bf16_available(SPR, 1) == ("c-bf16", "torch")  # granted, but the build has no AMX code
    assert cpu_select.bf16_available(ZEN4, 1) == ("c-bf16", "torch")  # AVX512-BF16 without AMX
    assert cpu_select.bf16_available(AVX2, 0) == ("c-bf16", "torch")  # the plain C arithmetic
    assert cpu_select.bf16_available(SPR, None) == ("torch",)  # no C kernels (no compiler, turned off)
    assert cpu_select.bf16_available(ARM, None) == ("torch",)
    assert cpu_select.bf16_available(ARM, 0) == ("torch",)  # csrc/bf16.c is x86 code


def test_the_fastest_invariant_arithmetic_is_chosen_and_torch_only_reported():
    seconds = {"c-amx": 2.0, "c-bf16": 5.0, "torch": 1.0}
    choice = cpu_select.choose(QKV, cpu_select.bf16_available(SPR, 3), _timer(seconds))
    assert (choice.candidate, choice.how, dict(choice.seconds)) == ("c-amx", "measured", seconds)
    refused = cpu_select.choose(QKV, cpu_select.bf16_available(SPR_REFUSED, 3), _timer(seconds))
    assert refused.candidate == "c-bf16" and "c-amx" not in refused.seconds
    only = cpu_select.choose(QKV, ("torch",), _timer(seconds))
    assert (only.candidate, only.how) == ("torch", "only")


def test_the_override_forces_bf16_classes_by_kind_and_by_a_bf16_name():
    candidates = cpu_select.bf16_available(SPR, 3)
    never = _timer({})
    assert cpu_select.choose(QKV, candidates, never, cpu_select.parse_override("bf16=torch")).candidate == "torch"
    assert cpu_select.choose(QKV, candidates, never, cpu_select.parse_override("torch")).candidate == "torch"
    assert cpu_select.choose(QKV, candidates, never, cpu_select.parse_override("c-bf16")).candidate == "c-bf16"
    # a float32 kernel's name for every class leaves the bf16 ones to their measurement
    seconds = {"c-amx": 1.0, "c-bf16": 2.0, "torch": 3.0}
    assert cpu_select.choose(QKV, candidates, _timer(seconds), cpu_select.parse_override("c-avx2")).how == "measured"
    # and forces the float32 ones (c-amx is no float32 kernel)
    gemm = ShapeClass("gemm", (1536, 576))
    assert cpu_select.choose(gemm, ("c-avx512", "c-avx2", "torch"), never,
                             cpu_select.parse_override("c-avx2")).candidate == "c-avx2"
    with pytest.raises(ValueError, match=ENV):
        cpu_select.choose(QKV, cpu_select.bf16_available(SPR_REFUSED, 3), never, cpu_select.parse_override("bf16=c-amx"))
    for text in ("bf16=c-avx2", "gemm=c-amx", "attention=c-bf16"):
        with pytest.raises(ValueError, match=ENV):
            cpu_select.parse_override(text)


def test_a_stored_bf16_choice_is_kept_and_remeasured_when_amx_appears(tmp_path):
    """The plan file keeps a bf16 class's choice; a machine whose candidates changed (the OS now grants AMX)
    measures it again."""
    path = tmp_path / "choices.json"
    first = cpu_select.resolve([QKV], SPR_REFUSED, cpu_select.bf16_available(SPR_REFUSED, 3),
                               _timer({"c-bf16": 1.0, "torch": 0.5}), path)
    assert first[QKV.key].candidate == "c-bf16"
    again = cpu_select.resolve([QKV], SPR_REFUSED, cpu_select.bf16_available(SPR_REFUSED, 3), _timer({}), path)
    assert again[QKV.key] == first[QKV.key]
    granted = cpu_select.resolve([QKV], SPR, cpu_select.bf16_available(SPR, 3),
                                 _timer({"c-amx": 0.2, "c-bf16": 1.0, "torch": 0.5}), path)
    assert granted[QKV.key].candidate == "c-amx"


def test_a_bfloat16_pools_attention_is_amx_only_where_granted_and_chosen_by_time():
    """"bf16-attention": AMX's arithmetic where the CPU has AMX-BF16, the OS grants it and the build has the code;
    the widened float32 one everywhere (with the C kernels or without: then the float32 class runs torch's)."""
    assert cpu_select.bf16_attention_available(SPR, 3) == ("c-amx", "c-bf16")
    assert cpu_select.bf16_attention_available(SPR_REFUSED, 3) == ("c-bf16",)
    assert cpu_select.bf16_attention_available(SPR, 1) == ("c-bf16",)
    for cpu in (ZEN4, AVX2, ARM):
        assert cpu_select.bf16_attention_available(cpu, 1) == ("c-bf16",)
    assert cpu_select.bf16_attention_available(SPR, None) == ("c-bf16",)
    heads = ShapeClass("bf16-attention", (16, 4, 64))
    fast_amx = cpu_select.choose(heads, ("c-amx", "c-bf16"), _timer({"c-amx": 1.0, "c-bf16": 2.4}))
    slow_amx = cpu_select.choose(heads, ("c-amx", "c-bf16"), _timer({"c-amx": 3.0, "c-bf16": 2.4}))
    assert (fast_amx.candidate, slow_amx.candidate) == ("c-amx", "c-bf16")
    forced = cpu_select.choose(heads, ("c-amx", "c-bf16"), _timer({}), cpu_select.parse_override(
        "c-avx2,bf16-attention=c-bf16"))
    assert (forced.candidate, forced.how) == ("c-bf16", "forced")
    with pytest.raises(ValueError, match="bf16-attention"):
        cpu_select.parse_override("bf16-attention=torch")

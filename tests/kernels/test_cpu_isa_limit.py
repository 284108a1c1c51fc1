"""TSTERM_CPU_ISA=avx2: an AVX-512 / AMX CPU standing in for an AVX2-only one (cpu_native.isa_limit,
cpu_select.CpuInfo.restricted): on fake CPU descriptions the candidates are the ones an AVX2 CPU has, and on this
machine a process under the variable loads the C kernels' AVX2 build and describes its CPU without AVX-512."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from tsterm_kernels import cpu_native, cpu_select
from tsterm_kernels.cpu_select import CpuInfo

AVX2 = CpuInfo("x86_64", "AMD Ryzen 7 5800X", frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni"}))
SPR = CpuInfo("x86_64", "Intel Xeon Platinum 8480+", AVX2.flags | {
    "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
    "amx_int8"}, amx_allowed=True)
ARM = CpuInfo("aarch64", "Apple M2", frozenset({"fp", "asimd", "asimddp", "bf16", "i8mm"}))
WIDE = {"native": cpu_native.ISA_AVX512 | cpu_native.ISA_VNNI, "avx2": 0}  # an AVX-512 CPU's builds


def test_a_restricted_cpu_offers_what_an_avx2_cpu_offers():
    limited = SPR.restricted("avx2")
    assert limited.avx2 and not limited.avx512 and not limited.amx and limited.limit == "avx2"
    assert limited.flags == AVX2.flags - {"avx_vnni"}  # (the avx2 build is made with -mno-avxvnni)
    assert cpu_select.available(SPR, WIDE) == ("c-avx512", "c-avx2", "torch")
    assert cpu_select.available(limited, WIDE) == ("c-avx2", "torch")
    assert cpu_select.available(limited, {"native": 0}) == ("c-avx2", "torch")  # the avx2 build loaded as the native one
    assert cpu_select.bf16_available(SPR, 3) == ("c-amx", "c-bf16", "torch")
    assert cpu_select.bf16_available(limited, 3) == ("c-bf16", "torch")
    assert "limited by TSTERM_CPU_ISA=avx2" in limited.describe() and "AMX" not in limited.describe()
    assert limited.fingerprint() != replace(limited, limit="native").fingerprint()  # its own stored choices
    assert SPR.restricted("native") is SPR
    with pytest.raises(ValueError, match="TSTERM_CPU_ISA=avx2"):
        ARM.restricted("avx2")


def test_the_variable_is_checked(monkeypatch):
    monkeypatch.delenv(cpu_native.ISA_ENV, raising=False)
    assert cpu_native.isa_limit() == "native"
    monkeypatch.setenv(cpu_native.ISA_ENV, " AVX2 ")
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "x86_64")
    assert cpu_native.isa_limit() == "avx2"
    monkeypatch.setenv(cpu_native.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="TSTERM_CPU_ISA must be one of native, avx2, got 'avx512'"):
        cpu_native.isa_limit()
    monkeypatch.setenv(cpu_native.ISA_ENV, "avx2")
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "aarch64")
    with pytest.raises(ValueError, match="TSTERM_CPU_ISA=avx2 restricts x86-64 kernels"):
        cpu_native.isa_limit()


PROBE = """
import json
from tsterm_kernels import cpu_native, cpu_select
native = cpu_native.load()
cpu = cpu_select.CpuInfo.detect()
print(json.dumps({"bits": native.isa_bits, "variant": native.variant, "avx512": cpu.avx512, "amx": cpu.amx,
                  "candidates": cpu_select.available(cpu, {"native": native.isa_bits}), "cpu": cpu.describe()}))
"""


@pytest.mark.skipif(not CpuInfo.detect().avx2 or cpu_native.load() is None, reason="needs x86-64 AVX2 and the C kernels")
def test_a_process_under_the_variable_runs_the_avx2_build():
    env = {**os.environ, cpu_native.ISA_ENV: "avx2"}
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    assert out["bits"] & cpu_native.ISA_AVX512 == 0 and out["variant"] == "avx2"
    assert not out["avx512"] and not out["amx"] and out["candidates"] == ["c-avx2", "torch"]
    assert "limited by TSTERM_CPU_ISA=avx2" in out["cpu"]

"""What `dtype: auto` means on this CPU, without torch (the configuration layer and `tsterm plan` ask it too).

A float model runs in bfloat16 on the CPU where bfloat16 pays: the CPU has AMX-BF16 and the OS grants this process
the AMX tile state (Linux hands it out on request: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)). There the
bfloat16 linears run on AMX tiles (csrc/bf16.c), and on a Sapphire Rapids class CPU (BENCHMARKS.md, "bfloat16 on the
CPU") SmolLM2-135M's float import prefills 2.4x and decodes 1.7x faster than in float32, at +0.05% held-out perplexity
(int8 weights: +0.50%; the bound int8 is held to is 1%). Everywhere else auto stays float32:
- AVX512-BF16 without AMX (AMD Zen 4 / 5, Cooper Lake): csrc/bf16.c's vdpbf16ps code is the one bfloat16 kernel that
  keeps a row's bits whatever the batch, and it runs below the float32 GEMM's speed: measured with that code forced on
  an AMX CPU (a stand-in, BENCHMARKS.md), SmolLM2's 512-token prefill ran at 0.68-0.73x float32's while decode, which
  reads half the bytes, ran 2.0x; a profile may still name bfloat16 for decode-heavy work;
- AMX refused by the OS (an old kernel, a seccomp policy), or left out by TSTERM_CPU_ISA=avx2;
- AVX2-only x86 CPUs, and ARM (csrc/bf16.c is x86 code: bfloat16 would run as torch's matmul, which is not
  row-invariant);
- a model whose linears are int8 / int4 blocks (a GGUF import, `quantization: int8`): its matmuls are the integer
  kernels in either dtype, and bfloat16 would only round the activations and the KV cache, with the one-call decode
  stack float32-only today.
On a GPU auto is bfloat16.
"""
from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "TSTERM_CPU_ISA"  # tsterm_kernels.cpu_native's ISA limit: "avx2" leaves AVX-512 and AMX out
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86-64


def amx_permitted() -> bool:
    """Whether this process may use AMX tiles (asks the OS; harmless where granted, as oneDNN asks the same)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def amx_granted(flags: frozenset[str], isa_limit: str) -> bool:
    """Whether this process may run AMX code: the CPU reports AMX, TSTERM_CPU_ISA leaves it in, and the OS grants the
    tile state (asked only then). The dtype choice (CpuFeatures) and the kernel choice (cpu_select.CpuInfo) ask this."""
    return "amx_tile" in flags and isa_limit == "native" and amx_permitted()


def read_cpuinfo() -> tuple[str, frozenset[str]]:
    """/proc/cpuinfo's first model name and flags (x86 "flags", ARM "Features"); platform's name and no flags where it
    cannot be read."""
    model, flags = platform.processor() or platform.machine(), frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == (platform.processor() or platform.machine()):
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


@dataclass(frozen=True)
class CpuFeatures:
    """What the CPU reports (/proc/cpuinfo's model name and flags) and what the OS and TSTERM_CPU_ISA allow."""

    machine: str  # platform.machine(): "x86_64", "aarch64"
    model: str
    flags: frozenset[str]
    amx_granted: bool = False  # the OS granted the AMX tile state (asked only where the CPU reports AMX)
    isa_limit: str = "native"  # TSTERM_CPU_ISA's value

    @classmethod
    def detect(cls) -> CpuFeatures:
        model, flags = read_cpuinfo()
        limit = os.environ.get(ISA_ENV, "").strip().lower() or "native"
        return cls(platform.machine(), model, flags, amx_granted(flags, limit), limit)

    @property
    def x86(self) -> bool:
        return self.machine in ("x86_64", "AMD64")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype an engine runs in, and why (what `tsterm info` and the dashboard show)."""

    dtype: str  # "float32", "bfloat16", "float16"
    reason: str  # one line

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


def quantized_linears(quantization: str, quant_method: str | None) -> bool:
    """Whether a model's linears run integer / packed kernels whatever the dtype: `quantization` at load (an engine
    option: int8, int4, fp16) or a checkpoint that keeps its GGUF blocks or MXFP4 experts (config.json's
    quantization_config.quant_method; an FP8 checkpoint is dequantized to the dtype on the CPU)."""
    return quantization not in ("none", None) or quant_method in ("gguf_blocks", "mxfp4")


def cpu_auto_dtype(cpu: CpuFeatures, quantized: bool = False) -> DtypeChoice:
    """What `dtype: auto` means for a model on this CPU (`quantized`: its linears are int8 / int4 blocks)."""
    where = cpu.model
    if not cpu.x86:
        return DtypeChoice("float32", f"auto: {cpu.machine} CPU, tsterm's bfloat16 kernels are x86 code ({where})")
    if cpu.isa_limit != "native":
        return DtypeChoice("float32", f"auto: {ISA_ENV}={cpu.isa_limit} leaves AMX out ({where})")
    if "amx_bf16" not in cpu.flags:
        if "avx512_bf16" in cpu.flags:
            return DtypeChoice("float32", f"auto: AVX512-BF16 without AMX, bfloat16 prefill below float32's ({where})")
        return DtypeChoice("float32", f"auto: no AMX-BF16, bfloat16 would not pay ({where})")
    if not cpu.amx_granted:
        return DtypeChoice("float32", f"auto: AMX refused by the OS ({where})")
    if quantized:
        return DtypeChoice("float32", f"auto: int8 / int4 weights run the integer kernels in any dtype ({where})")
    return DtypeChoice("bfloat16", f"auto: AMX-BF16 granted by the OS, bfloat16 linears on AMX tiles ({where})")


def auto_dtype(device_type: str, quantized: bool = False, cpu: CpuFeatures | None = None) -> DtypeChoice:
    """`dtype: auto` on a device of this type ("cpu", "cuda"): bfloat16 on a GPU, `cpu_auto_dtype` on the CPU (`cpu`:
    this machine's, detected, when not given)."""
    if device_type != "cpu":
        return DtypeChoice("bfloat16", f"auto: bfloat16 on {device_type}")
    return cpu_auto_dtype(cpu if cpu is not None else CpuFeatures.detect(), quantized)

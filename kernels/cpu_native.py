"""tsterm's hand-written CPU kernels (`csrc/*.c`), compiled on this machine the first time they are needed.

Why C: the quantized matmuls of batch-1 decode must read 4-bit and 8-bit weights at memory speed, and neither torch's
CPU int4 / int8 kernels nor torch.compile did on these AVX2 cores (benchmarks/quant_gemv.py, BENCHMARKS.md); and the
small ops between them (a norm of one row, one query's attention) cost torch 50-150 us each where the work is a
few microseconds (csrc/decode.c); and prefill's float32 matmuls and causal attention, where torch's MKL GEMM and
flash kernel run at 50-70% of these cores' FMA peak on the shapes an MoE's prefill gives them (csrc/gemm.c,
csrc/prefill.c: 1.3-1.6x); and a prefill's routed experts, whose torch loop (a gather, two GEMMs, SwiGLU, a scale
and an index_add per expert, each op its own thread fork) cost 10% of a 216-token extend (csrc/moe.c). The
sources are plain C with AVX2 / FMA / F16C intrinsics (plus a 512-bit GEMM tile where the compiler targets AVX-512F,
and VNNI's int8 dot product where it targets AVX-VNNI or AVX-512 VNNI) and OpenMP; they are built with the system C
compiler (`$CC`, else `cc`) and `-march=native`, like llama.cpp builds on the machine that runs it, into
`$TSTERM_CACHE_DIR/kernels/<hash of sources, flags and CPU>/` (default ~/.cache/tsterm), once: later processes load
the built library. Building takes about a second. On a CPU with AVX-512 a second build without AVX-512 and VNNI
(VARIANTS["avx2"]) sits beside it: the same bits, and tsterm_kernels.cpu_select measures which is faster per shape. They are called through ctypes with tensor data pointers, which
costs about a microsecond per call.

On aarch64 the same sources build with `-mcpu=native` and csrc/neon/ on the include path: gemv.c's int8 / int4
dot products (sdot where the CPU has the dotprod extension) and gemm.c's GEMV and GEMM tile are NEON code there, and
neon/immintrin.h stands in for the x86 header in the rest (the same arithmetic lane for lane, so the same bits).

`load()` returns None, with one warning naming the cause, where the kernels cannot be built (no compiler, a CPU
without AVX2, a 32-bit ARM) or `TSTERM_NATIVE_KERNELS=0` turns them off; callers then take their torch path. The loaded
library is cached for the process, like an imported module: it holds no state.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCES_DIR = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
LIB_NAME = "libtsterm_cpu.so"

_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# exported function -> (restype, argtypes)
SIGNATURES = {
    "tsterm_q4_matmul": (_INT, [_P, _I64, _I64, _P, _P, _I64, _P]),
    "tsterm_q8_matmul": (_INT, [_P, _I64, _I64, _P, _P, _I64, _P]),
    "tsterm_q4_dequantize": (None, [_P, _P, _I64, _I64, _P]),
    "tsterm_q8_dequantize": (None, [_P, _P, _I64, _I64, _P]),
    "tsterm_mxfp4_matmul": (_INT, [_P, _I64, _I64, _P, _P, _I64, _P]),  # csrc/mxfp4.c
    "tsterm_mxfp4_dequantize": (None, [_P, _P, _I64, _I64, _P]),
    "tsterm_f32_matmul": (None, [_P, _I64, _I64, _P, _I64, _P]),
    "tsterm_f32_gemm": (None, [_P, _I64, _I64, _I64, _P, _I64, _P]),
    "tsterm_q_gemm": (None, [_P, _I64, _I64, _I64, _INT, _P, _P, _I64, _P]),
    "tsterm_moe_prefill": (_INT, [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _P, _I64, _P]),
    "tsterm_prefill_attention": (_INT, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I64]),
    "tsterm_decode_attention": (_INT, [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P]),
    # the same two with each head's sink logit (a pointer, or None) and a sliding window (0: none) last (gpt-oss)
    "tsterm_prefill_attention_sw": (_INT, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P, _I64,
                                           _P, _I64]),
    "tsterm_decode_attention_sw": (_INT, [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P,
                                          _P, _I64]),
    # the _sw two over bfloat16 caches, read in place (the bits of the float32 ones on the caches converted)
    "tsterm_prefill_attention_bf16": (_INT, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P,
                                             _I64, _P, _I64]),
    "tsterm_decode_attention_bf16": (_INT, [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P,
                                            _P, _I64]),
    # the bf16 two with attention.c's AMX arithmetic (bfloat16 products on AMX tiles; -2 from a build without AMX)
    "tsterm_prefill_attention_amx": (_INT, [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P,
                                            _I64, _P, _I64]),
    "tsterm_decode_attention_amx": (_INT, [_P, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _F32, _P,
                                           _P, _I64]),
    "tsterm_mla_attention": (_INT, [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P,
                                    _P, _I64, _I64, _F32, _P]),  # csrc/mla.c
    "tsterm_add_rms_norm": (None, [_P, _P, _P, _I64, _I64, _F32, _P]),
    "tsterm_rope": (None, [_P, _I64, _I64, _I64, _I64, _P, _P]),
    "tsterm_store_kv": (None, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _P]),
    "tsterm_head_rms_norm": (None, [_P, _I64, _I64, _I64, _I64, _P, _F32]),
    "tsterm_swiglu": (None, [_P, _I64, _I64, _P]),
    "tsterm_decode_stack": (_INT, [_P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P]),
    "tsterm_moe_route": (None, [_P, _I64, _I64, _I64, _I64, _P, _P]),
    "tsterm_moe_route_sigmoid": (None, [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _F32, _P, _P]),
    "tsterm_sigmoid": (None, [_P, _I64, _P]),
    "tsterm_isa": (_INT, []),
    "tsterm_bf16_isa": (_INT, []),
    "tsterm_bf16_gemm": (_INT, [_P, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64, _I64]),
}
# Builds of the same sources for one CPU: "native" (-march=native: AVX-512 and VNNI code where the CPU has them),
# and "avx2" (the same minus AVX-512 and VNNI: the code an AVX2-only CPU runs). Both give the same bits
# (tests/kernels run every variant this CPU can execute); the per-shape choice between them is measured
# (tsterm_kernels.cpu_select).
VARIANTS = {"native": (), "avx2": ("-mno-avx512f", "-mno-avxvnni")}
ISA_AVX512, ISA_VNNI = 1, 2  # csrc/gemm.c's tsterm_isa() bits
ISA_NEON, ISA_DOTPROD = 4, 8  # (aarch64: the NEON code, with sdot)
ARM_MACHINES = ("aarch64", "arm64")  # platform.machine() of a 64-bit ARM CPU (Linux, macOS)
NEON_HEADERS = SOURCES_DIR / "neon"  # aarch64's stand-in for <immintrin.h>
# TSTERM_CPU_ISA: "native" (the default: every extension the CPU has) or "avx2": the C kernels run their AVX2 build
# only and tsterm_kernels.cpu_select offers nothing wider (no AVX-512, VNNI, AVX512-BF16 or AMX candidate), so an
# AVX-512 CPU stands in for an AVX2-only one (x86-64 only; torch's own kernels follow their own variables:
# ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS)
ISA_ENV, ISA_LIMITS = "TSTERM_CPU_ISA", ("native", "avx2")


def isa_limit() -> str:
    """TSTERM_CPU_ISA's value ("native" when unset); ValueError naming the variable for anything else, or for "avx2"
    on a CPU that is not x86-64."""
    value = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if value not in ISA_LIMITS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LIMITS)}, got {value!r}")
    if value != "native" and platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"{ISA_ENV}={value} restricts x86-64 kernels (this machine is {platform.machine()})")
    return value


def arm_flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """FLAGS for aarch64: -mcpu=native (what GCC and clang detect the CPU's extensions by there) for -march=native,
    and the folder whose immintrin.h maps the x86 intrinsics the shared code uses onto NEON."""
    return tuple("-mcpu=native" if f == "-march=native" else f for f in flags) + ("-I", str(NEON_HEADERS))


def rows_contiguous_f32(x) -> bool:
    """A float32 CPU [T, H, D] tensor whose rows (one token's H * D values) are contiguous, at any row stride: what
    the per-token C kernels (RoPE, the KV store) take."""
    return (x.is_cpu and x.dtype is torch.float32 and x.dim() == 3 and x.stride(2) == 1
            and x.stride(1) == x.shape[2])


def f32_gemm(native: "NativeKernels", x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, I] @ weight.T -> a new [M, O] by csrc/gemm.c: float32 CPU tensors, x's rows contiguous (any row
    stride), weight contiguous."""
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    native.f32_gemm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0],
                    y.data_ptr())
    return y


def gemm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether f32_gemm takes these: float32 CPU, x 2-D with contiguous rows, weight contiguous."""
    return (x.dim() == 2 and x.is_cpu and x.dtype is torch.float32 and x.stride(1) == 1 and weight.is_cpu
            and weight.dtype is torch.float32 and weight.is_contiguous())


class NativeKernelError(RuntimeError):
    pass


def cache_dir() -> Path:
    """Where built libraries go: $TSTERM_CACHE_DIR/kernels, else $XDG_CACHE_HOME/tsterm/kernels, else
    ~/.cache/tsterm/kernels (the same root as tsterm's imported models)."""
    if os.environ.get("TSTERM_CACHE_DIR"):
        root = Path(os.environ["TSTERM_CACHE_DIR"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tsterm"
    else:
        root = Path.home() / ".cache" / "tsterm"
    return root / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, ARM
                return line
    except OSError:
        pass
    return platform.processor()


def build(out_dir: Path | None = None, variant: str = "native") -> Path:
    """Compile every source into one shared library (or find it built); returns its path. `variant`: a key of
    VARIANTS. Raises NativeKernelError with the compiler's message when it cannot be built."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown CPU kernel variant {variant!r} (have: {', '.join(VARIANTS)})")
    flags = FLAGS + VARIANTS[variant]
    arm = platform.machine() in ARM_MACHINES
    if arm and variant != "native":
        raise NativeKernelError(f"the {variant} build of the CPU kernels is x86 code (this machine is aarch64)")
    if arm:
        flags = arm_flags(flags)
    elif platform.machine() not in ("x86_64", "AMD64"):
        raise NativeKernelError(f"the CPU kernels need x86-64 with AVX2 or aarch64 (this machine is "
                                f"{platform.machine()})")
    elif "avx2" not in _cpu_flags() or "f16c" not in _cpu_flags():
        raise NativeKernelError("the CPU kernels need AVX2, FMA and F16C, which this CPU does not report")
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise NativeKernelError(f"no C compiler ({compiler!r} not found; install gcc or set $CC)")
    sources = sorted(SOURCES_DIR.glob("*.c"))
    digest = hashlib.sha256()
    headers = sorted(NEON_HEADERS.glob("*.h")) if arm else []
    for item in (compiler, *flags, _cpu_flags(),
                 *(s.name + s.read_text() for s in sorted(SOURCES_DIR.glob("*.[ch]")) + headers)):
        digest.update(item.encode())
    target_dir = (out_dir or cache_dir()) / digest.hexdigest()[:16]
    target = target_dir / LIB_NAME
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target_dir)  # built aside, renamed: concurrent builds are safe
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, "-o", tmp, *map(str, sources)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeKernelError(f"{compiler} failed to build the CPU kernels:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class NativeKernels:
    """The built library's functions, typed (see SIGNATURES)."""

    def __init__(self, path: Path, variant: str = "native"):
        self.path, self.variant = path, variant
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
            setattr(self, name.removeprefix("tsterm_"), fn)
        self.isa_bits = self.isa()

    @property
    def isa_name(self) -> str:
        """The widest vector code this build runs: "avx512" or "avx2" (+ "-vnni" where the int8 dots use VNNI), or
        on aarch64 "neon" (+ "-dotprod" where they use sdot)."""
        if self.isa_bits & ISA_NEON:
            return "neon" + ("-dotprod" if self.isa_bits & ISA_DOTPROD else "")
        return ("avx512" if self.isa_bits & ISA_AVX512 else "avx2") + ("-vnni" if self.isa_bits & ISA_VNNI else "")


@functools.cache
def load() -> NativeKernels | None:
    """The CPU kernels, built on first use; None (with one warning) where they cannot be built or are turned off.
    The build is VARIANTS' "native", or the one TSTERM_CPU_ISA names (`isa_limit`)."""
    if os.environ.get("TSTERM_NATIVE_KERNELS", "1") == "0":
        return None
    variant = isa_limit()
    try:
        return NativeKernels(build(variant=variant), variant)
    except (NativeKernelError, OSError) as e:
        warnings.warn(f"tsterm's CPU kernels are unavailable, quantized matmuls take a slow torch path: {e}",
                      RuntimeWarning, stacklevel=2)
        return None


def load_variant(variant: str) -> NativeKernels | None:
    """One build of VARIANTS: "native" is `load()`'s; "avx2" is `load()`'s too on a CPU without AVX-512 (its native
    build is AVX2 code), else the build without AVX-512, made once. None where the C kernels are off or unavailable."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown CPU kernel variant {variant!r} (have: {', '.join(VARIANTS)})")
    native = load()
    if native is None or variant == "native" or not native.isa_bits & ISA_AVX512:
        return native
    return _load_build(variant)


@functools.cache
def _load_build(variant: str) -> NativeKernels | None:
    try:
        return NativeKernels(build(variant=variant), variant)
    except (NativeKernelError, OSError) as e:
        warnings.warn(f"tsterm's {variant} build of the CPU kernels is unavailable: {e}", RuntimeWarning, stacklevel=3)
        return None

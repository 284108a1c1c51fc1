"""The C kernels' aarch64 build (csrc/ with -I csrc/neon: NEON int8 / int4 dot products and float32 GEMV / GEMM tile,
x86 intrinsics mapped lane for lane elsewhere), checked on this x86 machine: tests/kernels/native/neon_harness.c is
linked with every csrc/*.c by the aarch64 cross compiler, twice (with the dotprod extension's sdot, and without it:
the widening-multiply fallback), and run under qemu-aarch64 on small odd shapes. Each result is checked against the
float64 oracles (tests/kernels/oracles.py), for the batch invariance (a row's bits alone and among others, in the
row kernels and the GEMM), and against the x86 build of the same sources bit for bit (the NEON code keeps x86's
summation order, so an ARM machine answers as an x86 one).

qemu runs the code for correctness only: its timings say nothing about an ARM CPU's speed.

The harness tests need `apt-get install -y gcc-aarch64-linux-gnu qemu-user` (Debian / Ubuntu) and are skipped, saying
so, without them; the build flags cpu_native uses on aarch64 are checked everywhere (platform.machine faked)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tsterm_kernels import cpu_native
from tsterm_kernels.quant import quantize_int4, quantize_int8, quantize_mxfp4

from tests.kernels import oracles

CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
HARNESS = Path(__file__).parent / "native" / "neon_harness.c"
# target -> the -march it is built for: ARMv8.2 with sdot (every ARM core of the last years), and plain ARMv8.0
TARGETS = {"dotprod": "armv8.2-a+dotprod", "plain": "armv8-a"}
ISA_NEON, ISA_DOTPROD = cpu_native.ISA_NEON, cpu_native.ISA_DOTPROD


def test_an_aarch64_machine_builds_the_library_with_its_own_flags(monkeypatch, tmp_path):
    """cpu_native on aarch64 (platform.machine faked, a fake compiler that records its arguments): -mcpu=native for
    -march=native and csrc/neon/ on the include path; the x86-only avx2 variant is refused."""
    args = tmp_path / "args"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {args}\n'
                  'while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(cpu_native.platform, "machine", lambda: "aarch64")
    assert cpu_native.build(tmp_path / "out").is_file()
    flags = args.read_text().splitlines()
    assert "-mcpu=native" in flags and "-march=native" not in flags
    assert flags[flags.index("-I") + 1] == str(cpu_native.NEON_HEADERS)
    assert (cpu_native.NEON_HEADERS / "immintrin.h").is_file()
    with pytest.raises(cpu_native.NativeKernelError, match="avx2 build of the CPU kernels is x86 code"):
        cpu_native.build(tmp_path / "out", variant="avx2")
    isa_name = cpu_native.NativeKernels.isa_name.fget
    assert isa_name(SimpleNamespace(isa_bits=ISA_NEON | ISA_DOTPROD)) == "neon-dotprod"
    assert isa_name(SimpleNamespace(isa_bits=ISA_NEON)) == "neon"


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> dict[str, Path]:
    """The harness built for each of TARGETS (in parallel), with the library's own flags minus the host's -march."""
    if shutil.which(CC) is None or shutil.which(QEMU) is None:
        pytest.skip(f"the aarch64 checks need {CC} and {QEMU}: apt-get install -y gcc-aarch64-linux-gnu qemu-user")
    out = tmp_path_factory.mktemp("neon")
    flags = [f for f in cpu_native.FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    sources = [str(s) for s in sorted(cpu_native.SOURCES_DIR.glob("*.c"))]
    procs = {}
    for name, march in TARGETS.items():
        cmd = [CC, *flags, f"-march={march}", "-static", "-I", str(cpu_native.SOURCES_DIR / "neon"), "-o",
               str(out / name), str(HARNESS), *sources, "-lm"]
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        _, err = proc.communicate()
        assert proc.returncode == 0, f"the aarch64 build ({TARGETS[name]}) failed:\n{err[-3000:]}"
    return {name: out / name for name in TARGETS}


def run(binary: Path, *args, data: bytes = b"", floats: int = 0) -> np.ndarray | str:
    """The harness's output under qemu (3 OpenMP threads: the outputs split over threads): `floats` float32
    values, or its text when floats is 0."""
    proc = subprocess.run([QEMU, str(binary), *map(str, args)], input=data, capture_output=True,
                          env={**os.environ, "OMP_NUM_THREADS": "3"})
    assert proc.returncode == 0, proc.stderr.decode()
    if not floats:
        return proc.stdout.decode()
    assert len(proc.stdout) == 4 * floats, f"{len(proc.stdout)} bytes out, expected {4 * floats}"
    return np.frombuffer(proc.stdout, dtype=np.float32)


def raw(*tensors: torch.Tensor) -> bytes:
    return b"".join(t.contiguous().numpy().tobytes() for t in tensors)


def t(a: np.ndarray, *shape) -> torch.Tensor:
    return torch.from_numpy(a.copy()).reshape(shape)


def bits_equal(a, b) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("target", TARGETS)
def test_each_build_reports_its_dot_product(harness, target):
    isa = int(run(harness[target], "isa"))
    assert isa & ISA_NEON and bool(isa & ISA_DOTPROD) == (target == "dotprod"), isa


def _inputs(rows: int, in_f: int, out_f: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_f, generator=gen) * 3
    x[-1, :32] = 0.0  # a block of zeros: dx = 0
    return x, torch.randn(out_f, in_f, generator=gen) * 0.05


QUANT_SHAPES = [(1, 32, 1), (5, 96, 17), (7, 320, 37), (3, 544, 16), (6, 256, 33)]  # rows, in (blocks: 1-17), out


def run_quant(binary: Path, kind: str, x: torch.Tensor, q) -> dict[str, torch.Tensor]:
    rows, (out_f, in_f) = x.shape[0], q.dims
    n = rows * out_f
    got = run(binary, "q4" if kind == "int4" else "q8", rows, in_f, out_f,
              data=raw(x, q.data, q.scale.view(torch.int16)), floats=5 * n + out_f * in_f)
    parts = np.split(got, np.cumsum([n, n, n, n, out_f * in_f]))
    names = ("rows", "rows_each", "gemm", "gemm_each", "weight", "f32_gemm")
    return {name: t(p, out_f, in_f) if name == "weight" else t(p, rows, out_f) for name, p in zip(names, parts)}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("rows,in_f,out_f", QUANT_SHAPES)
def test_quantized_matmuls_against_the_oracle_and_every_batch(harness, target, kind, rows, in_f, out_f):
    x, w = _inputs(rows, in_f, out_f, seed=rows * 1000 + in_f + out_f)
    q = (quantize_int4 if kind == "int4" else quantize_int8)(w)
    got = run_quant(harness[target], kind, x, q)
    # the row kernels (decode's int8 / int4 GEMV): the reference arithmetic, the same bits alone and among others
    ref = oracles.int8_rows_matmul(x, q).float()
    torch.testing.assert_close(got["rows"], ref, rtol=1e-5, atol=2e-6 * ref.abs().max())
    assert bits_equal(got["rows"], got["rows_each"]), "a row's result depends on the rows beside it"
    # and the float matmul of the dequantized weight up to x's int8 rounding (half a step of max|x| / 127 per block)
    dq = oracles.dequantize(q)
    step = x.double().reshape(rows, -1, 32).abs().amax(-1) / 127 / 2  # [rows, blocks]
    bound = torch.einsum("rb,obk->ro", step, dq.abs().reshape(out_f, -1, 32)) * 1.01 + 1e-5
    assert ((got["rows"].double() - oracles.linear(x, dq)).abs() <= bound).all()
    # the dequantized weight (float32: code * d, + m), and the GEMM that dequantizes panels as it packs them: the
    # float32 GEMM's bits on that weight, for any number of rows
    codes = oracles.dequantize(replace(q, scale=torch.ones_like(q.scale) if kind == "int8" else
                                       torch.tensor([1.0, 0.0]).half().expand_as(q.scale))).float()
    scale = q.scale.float().repeat_interleave(32, -2 if kind == "int4" else -1)  # per input: d (int4: d, m)
    want_w = codes * scale if kind == "int8" else codes * scale[..., 0] + scale[..., 1]  # float32, as C rounds
    assert torch.equal(got["weight"], want_w)
    assert bits_equal(got["gemm"], got["f32_gemm"]) and bits_equal(got["gemm"], got["gemm_each"])
    torch.testing.assert_close(got["gemm"], oracles.linear(x, dq).float(), rtol=1e-5, atol=1e-5)


F32_SHAPES = [(1, 1, 1), (2, 7, 15), (4, 37, 16), (7, 300, 33), (3, 517, 20), (6, 64, 48)]  # rows, in, out


def run_f32(binary: Path, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, out_f = x.shape[0], w.shape[0]
    got = run(binary, "f32", rows, x.shape[1], out_f, data=raw(x, w), floats=4 * rows * out_f)
    return {name: t(p, rows, out_f) for name, p in zip(("rows", "rows_each", "gemm", "gemm_each"), np.split(got, 4))}


@pytest.mark.parametrize("target", ["dotprod"])  # no integer dot product in these: one build is enough
@pytest.mark.parametrize("rows,in_f,out_f", F32_SHAPES)
def test_float32_gemv_and_gemm_against_the_oracle_and_every_batch(harness, target, rows, in_f, out_f):
    x, w = _inputs(rows, in_f, out_f, seed=rows * 100 + in_f + out_f) if in_f >= 32 else (
        torch.randn(rows, in_f, generator=torch.Generator().manual_seed(in_f)),
        torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(out_f)))
    got = run_f32(harness[target], x, w)
    # float32 sums of in_f products: within in_f units of the last place of sum |x w| (the classic bound)
    want, scale = oracles.linear(x, w), oracles.linear(x.abs(), w.abs())
    for name, y in got.items():
        assert ((y.double() - want).abs() <= in_f * 2.0 ** -24 * scale * 1.01 + 1e-30).all(), name
    # the few-rows kernel (decode) follows the GEMM's order: one row's bits whatever runs it and beside what
    for name in ("rows_each", "gemm", "gemm_each"):
        assert bits_equal(got["rows"], got[name]), name


def run_ops(binary: Path, g, u, x, residual, weight) -> dict[str, torch.Tensor]:
    rows, n = g.shape
    got = run(binary, "ops", rows, n, data=raw(g, u, x, residual, weight), floats=3 * rows * n)
    return {name: t(p, rows, n) for name, p in zip(("swiglu", "norm", "residual"), np.split(got, 3))}


def _ops_inputs():
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(3, 41, generator=gen) * 4 for _ in range(4)] + [torch.rand(41, generator=gen) + 0.5]


@pytest.mark.parametrize("target", ["plain"])
def test_swiglu_and_rms_norm_through_the_x86_intrinsics_map(harness, target):
    g, u, x, residual, weight = _ops_inputs()
    got = run_ops(harness[target], g, u, x, residual, weight)
    torch.testing.assert_close(got["swiglu"], (F.silu(g.double()) * u.double()).float(), rtol=2e-6, atol=1e-6)
    normed, new_residual = oracles.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(got["residual"], new_residual)
    torch.testing.assert_close(got["norm"], normed.float(), rtol=2e-6, atol=1e-6)


ATTN = dict(seqs=3, hq=4, hkv=2, d=32, bs=16, length=150)  # 150 keys: two splits, a partial block; GQA 2


def _attn_inputs():
    gen = torch.Generator().manual_seed(11)
    n, hq, hkv, d = ATTN["length"], ATTN["hq"], ATTN["hkv"], ATTN["d"]
    return (torch.randn(n, hq, d, generator=gen), torch.randn(n, hkv, d, generator=gen),
            torch.randn(n, hkv, d, generator=gen))


def run_attn(binary: Path, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    s, hq, d, n = ATTN["seqs"], ATTN["hq"], ATTN["d"], ATTN["length"]
    got = run(binary, "attn", s, hq, ATTN["hkv"], d, ATTN["bs"], n, data=raw(q, k, v), floats=(n + s) * hq * d)
    return t(got[:n * hq * d], n, hq, d), t(got[n * hq * d:], s, hq, d)


@pytest.mark.parametrize("target", ["plain"])
def test_prefill_and_decode_attention_through_the_x86_intrinsics_map(harness, target):
    q, k, v = _attn_inputs()
    prefill, decode = run_attn(harness[target], q, k, v)
    scale = ATTN["d"] ** -0.5
    torch.testing.assert_close(prefill, oracles.attention(q, k, v, scale).float(), rtol=1e-5, atol=1e-5)
    n = ATTN["length"]
    for s in range(ATTN["seqs"]):  # sequence s: n - s keys, its query the prefill's row n - 1 - s: the same bits
        assert bits_equal(decode[s], prefill[n - 1 - s]), s


# ---- the aarch64 build against the x86 build of the same sources (this machine's), bit for bit ----

@pytest.fixture(scope="module")
def x86():
    native = cpu_native.load()
    if native is None:
        pytest.skip("the x86 build of the C kernels is unavailable here (TSTERM_NATIVE_KERNELS=0, no AVX2)")
    return native


def _p(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_matmuls_give_the_x86_bits(harness, x86, target, kind):
    rows, in_f, out_f = QUANT_SHAPES[2]
    x, w = _inputs(rows, in_f, out_f, seed=5)
    q = (quantize_int4 if kind == "int4" else quantize_int8)(w)
    got = run_quant(harness[target], kind, x, q)
    y, wf = torch.empty(rows, out_f), torch.empty(out_f, in_f)
    matmul = x86.q4_matmul if kind == "int4" else x86.q8_matmul
    assert matmul(_p(x), rows, in_f, _p(q.data), _p(q.scale), out_f, _p(y)) == 0
    assert bits_equal(got["rows"], y)
    x86.q_gemm(_p(x), in_f, rows, in_f, 2 if kind == "int4" else 1, _p(q.data), _p(q.scale), out_f, _p(y))
    assert bits_equal(got["gemm"], y)
    (x86.q4_dequantize if kind == "int4" else x86.q8_dequantize)(_p(q.data), _p(q.scale), out_f, in_f, _p(wf))
    assert bits_equal(got["weight"], wf)


@pytest.mark.parametrize("rows,in_f,out_f", [F32_SHAPES[3], F32_SHAPES[4]])
def test_float32_matmuls_give_the_x86_bits(harness, x86, rows, in_f, out_f):
    x, w = _inputs(rows, in_f, out_f, seed=9)
    got = run_f32(harness["dotprod"], x, w)
    y = torch.empty(rows, out_f)
    x86.f32_matmul(_p(x), rows, in_f, _p(w), out_f, _p(y))
    assert bits_equal(got["rows"], y)
    x86.f32_gemm(_p(x), in_f, rows, in_f, _p(w), out_f, _p(y))
    assert bits_equal(got["gemm"], y)


@pytest.mark.parametrize("rows", [1, 5])  # few rows decode in registers, more decode panels (csrc/mxfp4.c)
def test_mxfp4_through_the_x86_intrinsics_map_gives_the_x86_bits(harness, x86, rows):
    in_f, out_f = 96, 37
    x, w = _inputs(rows, in_f, out_f, seed=13)
    q = quantize_mxfp4(w)
    got = run(harness["plain"], "mx4", rows, in_f, out_f, data=raw(x, q.data, q.scale),
              floats=2 * rows * out_f + out_f * in_f)
    y_all, y_each, weight = (t(p, *shape) for p, shape in zip(
        np.split(got, [rows * out_f, 2 * rows * out_f]), ((rows, out_f), (rows, out_f), (out_f, in_f))))
    assert bits_equal(y_all, y_each)
    y, wf = torch.empty(rows, out_f), torch.empty(out_f, in_f)
    assert x86.mxfp4_matmul(_p(x), rows, in_f, _p(q.data), _p(q.scale), out_f, _p(y)) == 0
    x86.mxfp4_dequantize(_p(q.data), _p(q.scale), out_f, in_f, _p(wf))
    assert bits_equal(y_all, y) and bits_equal(weight, wf)
    torch.testing.assert_close(y_all, oracles.linear(x, wf).float(), rtol=1e-5, atol=1e-5)


def test_swiglu_rms_norm_and_attention_give_the_x86_bits(harness, x86):
    g, u, x, residual, weight = _ops_inputs()
    got = run_ops(harness["plain"], g, u, x, residual, weight)
    rows, n = g.shape
    out, res = torch.empty(rows, n), residual.clone()
    h = torch.cat((g, u), 1)  # (kept alive across the call)
    x86.swiglu(_p(h), rows, n, _p(out))
    assert bits_equal(got["swiglu"], out)
    x86.add_rms_norm(_p(x), _p(res), _p(weight), rows, n, ctypes.c_float(1e-6), _p(out))
    assert bits_equal(got["norm"], out) and bits_equal(got["residual"], res)

    q, k, v = _attn_inputs()
    prefill, _ = run_attn(harness["plain"], q, k, v)
    n, hq, hkv, d, bs = ATTN["length"], ATTN["hq"], ATTN["hkv"], ATTN["d"], ATTN["bs"]
    blocks = -(-n // bs)
    table = torch.arange(blocks - 1, -1, -1, dtype=torch.int32)  # the harness's: pool blocks in reverse order
    kc, vc = torch.zeros(blocks * bs, hkv, d), torch.zeros(blocks * bs, hkv, d)
    slots = table.long()[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    kc[slots], vc[slots] = k, v
    out = torch.empty(n, hq, d)
    assert x86.prefill_attention(_p(q), hq * d, _p(kc), _p(vc), _p(table), n, n, hq, hkv, d, bs,
                                 ctypes.c_float(np.float32(1.0) / np.sqrt(np.float32(d))), _p(out), hq * d) == 0
    assert bits_equal(prefill, out)

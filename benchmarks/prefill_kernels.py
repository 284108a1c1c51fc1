"""Prefill on the CPU: tsterm's C matmul and causal attention (csrc/gemm.c, csrc/prefill.c), every build of them this
CPU runs, against torch's.

    python benchmarks/prefill_kernels.py [--rounds 3] [--threads N]

The shapes are the bench model's (hidden 1024, 16 experts of 512, top-4; 16 query and 4 KV heads of 64) in the
agent trace's prefill: a 216-token extend (each expert sees about 54 rows) and a 1536-token first turn. Candidates
run interleaved, round by round; the best round of each counts. Reported: GFLOP/s of each candidate, the best
C build's speedup over torch float32 in the same run, and for the matmuls the best bf16 C kernel's over torch
bfloat16 and over the best float32 candidate.
- matmul `x @ W.T`: torch float32 (`torch.mm`, MKL / oneDNN), `tsterm_f32_gemm` of each build ("C-AVX2": the
  sources built without AVX-512; "C-AVX-512": -march=native on a CPU with AVX-512F, csrc/gemm.c's 512-bit tile),
  and the bfloat16 candidates of a model run with dtype bfloat16 (another precision: x and W in bf16, float32 sums):
  torch bfloat16 (oneDNN; AMX tiles where the CPU has them and the OS allows them; its blocking follows the row
  count), and csrc/bf16.c's `tsterm_bf16_gemm` ("C-bf16": AVX512-BF16 where built, else plain C; "C-AMX": AMX
  tiles where granted; both keep a row's bits whatever the rows beside it, float32 out). Each round cycles through
  16 distinct weights, as the experts of a layer are, so the weights come from memory, not from the cache.
- causal attention of the new tokens over a paged pool (in-order blocks of 16): torch's flash kernel, in the pieces
  `tsterm_kernels.torch_ops` ran it (an unmasked prefix and a causal part, merged by log-sum-exp), against
  `tsterm_prefill_attention` of each build (the builds' outputs checked bit for bit equal); and over a bfloat16
  pool, torch's flash kernel in bfloat16 against the bfloat16 model's two C arithmetics (the "bf16-attention"
  class's candidates): "C-bf16", the pool widened to float32 as it is read (`tsterm_prefill_attention_bf16`), and
  "C-AMX", q and P rounded to bfloat16 and both products on AMX tiles (`tsterm_prefill_attention_amx`).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tsterm_kernels import cpu_native, cpu_select, torch_ops

HIDDEN, INTER, EXPERTS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 1024, 512, 16, 16, 4, 64, 16
MATMULS = [  # (label, rows, in_features, out_features)
    ("expert gate_up, 216-token extend", 54, HIDDEN, 2 * INTER),
    ("expert down, 216-token extend", 54, INTER, HIDDEN),
    ("q/k/v, 216-token extend", 216, HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),
    ("expert gate_up, 1536-token prefill", 384, HIDDEN, 2 * INTER),
]
ATTENTION = [("216-token extend over 2816", 216, 2816), ("1536-token prefill", 1536, 1536)]


def _best(fns: dict, rounds: int, calls: int) -> dict:
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t) / calls)
    return best


def _row(label: str, flops: float, best: dict) -> None:
    cells = " ".join(f"{flops / best[name] / 1e9:>11.0f}" if name in best else f"{'-':>11}" for name in COLUMNS)
    c_best = min(t for name, t in best.items() if name in ("C-AVX2", "C-AVX-512"))
    ratios = f"{best['torch fp32'] / c_best:>9.2f}x"
    bf16 = [t for name, t in best.items() if name in BF16_C]
    if bf16:  # the bf16 kernel against torch's bf16 matmul, and against the fastest float32 candidate
        ratios += f" {best['torch bf16'] / min(bf16):>9.2f}x {min(best['torch fp32'], c_best) / min(bf16):>9.2f}x"
    print(f"{label:<36} {cells} {ratios}")


COLUMNS = ("torch fp32", "C-AVX2", "C-AVX-512", "torch bf16", "C-bf16", "C-AMX")
BF16_C = ("C-bf16", "C-AMX")  # csrc/bf16.c's columns


def _builds() -> dict:
    """Each C build this CPU runs, by column name."""
    native = cpu_native.load()
    if native is None:
        raise SystemExit("the C kernels are unavailable here (see the warning above)")
    if not native.isa_bits & cpu_native.ISA_AVX512:
        return {"C-AVX2": native}
    avx2 = cpu_native.load_variant("avx2")
    return {"C-AVX-512": native, **({"C-AVX2": avx2} if avx2 is not None else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    builds = _builds()
    cpu = cpu_select.CpuInfo.detect()
    gen = torch.Generator().manual_seed(0)
    print(f"{cpu.describe()}; torch {torch.__version__}")
    print(f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}; GFLOP/s "
          f"(torch bf16: {'AMX' if cpu.amx else 'no AMX'})")
    native = builds.get("C-AVX-512", builds.get("C-AVX2"))
    bits = native.bf16_isa()
    bf16_isa = {"C-bf16": 1 if bits & 1 else 0, **({"C-AMX": 2} if bits & 2 and cpu.amx else {})}
    print(f"{'':<36} {' '.join(f'{name:>11}' for name in COLUMNS)} {'C/torch':>10} {'bf16 C/t':>10} "
          f"{'bf16/fp32':>10}")
    for label, rows, in_f, out_f in MATMULS:
        x = torch.randn(rows, in_f, generator=gen)
        weights = [torch.randn(out_f, in_f, generator=gen) for _ in range(EXPERTS)]
        x16, weights16 = x.bfloat16(), [w.bfloat16() for w in weights]
        y, y16 = torch.empty(rows, out_f), torch.empty(rows, out_f, dtype=torch.bfloat16)

        def run_torch():
            for w in weights:
                torch.mm(x, w.t(), out=y)

        def run_bf16():
            for w in weights16:
                torch.mm(x16, w.t(), out=y16)

        def run_c(native):
            def run():
                for w in weights:
                    native.f32_gemm(x.data_ptr(), in_f, rows, in_f, w.data_ptr(), out_f, y.data_ptr())
            return run

        def run_c_bf16(native, isa):
            def run():
                for w in weights16:
                    native.bf16_gemm(x16.data_ptr(), 1, in_f, rows, in_f, w.data_ptr(), out_f, y.data_ptr(), out_f,
                                     isa)
            return run
        fns = {"torch fp32": run_torch, **{name: run_c(b) for name, b in builds.items()}, "torch bf16": run_bf16,
               **{name: run_c_bf16(native, isa) for name, isa in bf16_isa.items()}}
        _row(label, 2.0 * rows * in_f * out_f * EXPERTS, _best(fns, args.rounds, 2))
    scale = HEAD_DIM ** -0.5
    for label, num_q, seq_len in ATTENTION:
        blocks = -(-seq_len // BLOCK)
        k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
        v_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
        table = torch.arange(blocks, dtype=torch.int32)
        q = torch.randn(num_q, HEADS, HEAD_DIM, generator=gen)
        outs = {name: torch.empty_like(q) for name in ("torch fp32", *builds)}

        def attend_torch():
            torch_ops._extend_attention(q, k_cache, v_cache, [(0, blocks)], seq_len, scale, outs["torch fp32"])

        def attend_c(name, native):
            out = outs[name]
            return lambda: native.prefill_attention(
                q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), seq_len, num_q,
                HEADS, KV_HEADS, HEAD_DIM, BLOCK, scale, out.data_ptr(), out.stride(0))
        q16, k16, v16 = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()  # a bfloat16 model's pools
        out16, out_c16 = torch.empty_like(q16), torch.empty_like(q)

        def attend_torch_bf16():
            torch_ops._extend_attention(q16, k16, v16, [(0, blocks)], seq_len, scale, out16)

        def attend_c_bf16(entry):
            return lambda: entry(q.data_ptr(), q.stride(0), k16.data_ptr(), v16.data_ptr(), table.data_ptr(), seq_len,
                                 num_q, HEADS, KV_HEADS, HEAD_DIM, BLOCK, scale, out_c16.data_ptr(), out_c16.stride(0),
                                 None, 0)
        bf16_attend = {"torch bf16": attend_torch_bf16, "C-bf16": attend_c_bf16(native.prefill_attention_bf16),
                       **({"C-AMX": attend_c_bf16(native.prefill_attention_amx)} if "C-AMX" in bf16_isa else {})}
        best = _best({"torch fp32": attend_torch, **{name: attend_c(name, b) for name, b in builds.items()},
                      **bf16_attend}, args.rounds, 3)
        for name in builds:
            torch.testing.assert_close(outs[name], outs["torch fp32"], rtol=1e-4, atol=1e-4)
        if len(builds) > 1:  # the AVX-512 build's own tiles, the AVX2 build's bits (csrc/attention.c)
            assert torch.equal(outs["C-AVX-512"], outs["C-AVX2"]), "the C builds' attention bits differ"
        visible = num_q * (seq_len - num_q) + num_q * (num_q + 1) / 2  # (query, key) pairs the causal mask keeps
        _row(label, 4.0 * HEADS * HEAD_DIM * visible, best)


if __name__ == "__main__":
    main()

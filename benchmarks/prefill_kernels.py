"""Prefill on the CPU: tsterm's C matmul and causal attention (csrc/gemm.c, csrc/prefill.c) against torch's.

    python benchmarks/prefill_kernels.py [--rounds 3] [--threads N]

The shapes are the bench model's (hidden 1024, 16 experts of 512, top-4; 16 query and 4 KV heads of 64) in the
agent trace's prefill: a 216-token extend (each expert sees about 54 rows) and a 1536-token first turn. Candidates
run interleaved, round by round; the best round of each counts. Reported: milliseconds per call, GFLOP/s, and the
C kernel's speedup over torch in the same run.
- matmul `x @ W.T`: torch (`torch.mm`, MKL) against `tsterm_f32_gemm`. Each round cycles through 16 distinct
  weights, as the experts of a layer are, so the weights come from memory, not from the cache.
- causal attention of the new tokens over a paged pool (in-order blocks of 16): torch's flash kernel, in the pieces
  `tsterm_kernels.torch_ops` ran it (an unmasked prefix and a causal part, merged by log-sum-exp), against
  `tsterm_prefill_attention`.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tsterm_kernels import cpu_native, torch_ops

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
    torch_s, c_s = best["torch"], best["C"]
    print(f"{label:<36} {torch_s * 1e3:>9.2f} {flops / torch_s / 1e9:>7.0f} {c_s * 1e3:>9.2f} "
          f"{flops / c_s / 1e9:>7.0f} {torch_s / c_s:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native = cpu_native.load()
    if native is None:
        raise SystemExit("the C kernels are unavailable here (see the warning above)")
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}")
    print(f"{'':<36} {'torch ms':>9} {'GFLOP/s':>7} {'C ms':>9} {'GFLOP/s':>7} {'C/torch':>8}")
    for label, rows, in_f, out_f in MATMULS:
        x = torch.randn(rows, in_f, generator=gen)
        weights = [torch.randn(out_f, in_f, generator=gen) for _ in range(EXPERTS)]
        y = torch.empty(rows, out_f)

        def run_torch():
            for w in weights:
                torch.mm(x, w.t(), out=y)

        def run_c():
            for w in weights:
                native.f32_gemm(x.data_ptr(), in_f, rows, in_f, w.data_ptr(), out_f, y.data_ptr())
        _row(label, 2.0 * rows * in_f * out_f * EXPERTS, _best({"torch": run_torch, "C": run_c}, args.rounds, 2))
    scale = HEAD_DIM ** -0.5
    for label, num_q, seq_len in ATTENTION:
        blocks = -(-seq_len // BLOCK)
        k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
        v_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
        table = torch.arange(blocks, dtype=torch.int32)
        q = torch.randn(num_q, HEADS, HEAD_DIM, generator=gen)
        out_torch, out_c = torch.empty_like(q), torch.empty_like(q)

        def attend_torch():
            torch_ops._extend_attention(q, k_cache, v_cache, [(0, blocks)], seq_len, scale, out_torch)

        def attend_c():
            native.prefill_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                     table.data_ptr(), seq_len, num_q, HEADS, KV_HEADS, HEAD_DIM, BLOCK, scale,
                                     out_c.data_ptr(), out_c.stride(0))
        best = _best({"torch": attend_torch, "C": attend_c}, args.rounds, 3)
        torch.testing.assert_close(out_c, out_torch, rtol=1e-4, atol=1e-4)
        visible = num_q * (seq_len - num_q) + num_q * (num_q + 1) / 2  # (query, key) pairs the causal mask keeps
        _row(label, 4.0 * HEADS * HEAD_DIM * visible, best)


if __name__ == "__main__":
    main()

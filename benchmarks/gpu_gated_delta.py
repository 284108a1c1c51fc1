"""Gated DeltaNet kernels on one CUDA device at the hybrids' linear-attention sizes (16 key heads of 128; 32 value
heads for Qwen3-Next-80B-A3B, 64 for Qwen3.5-397B-A17B), bf16 activations, float32 states in a slot pool:

  prefill (one launch for every prompt of the step): the conv, and the chunked rule, whose time is also given per
      64-token chunk (a sequence's chunks run one after another), next to the torch twin on the same device and
      the largest difference from it;
  decode: the conv update and one step of the rule for S sequences, GB/s counting the state read + written.

Ends with a summary table. Needs CUDA and compiled kernels (TRITON_INTERPRET unset); scripts/gpu_check.sh runs it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from gpu_kernels import Row, bench, table

KEY_HEADS, HEAD_DIM, KERNEL, CHUNK = 16, 128, 4, 64
MODELS = {"qwen3-next": 32, "qwen3.5-397b": 64}  # value heads
BF16 = torch.bfloat16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", nargs="+", default=["1x4096", "8x512", "1x64"], metavar="NxL",
                        help="prefill batches: N prompts of L tokens (default: 1x4096 8x512 1x64)")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8], metavar="S")
    parser.add_argument("--rep-ms", type=int, default=50, help="timed milliseconds per measurement (default 50)")
    parser.add_argument("--summary-file", help="also write the summary table to this file")
    return parser.parse_args(argv)


def inputs(rows: int, value_heads: int, num_seqs: int, gen: torch.Generator):
    channels = 2 * KEY_HEADS * HEAD_DIM + value_heads * HEAD_DIM
    qkv = torch.randn(rows, channels, device="cuda", generator=gen).to(BF16)
    key_size = KEY_HEADS * HEAD_DIM
    q = qkv[:, :key_size].view(rows, KEY_HEADS, HEAD_DIM)
    k = qkv[:, key_size:2 * key_size].view(rows, KEY_HEADS, HEAD_DIM)
    v = qkv[:, 2 * key_size:].view(rows, value_heads, HEAD_DIM)
    g = -torch.rand(rows, value_heads, device="cuda", generator=gen) * 0.5
    beta = torch.rand(rows, value_heads, device="cuda", generator=gen)
    pool = torch.randn(2 * num_seqs, value_heads, HEAD_DIM, HEAD_DIM, device="cuda", generator=gen) * 0.1
    slots = torch.randperm(2 * num_seqs, device="cuda", generator=gen)[:num_seqs]
    return qkv, q, k, v, g, beta, pool, slots


def prefill_rows(model: str, value_heads: int, num_seqs: int, length: int, rep_ms: int) -> list[Row]:
    from tsterm_kernels import torch_ops, triton_ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = num_seqs * length
    qkv, q, k, v, g, beta, pool, slots = inputs(rows, value_heads, num_seqs, gen)
    starts = torch.arange(num_seqs, device="cuda") * length
    bounds = torch.stack((starts, starts + length), dim=1).to(torch.int32)
    out = torch.empty(rows, value_heads, HEAD_DIM, device="cuda")
    want_pool, want = pool.clone(), torch.empty_like(out)
    torch_ops.chunk_gated_delta_rule(q, k, v, g, beta, want_pool, slots, bounds, want)
    got_pool = pool.clone()
    triton_ops.chunk_gated_delta_rule(q, k, v, g, beta, got_pool, slots, bounds, out)
    error = max((out - want).abs().max().item(), (got_pool - want_pool).abs().max().item())
    micros = bench(lambda: triton_ops.chunk_gated_delta_rule(q, k, v, g, beta, pool, slots, bounds, out), rep_ms)
    twin = bench(lambda: torch_ops.chunk_gated_delta_rule(q, k, v, g, beta, pool, slots, bounds, want), rep_ms)
    chunks = -(-length // CHUNK)
    shape = f"{model} {num_seqs}x{length}"
    result = [Row("chunk_gated_delta_rule", shape, micros, None,
                  f"{micros / chunks:.1f} us per chunk of {CHUNK}; twin {twin:.0f} us ({twin / micros:.1f}x); "
                  f"max |diff| {error:.1e}")]
    weight = torch.randn(qkv.shape[1], KERNEL, device="cuda", generator=gen).to(BF16)
    conv_pool = torch.randn(2 * num_seqs, qkv.shape[1], KERNEL - 1, device="cuda", generator=gen).to(BF16)
    conv_out = torch.empty_like(qkv)
    micros = bench(lambda: triton_ops.causal_conv1d(qkv, weight, conv_pool, slots, bounds, conv_out), rep_ms)
    twin = bench(lambda: torch_ops.causal_conv1d(qkv, weight, conv_pool, slots, bounds, conv_out), rep_ms)
    result.append(Row("causal_conv1d", shape, micros, 2 * qkv.numel() * qkv.element_size() / micros / 1e3,
                      f"twin {twin:.0f} us ({twin / micros:.1f}x)"))
    return result


def decode_rows(model: str, value_heads: int, num_seqs: int, rep_ms: int) -> list[Row]:
    from tsterm_kernels import torch_ops, triton_ops

    gen = torch.Generator(device="cuda").manual_seed(1)
    qkv, q, k, v, g, beta, pool, slots = inputs(num_seqs, value_heads, num_seqs, gen)
    micros = bench(lambda: triton_ops.recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots), rep_ms)
    twin = bench(lambda: torch_ops.recurrent_gated_delta_rule(q, k, v, g, beta, pool, slots), rep_ms)
    state_bytes = 2 * num_seqs * value_heads * HEAD_DIM * HEAD_DIM * 4
    result = [Row("recurrent_gated_delta_rule", f"{model} S={num_seqs}", micros, state_bytes / micros / 1e3,
                  f"state read + written in place; twin {twin:.0f} us ({twin / micros:.1f}x)")]
    weight = torch.randn(qkv.shape[1], KERNEL, device="cuda", generator=gen).to(BF16)
    conv_pool = torch.randn(2 * num_seqs, qkv.shape[1], KERNEL - 1, device="cuda", generator=gen).to(BF16)
    micros = bench(lambda: triton_ops.causal_conv1d_update(qkv, weight, conv_pool, slots), rep_ms)
    result.append(Row("causal_conv1d_update", f"{model} S={num_seqs}", micros))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_gated_delta.py: no CUDA device (torch.cuda.is_available() is False); run it on the GPU "
                 "machine, e.g. `bash scripts/gpu_check.sh`.")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("gpu_gated_delta.py: TRITON_INTERPRET is set, which would time the interpreter; unset it.")
    rows: list[Row] = []
    for model, value_heads in MODELS.items():
        for spec in args.prompts:
            num_seqs, length = (int(n) for n in spec.split("x"))
            rows += prefill_rows(model, value_heads, num_seqs, length, args.rep_ms)
            print(f"  {rows[-2].kernel} {rows[-2].shape}: {rows[-2].micros:.1f} us ({rows[-2].note})", flush=True)
        for num_seqs in args.decode_batch:
            rows += decode_rows(model, value_heads, num_seqs, args.rep_ms)
    summary = table(rows, f"== Gated DeltaNet kernels on {torch.cuda.get_device_name()} (bf16, float32 states) ==")
    print("\n" + summary)
    if args.summary_file:
        with open(args.summary_file, "w") as f:
            f.write(summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

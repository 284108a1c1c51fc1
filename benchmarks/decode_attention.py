"""Decode attention on the CPU: one query row per sequence over its paged float32 KV, against a plain read of the KV.

    python benchmarks/decode_attention.py [--heads smollm2|bench] [--contexts 256,4096,16384,32768] [--layers 8]
                                          [--rounds 5] [--shuffle] [--threads N]

Each context gets --layers distinct KV pools (as a model's layers have), visited in turn, so that a call reads its
KV from memory as decode does, not from the cache the previous call left warm. The block table is in order, or
shuffled (--shuffle: a pool fragmented by many sessions). Candidates run interleaved, round by round; the best
round of each counts. Reported: microseconds per call and GB/s of KV bytes (K and V of every position) for
- C kernel: `tsterm_kernels.torch_ops.paged_attention`, i.e. csrc/decode.c's `tsterm_decode_attention`
- read: `torch.sum` of the same K and V pools (the bandwidth a reader of these bytes gets here; an upper bound)
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tsterm_kernels.metadata import AttentionMetadata, contiguous_runs
from tsterm_kernels.torch_ops import paged_attention

HEADS = {"smollm2": (9, 3, 64), "bench": (16, 4, 64)}  # (query heads, KV heads, head_dim)
BLOCK = 16


def _case(context: int, heads: tuple[int, int, int], layers: int, shuffle: bool, gen: torch.Generator):
    hq, hkv, d = heads
    blocks = -(-context // BLOCK)
    table = torch.randperm(blocks, generator=gen) if shuffle else torch.arange(blocks)
    meta = AttentionMetadata(query_start_loc=[0, 1], seq_lens=[context],
                             block_runs=[contiguous_runs(table.tolist(), blocks)],
                             slot_mapping=torch.tensor([-1]), block_tables=table.to(torch.int32)[None],
                             block_size=BLOCK)
    pools = [(torch.randn(blocks, BLOCK, hkv, d, generator=gen), torch.randn(blocks, BLOCK, hkv, d, generator=gen))
             for _ in range(layers)]
    q = torch.randn(1, hq, d, generator=gen)
    return meta, pools, q, 2 * context * hkv * d * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="smollm2", choices=list(HEADS))
    parser.add_argument("--contexts", default="256,4096,16384,32768")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = HEADS[args.heads]
    gen = torch.Generator().manual_seed(0)
    print(f"{args.heads} heads {heads}, block {BLOCK}, {'shuffled' if args.shuffle else 'in-order'} block table, "
          f"{args.layers} pools per context, {torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}")
    print(f"{'context':>8} {'KV MB':>7} {'C kernel us':>12} {'GB/s':>6} {'read us':>9} {'GB/s':>6} {'of read':>8}")
    for context in (int(c) for c in args.contexts.split(",")):
        meta, pools, q, nbytes = _case(context, heads, args.layers, args.shuffle, gen)
        scale = heads[2] ** -0.5

        def attend():
            for k, v in pools:
                paged_attention(q, k, v, meta, scale)

        def read():
            for k, v in pools:
                k.sum()
                v.sum()

        best = {"attend": float("inf"), "read": float("inf")}
        repeats = max(1, 2_000_000 // context)
        for _ in range(args.rounds):
            for name, fn in (("attend", attend), ("read", read)):
                fn()
                start = time.perf_counter()
                for _ in range(repeats):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - start) / (repeats * args.layers))
        a, r = best["attend"], best["read"]
        print(f"{context:>8} {nbytes / 1e6:>7.1f} {a * 1e6:>12.0f} {nbytes / a / 1e9:>6.1f} {r * 1e6:>9.0f} "
              f"{nbytes / r / 1e9:>6.1f} {r / a:>8.2f}")


if __name__ == "__main__":
    main()

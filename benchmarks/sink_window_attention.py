"""gpt-oss's attention on the CPU: the C kernels with sinks and a sliding window against full causal attention and
against the torch twin that ran these layers before (float32, gpt-oss-20b's heads: 64 query heads over 8 KV heads
of 64).

    python benchmarks/sink_window_attention.py [--window 128] [--decode-contexts 8192,32768] [--prefill 2048]
                                               [--rounds 20]

Per case, the candidates run interleaved round by round on the same inputs (one sequence, its blocks in order); the
best round of each counts, in milliseconds per call:
- full causal: `torch_ops.paged_attention` without sinks or window (a full-attention layer of another model)
- C sinks + window: `torch_ops.paged_attention(sinks=, window=)`, i.e. csrc's `_sw` kernels (a sliding layer)
- C sinks: the same with no window (gpt-oss's full-attention layers)
- twin sinks + window, twin sinks: `torch_ops._sink_window_attention`, the path these layers took before
"""
from __future__ import annotations

import argparse
import time

import torch

from tsterm_kernels import torch_ops
from tsterm_kernels.metadata import AttentionMetadata, BlockRuns

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 8, 64, 16


def _case(context: int, new: int, gen: torch.Generator):
    blocks = -(-context // BLOCK)
    table = list(range(blocks))
    k_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(new, HEADS, HEAD_DIM, generator=gen)
    meta = AttentionMetadata([0, new], [context], BlockRuns([table]), torch.zeros(new, dtype=torch.long),
                             torch.tensor([table], dtype=torch.int32), BLOCK)
    return q, k_cache, v_cache, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--decode-contexts", default="8192,32768")
    parser.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill case (0: none)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    sinks = torch.randn(HEADS, generator=gen)
    scale = HEAD_DIM ** -0.5
    cases = [(f"decode, 1 row at {n}", n, 1) for n in map(int, args.decode_contexts.split(",")) if n]
    if args.prefill:
        cases.append((f"prefill of {args.prefill}", args.prefill, args.prefill))
    print(f"{'case':<24}" + "".join(f"{name:>22}" for name in
                                    ("full causal", "C sinks + window", "C sinks", "twin sinks + window",
                                     "twin sinks")))
    for label, context, new in cases:
        q, k, v, meta = _case(context, new, gen)
        window = args.window
        runs = {"full": lambda: torch_ops.paged_attention(q, k, v, meta, scale),
                "c window": lambda: torch_ops.paged_attention(q, k, v, meta, scale, sinks=sinks, window=window),
                "c sinks": lambda: torch_ops.paged_attention(q, k, v, meta, scale, sinks=sinks),
                "twin window": lambda: torch_ops._sink_window_attention(q, k, v, meta, scale, sinks, window),
                "twin sinks": lambda: torch_ops._sink_window_attention(q, k, v, meta, scale, sinks, None)}
        best = dict.fromkeys(runs, float("inf"))
        for run in runs.values():
            run()  # warm
        rounds = args.rounds if new == 1 else max(2, args.rounds // 6)
        for _ in range(rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"{label:<24}" + "".join(f"{best[name] * 1e3:>19.3f} ms" for name in runs))


if __name__ == "__main__":
    main()

"""Microbenchmarks of tsterm's Triton kernels on one CUDA device, as achieved GB/s next to the device's own copy
bandwidth (a torch copy of a large tensor, bytes read + written).

  fused MoE, Qwen3-30B-A3B layer shapes (H=2048, I=768, E=128, top-8), M tokens: GB/s counts the weights of
      the experts the batch actually touches (what decode is bound by), routing/alignment included in the time;
      the same with the experts stored as fp8 / int8 / int4 (GB/s of their stored bytes);
  paged decode attention, Hq=32, Hkv=4, D=128, block 16, shuffled block tables: GB/s counts the K/V read.

Ends with a summary table. Needs CUDA and compiled kernels (TRITON_INTERPRET unset); scripts/gpu_check.sh runs it.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass

import torch

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 4, 128, 16
BF16 = torch.bfloat16
DEVICE = "cuda"  # a CPU smoke test swaps this (and the sizes) to run the code paths under the interpreter


@dataclass
class Row:
    kernel: str
    shape: str
    micros: float
    gbytes_per_s: float | None = None
    note: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moe-tokens", type=int, nargs="+", default=[1, 8, 64], metavar="M",
                        help="fused-MoE batch sizes in tokens (default: 1 8 64)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768], metavar="N",
                        help="decode attention context lengths (default: 4096 32768)")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8], metavar="S",
                        help="sequences per decode attention batch (default: 1 8)")
    parser.add_argument("--rep-ms", type=int, default=100, help="timed milliseconds per measurement (default 100)")
    parser.add_argument("--no-twin", action="store_true", help="skip timing the torch twin of fused MoE")
    parser.add_argument("--summary-file", help="also write the summary table to this file")
    return parser.parse_args(argv)


def check_device() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_kernels.py: no CUDA device (torch.cuda.is_available() is False). These are GPU "
                 "microbenchmarks: run them on the GPU machine, e.g. `bash scripts/gpu_check.sh`.")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("gpu_kernels.py: TRITON_INTERPRET is set, which would time the interpreter; unset it.")


def bench(fn, rep_ms: int) -> float:
    """Median microseconds of fn(), with the L2 cache flushed between runs (triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def copy_bandwidth(rep_ms: int) -> Row:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    micros = bench(lambda: dst.copy_(src), rep_ms)
    return Row("torch copy (reference)", "1 GiB", micros, 2 * src.numel() / micros / 1e3, "read + write")


def moe_rows(tokens_list: list[int], rep_ms: int, with_twin: bool, copy_gbps: float) -> list[Row]:
    from tsterm_kernels import torch_ops
    from tsterm_kernels.triton_fused_moe import tile_config
    from tsterm_kernels.triton_moe_align import moe_align
    from tsterm_kernels.triton_ops import fused_moe, moe_route

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEVICE, generator=gen) * HIDDEN ** -0.5).to(BF16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device=DEVICE, generator=gen) * INTER ** -0.5).to(BF16)
    expert_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * w13.element_size()
    rows = []
    for num_tokens in tokens_list:
        x = torch.randn(num_tokens, HIDDEN, device=DEVICE, generator=gen).to(BF16)
        logits = torch.randn(num_tokens, EXPERTS, device=DEVICE, generator=gen).to(BF16)
        out = torch.zeros_like(x)
        _weights, expert_ids = moe_route(logits, TOP_K, True)
        active = expert_ids.unique().numel()
        touched = active * expert_bytes
        tiles = tile_config(x.device, num_tokens)

        def step(x=x, logits=logits, out=out):  # bound now: timed within this iteration
            w, ids = moe_route(logits, TOP_K, True)
            fused_moe(x, w13, w2, w, ids, out)

        micros = bench(step, rep_ms)
        gbps = touched / micros / 1e3
        note = f"{active} experts, tiles M{tiles['BLOCK_M']} N{tiles['BLOCK_N']} K{tiles['BLOCK_K']}"
        if with_twin:
            twin_out = torch.zeros_like(x)
            def twin_step(x=x, logits=logits, twin_out=twin_out):
                torch_ops.fused_moe(x, w13, w2, *torch_ops.moe_route(logits, TOP_K, True), twin_out)

            twin = bench(twin_step, rep_ms)
            note += f", torch twin {twin:.0f} us ({twin / micros:.1f}x)"
        rows.append(Row("moe_route + fused_moe", f"M={num_tokens}", micros, gbps,
                        note + f", {100 * gbps / copy_gbps:.0f}% of copy"))
        align = bench(functools.partial(moe_align, expert_ids, EXPERTS, tiles["BLOCK_M"]), rep_ms)
        rows.append(Row("  of which moe_align", f"M={num_tokens}", align))
    return rows


def quant_moe_rows(tokens_list: list[int], rep_ms: int, copy_gbps: float) -> list[Row]:
    """The same experts stored as fp8 (128 x 128 block scales), int8 and int4 (blocks of 32): GB/s over the stored
    bytes of the touched experts, and the time against the bf16 stacks."""
    from tsterm_kernels.quant import quantize_fp8, quantize_int4, quantize_int8
    from tsterm_kernels.triton_ops import fused_moe, moe_route

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=DEVICE, generator=gen) * HIDDEN ** -0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=DEVICE, generator=gen) * INTER ** -0.5
    stacks = {"bf16": (w13.to(BF16), w2.to(BF16))}
    for kind, quantize in (("fp8", quantize_fp8), ("int8", quantize_int8), ("int4", quantize_int4)):
        stacks[kind] = (quantize(w13), quantize(w2))
    rows = []
    for num_tokens in tokens_list:
        x = torch.randn(num_tokens, HIDDEN, device=DEVICE, generator=gen).to(BF16)
        logits = torch.randn(num_tokens, EXPERTS, device=DEVICE, generator=gen).to(BF16)
        active = moe_route(logits, TOP_K, True)[1].unique().numel()
        times = {}
        for kind, (a, b) in stacks.items():
            out = torch.zeros_like(x)

            def step(x=x, logits=logits, out=out, a=a, b=b):
                fused_moe(x, a, b, *moe_route(logits, TOP_K, True), out)

            times[kind] = bench(step, rep_ms)
            if kind != "bf16":
                touched = active * (a.nbytes + b.nbytes) / EXPERTS
                gbps = touched / times[kind] / 1e3
                rows.append(Row(f"fused_moe, {kind} experts", f"M={num_tokens}", times[kind], gbps,
                                f"{times['bf16'] / times[kind]:.2f}x the bf16 stacks' speed, "
                                f"{100 * gbps / copy_gbps:.0f}% of copy"))
    return rows


def attention_rows(contexts: list[int], batches: list[int], rep_ms: int, copy_gbps: float) -> list[Row]:
    from tsterm_kernels.metadata import AttentionMetadata
    from tsterm_kernels.triton_ops import paged_attention
    from tsterm_kernels.triton_paged_attention import device_metadata

    rows = []
    for context in contexts:
        for num_seqs in batches:
            blocks_per_seq = -(-context // BLOCK)
            num_blocks = num_seqs * blocks_per_seq
            k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=DEVICE).to(BF16)
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(num_blocks, device=DEVICE).view(num_seqs, blocks_per_seq).to(torch.int32)
            meta = AttentionMetadata(list(range(num_seqs + 1)), [context] * num_seqs, [],
                                     torch.zeros(num_seqs, dtype=torch.int64, device=DEVICE), tables, BLOCK)
            device_metadata(meta, k_cache.device)  # built once per step by the first layer
            q = torch.randn(num_seqs, HEADS, HEAD_DIM, device=DEVICE).to(BF16)
            micros = bench(functools.partial(paged_attention, q, k_cache, v_cache, meta, HEAD_DIM ** -0.5), rep_ms)
            kv_bytes = 2 * num_seqs * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
            gbps = kv_bytes / micros / 1e3
            rows.append(Row("paged decode attention", f"ctx={context} S={num_seqs}", micros, gbps,
                            f"{kv_bytes / 2**20:.0f} MiB K/V, {100 * gbps / copy_gbps:.0f}% of copy"))
            del k_cache, v_cache
    return rows


def table(rows: list[Row], title: str) -> str:
    lines = [title, f"{'kernel':<26} {'shape':<16} {'time (us)':>10} {'GB/s':>8}  note", "-" * 100]
    for row in rows:
        gbps = f"{row.gbytes_per_s:8.0f}" if row.gbytes_per_s is not None else f"{'':>8}"
        lines.append(f"{row.kernel:<26} {row.shape:<16} {row.micros:10.1f} {gbps}  {row.note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_device()
    import triton

    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    copy = copy_bandwidth(args.rep_ms)
    print(f"device copy bandwidth: {copy.gbytes_per_s:.0f} GB/s", flush=True)
    rows = [copy]
    rows += moe_rows(args.moe_tokens, args.rep_ms, not args.no_twin, copy.gbytes_per_s)
    rows += quant_moe_rows(args.moe_tokens, args.rep_ms, copy.gbytes_per_s)
    print("\n".join(f"  {r.kernel} {r.shape}: {r.micros:.1f} us" for r in rows[1:]), flush=True)
    rows += attention_rows(args.contexts, args.decode_batch, args.rep_ms, copy.gbytes_per_s)
    summary = table(rows, f"== kernel microbenchmarks on {name} (bf16) ==")
    print("\n" + summary)
    if args.summary_file:
        with open(args.summary_file, "w") as f:
            f.write(summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

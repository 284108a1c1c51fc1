"""Compile every Triton kernel for Hopper (sm_90) without a GPU, through the real launchers at real sizes.

Run as a script in a process WITHOUT TRITON_INTERPRET (test_triton_compile.py does). The launchers are called on
`meta` tensors (shapes, strides and dtypes only); each kernel launch is intercepted, specialised exactly as the
JIT would specialise it (16-divisible ints and pointers), compiled to a cubin with the ptxas bundled in the
triton wheel, checked by `ptxas -v` for register spills, and its shared memory (the compiled kernel's
`metadata.shared`) checked against what one block may use on sm_90 (227 KB of the SM's 228 KB). Device-dependent
choices (the fused MoE's tile table row, the SM count) are made for each Hopper the engine meets: an H200 (its own
row of kernels/moe_tiles.json) and an H100 (the `default` row: its name is not in the table), every M bucket of the
row. Prints one line per compiled variant; exits 1 on any failure, spill or shared-memory overflow, naming the
kernel, its constants and the tile config (device, table row, bucket) that asked for it.

`--moe-tiles PATH`: compile only the fused MoE, from the tile table at PATH (a candidate for kernels/moe_tiles.json,
checked before a GPU ever runs it).

This relies on triton internals (`create_function_from_signature`, `JITFunction._pack_args`) of the pinned
triton; it answers "does it compile, does it spill", never "is it right" (the GPU tests do that).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET: the kernels must be JIT functions"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from tsterm_kernels import triton_fused_moe, triton_paged_attention  # noqa: E402
from tsterm_kernels.metadata import AttentionMetadata  # noqa: E402
from tsterm_kernels.triton_gated_delta import (  # noqa: E402
    causal_conv1d, causal_conv1d_update, recurrent_gated_delta_rule)
from tsterm_kernels.quant import QuantizedWeight  # noqa: E402
from tsterm_kernels.triton_ops import fused_moe, moe_route, paged_attention, rms_norm, store_kv  # noqa: E402
from tsterm_kernels.triton_quant_linear import quant_linear  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # bytes one block may use on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin; 228 KB per SM)
# the Hoppers whose tile choices are compiled: (device name as torch reports it, SM count)
DEVICES = {"H200": ("NVIDIA H200", 132), "H100": ("NVIDIA H100 80GB HBM3", 132)}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
META = torch.device("meta")
BF16 = torch.bfloat16

seen: set[str] = set()
failures: list[str] = []
context = {"device": "", "tiles": ""}  # what the launches being compiled were asked for (for the messages)


def _compile_launch(kernel: JITFunction, args, kwargs) -> None:
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    consts = {kernel.arg_names[path[0]]: value for path, value in constexprs.items()
              if signature[kernel.arg_names[path[0]]] == "constexpr"}
    label = f"{kernel.__name__} {consts} warps={options.num_warps} stages={options.num_stages}"
    key = f"{label} {signature} {attrs}"
    if key in seen:
        return
    seen.add(key)
    label += f" [{context['device']}{', ' + context['tiles'] if context['tiles'] else ''}]"
    start = time.time()
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                                  options=options.__dict__)
    except Exception as error:  # noqa: BLE001 - report every kernel, then fail
        failures.append(f"{label}: {type(error).__name__}: {str(error)[:400]}")
        print(f"FAIL {label}\n     {error}", flush=True)
        return
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    info = subprocess.run([PTXAS, "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", info.stderr)
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", info.stderr))
    shared = compiled.metadata.shared
    line = (f"{label}  regs={regs.group(1) if regs else '?'} spill_bytes={spills} "
            f"shared={shared} ({time.time() - start:.1f}s)")
    over = shared > SHARED_LIMIT
    print(("SPILL " if spills else "SHARED" if over else "ok   ") + " " + line, flush=True)
    if spills:
        failures.append(line)
    if over:
        failures.append(f"{label}: shared memory {shared} bytes ({shared / 1024:.1f} KB) exceeds the {SHARED_LIMIT} "
                        f"bytes ({SHARED_LIMIT // 1024} KB) one block may use on sm_90: smaller tiles or fewer stages")


def _intercept_launches() -> None:
    """Make `kernel[grid](...)` compile instead of run, for every kernel the launchers use."""
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("tsterm_kernels.triton_"):
            continue
        for value in vars(module).values():
            if isinstance(value, JITFunction):
                value.run = (lambda k: lambda *args, grid, warmup=False, **kwargs: _compile_launch(k, args, kwargs))(value)


ATTENTION_TILES, ATTENTION_SPLITS = triton_paged_attention._tiles, triton_paged_attention.num_kv_splits  # (CUDA's)


def _as_device(name: str, num_sms: int) -> None:
    """Make the launchers' device-dependent choices those of the CUDA device `name` with `num_sms` SMs."""
    triton_fused_moe._device_name = lambda device: name
    triton_paged_attention._num_sms = lambda device: num_sms
    cuda = torch.device("cuda")
    triton_paged_attention._tiles = lambda device, *rest: ATTENTION_TILES(cuda, *rest)
    triton_paged_attention.num_kv_splits = lambda programs, max_len, device: ATTENTION_SPLITS(programs, max_len, cuda)


def _attention_batch(seq_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
                     head_dim: int = 128):
    block_size = 16
    blocks = [-(-n // block_size) for n in seq_lens]
    k_cache = torch.empty((sum(blocks) + 8, block_size, num_kv_heads, head_dim), dtype=BF16, device=META)
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    meta = AttentionMetadata(query_start_loc, seq_lens, [], torch.empty(sum(query_lens), dtype=torch.int64, device=META),
                             torch.empty((len(seq_lens), max(blocks)), dtype=torch.int32, device=META), block_size)
    q = torch.empty((sum(query_lens), num_heads, head_dim), dtype=BF16, device=META)
    return q, k_cache, torch.empty_like(k_cache), meta


def main(argv: list[str]) -> int:
    only_moe = len(argv) == 2 and argv[0] == "--moe-tiles"
    if only_moe:
        triton_fused_moe.TILES_FILE = Path(argv[1])
        triton_fused_moe._tile_table.cache_clear()
    elif argv:
        print(__doc__)
        return 2
    _intercept_launches()
    for device, (name, num_sms) in DEVICES.items():
        _as_device(name, num_sms)
        table = triton_fused_moe._tile_table()
        row = name if name in table else "default"
        context["device"] = f"{device} ({name}, {num_sms} SMs)"
        buckets = sorted(int(m) for m in table[row])
        if only_moe:
            _compile_moe(f"{triton_fused_moe.TILES_FILE.name}[{row!r}]", buckets)
        else:
            _compile_everything(f"{triton_fused_moe.TILES_FILE.name}[{row!r}]", buckets)
    print(f"{len(seen)} kernel variants compiled for sm_90, {len(failures)} failures")
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B layer shapes


def _compile_moe(moe_row: str, moe_buckets: list[int]) -> None:
    """The fused MoE (float bf16 experts) at each M bucket of its tile table's row (`moe_row`: its name)."""
    w13 = torch.empty((EXPERTS, 2 * INTER, HIDDEN), dtype=BF16, device=META)
    w2 = torch.empty((EXPERTS, HIDDEN, INTER), dtype=BF16, device=META)
    for num_tokens in moe_buckets:  # each bucket's tiles: T = the bucket's bound selects it
        context["tiles"] = f"{moe_row}[{str(num_tokens)!r}]"
        x = torch.empty((num_tokens, HIDDEN), dtype=BF16, device=META)
        weights, expert_ids = moe_route(torch.empty((num_tokens, EXPERTS), dtype=BF16, device=META), TOP_K, True)
        fused_moe(x, w13, w2, weights, expert_ids, torch.empty_like(x))


def _compile_everything(moe_row: str, moe_buckets: list[int]) -> None:
    """Every kernel through its launcher at Qwen3-30B-A3B / Qwen3-Next sizes; the fused MoE at each M bucket of its
    tile table's row `moe_row`."""
    hidden, inter, experts, top_k = HIDDEN, INTER, EXPERTS, TOP_K

    x = torch.empty((64, hidden), dtype=BF16, device=META)
    rms_norm(x, torch.empty(hidden, dtype=BF16, device=META), 1e-6, torch.empty_like(x))
    rms_norm(torch.empty((64 * 32, 128), dtype=BF16, device=META), torch.empty(128, dtype=BF16, device=META), 1e-6)

    for num_heads, num_kv_heads in [(32, 4), (16, 16)]:
        q, k_cache, v_cache, meta = _attention_batch([4096, 300, 4100], [1, 1, 1], num_heads, num_kv_heads)
        kv = torch.empty((3, 3 * num_kv_heads * 128), dtype=BF16, device=META)
        k = kv[:, :num_kv_heads * 128].view(3, num_kv_heads, 128)
        store_kv(k, k, k_cache, v_cache, meta.slot_mapping)
        paged_attention(q, k_cache, v_cache, meta, 128 ** -0.5)  # decode: split-K + merge
        q, k_cache, v_cache, meta = _attention_batch([2048, 700, 90], [512, 200, 1], num_heads, num_kv_heads)
        paged_attention(q, k_cache, v_cache, meta, 128 ** -0.5)  # prefill / extend: one split

    # gpt-oss's attention: 64 query heads over 8 KV heads of 64, each head's sink, a 128-token window and none
    for window in (128, None):
        for seq_lens, query_lens in (([4096, 300, 4100], [1, 1, 1]), ([2048, 700, 90], [512, 200, 1])):
            q, k_cache, v_cache, meta = _attention_batch(seq_lens, query_lens, 64, 8, head_dim=64)
            paged_attention(q, k_cache, v_cache, meta, 64 ** -0.5, sinks=torch.empty(64, device=META), window=window)

    _compile_moe(moe_row, moe_buckets)
    # a gated shared expert / dense MLP: one expert, top-1 (Qwen1.5-MoE-A2.7B's shared expert size)
    context["tiles"] = f"{moe_row}, 8 tokens"
    x = torch.empty((8, hidden), dtype=BF16, device=META)
    shared_w13 = torch.empty((1, 2 * 5632, hidden), dtype=BF16, device=META)
    shared_w2 = torch.empty((1, hidden, 5632), dtype=BF16, device=META)
    fused_moe(x, shared_w13, shared_w2, torch.empty((8, 1), device=META),
              torch.zeros((8, 1), dtype=torch.int64, device=META), torch.empty_like(x))

    # the same experts stored quantized (Qwen3-30B-A3B-FP8's fp8 blocks; int8 / int4 blocks of a GGUF or a
    # quantize-on-load), at the decode and a prefill bucket
    stacks = {"int8": [QuantizedWeight.blocks("int8", torch.empty((experts, rows, cols), dtype=torch.int8, device=META),
                                              torch.empty((experts, rows, cols // 32), dtype=torch.float16, device=META))
                       for rows, cols in ((2 * inter, hidden), (hidden, inter))],
              "int4": [QuantizedWeight.blocks("int4", torch.empty((experts, rows, cols // 2), dtype=torch.uint8,
                                                                  device=META),
                                              torch.empty((experts, rows, cols // 32, 2), dtype=torch.float16,
                                                          device=META))
                       for rows, cols in ((2 * inter, hidden), (hidden, inter))],
              "fp8": [QuantizedWeight.fp8(torch.empty((experts, rows, cols), dtype=torch.float8_e4m3fn, device=META),
                                          torch.empty((experts, rows // 128, cols // 128), device=META))
                      for rows, cols in ((2 * inter, hidden), (hidden, inter))],
              # gpt-oss's MXFP4 experts: e2m1 codes two a byte, one E8M0 scale per 32 inputs
              "mxfp4": [QuantizedWeight.mxfp4(torch.empty((experts, rows, cols // 2), dtype=torch.uint8, device=META),
                                              torch.empty((experts, rows, cols // 32), dtype=torch.uint8, device=META))
                        for rows, cols in ((2 * inter, hidden), (hidden, inter))]}
    for q13, q2 in stacks.values():
        for num_tokens in (1, 512):
            context["tiles"] = f"{moe_row}, {num_tokens} tokens"
            x = torch.empty((num_tokens, hidden), dtype=BF16, device=META)
            weights, expert_ids = moe_route(torch.empty((num_tokens, experts), dtype=BF16, device=META), top_k, True)
            fused_moe(x, q13, q2, weights, expert_ids, torch.empty_like(x))

    # gpt-oss's experts (20b: H = I = 2880, 32 experts, top-4): both biases and the clamped SwiGLU, on bf16 and on
    # MXFP4 stacks, at the decode and a prefill bucket; and a tensor-parallel rank > 0's launch (no down bias)
    oss_h, oss_i, oss_e, oss_k = 2880, 2880, 32, 4
    oss = {"bf16": [torch.empty((oss_e, rows, cols), dtype=BF16, device=META)
                    for rows, cols in ((2 * oss_i, oss_h), (oss_h, oss_i))],
           "mxfp4": [QuantizedWeight.mxfp4(torch.empty((oss_e, rows, cols // 2), dtype=torch.uint8, device=META),
                                           torch.empty((oss_e, rows, cols // 32), dtype=torch.uint8, device=META))
                     for rows, cols in ((2 * oss_i, oss_h), (oss_h, oss_i))]}
    oss_b13 = torch.empty((oss_e, 2 * oss_i), dtype=BF16, device=META)
    oss_b2 = torch.empty((oss_e, oss_h), dtype=BF16, device=META)
    for o13, o2 in oss.values():
        for num_tokens, down_bias in ((1, oss_b2), (512, oss_b2), (1, None)):
            context["tiles"] = f"{moe_row}, {num_tokens} tokens, gpt-oss"
            x = torch.empty((num_tokens, oss_h), dtype=BF16, device=META)
            weights, expert_ids = moe_route(torch.empty((num_tokens, oss_e), dtype=BF16, device=META), oss_k, True)
            fused_moe(x, o13, o2, weights, expert_ids, torch.empty_like(x), w13_bias=oss_b13, w2_bias=down_bias,
                      clamped_swiglu=(1.702, 7.0))

    # weight-only quantized linear layers (q/k/v of Qwen3-30B-A3B: 5120 x 2048), every tile-table row
    context["tiles"] = "triton_quant_linear.TILES"
    out_f = 5120
    quantized = [QuantizedWeight.blocks("int8", torch.empty((out_f, hidden), dtype=torch.int8, device=META),
                                        torch.empty((out_f, hidden // 32), dtype=torch.float16, device=META)),
                 QuantizedWeight.blocks("int4", torch.empty((out_f, hidden // 2), dtype=torch.uint8, device=META),
                                        torch.empty((out_f, hidden // 32, 2), dtype=torch.float16, device=META)),
                 QuantizedWeight.fp8(torch.empty((out_f, hidden), dtype=torch.float8_e4m3fn, device=META),
                                     torch.empty((out_f // 128, hidden // 128), device=META)),
                 QuantizedWeight.mxfp4(torch.empty((out_f, hidden // 2), dtype=torch.uint8, device=META),
                                       torch.empty((out_f, hidden // 32), dtype=torch.uint8, device=META))]
    for weight in quantized:
        for dtype, rows in ((BF16, (1, 64, 512)), (torch.float32, (1, 64))):
            for num_rows in rows:
                quant_linear(torch.empty((num_rows, hidden), dtype=dtype, device=META), weight)

    # Gated DeltaNet at Qwen3-Next (32 value heads) and Qwen3.5-397B (64) linear-attention sizes: 16 key heads of 128
    context["tiles"] = ""
    for value_heads in (32, 64):
        rows, channels, slots = 300, 2 * 16 * 128 + value_heads * 128, torch.zeros(3, dtype=torch.int64, device=META)
        qkv = torch.empty((rows, channels), dtype=BF16, device=META)
        q, k = qkv[:, :2048].view(rows, 16, 128), qkv[:, 2048:4096].view(rows, 16, 128)
        v = qkv[:, 4096:].view(rows, value_heads, 128)
        g, beta = (torch.empty((rows, value_heads), device=META) for _ in range(2))
        states = torch.empty((8, value_heads, 128, 128), device=META)
        weight, conv_states = (torch.empty((channels, 4), dtype=BF16, device=META),
                               torch.empty((8, channels, 3), dtype=BF16, device=META))
        bounds = torch.zeros((3, 2), dtype=torch.int32, device=META)
        causal_conv1d_update(qkv[:3], weight, conv_states, slots)
        recurrent_gated_delta_rule(q[:3], k[:3], v[:3], g[:3], beta[:3], states, slots)
        causal_conv1d(qkv, weight, conv_states, slots, bounds, torch.empty_like(qkv))
        # not yet chunk_gated_delta_rule: it compiles but spills (2.5 KB per thread at dk = 128, CHUNK = 64)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The torch implementation of tsterm's ops (`dispatch.load("torch")`): the CPU production path. Float32 work on
the CPU goes to tsterm's C kernels (`cpu_native`, `cpu_stack`: csrc/), and so does a bfloat16 model's on the CPU (its
linears through csrc/bf16.c, the ops between them in float32: see "bfloat16 on the CPU" below); the rest runs as torch
ops on any device.

Contracts (shapes, dtypes, what is mutated) are documented here once; the Triton kernels keep the same signatures.
This is production code, not a test oracle: the tests check it, the C kernels and the Triton kernels against the
float64 oracles in tests/kernels/oracles.py, which nothing under tsterm/ or kernels/ imports.
"""
from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from tsterm_kernels import cpu_native, cpu_select
from tsterm_kernels.cpu_select import Choice, ShapeClass
from tsterm_kernels.cpu_stack import DecodeStack, StackLayer
from tsterm_kernels.metadata import AttentionMetadata, BlockRuns
from tsterm_kernels.quant import QuantizedWeight, quantized_linear
from tsterm_kernels.routing import Routing, routing_or_default
# Gated DeltaNet ops (decode and prefill): their torch implementation lives in its own module
from tsterm_kernels.torch_gated_delta import (causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule,
                                              recurrent_gated_delta_rule)

__all__ = ["causal_conv1d", "causal_conv1d_update", "chunk_gated_delta_rule", "cpu_kernel_plan", "decode_stack",
           "expert_mlp", "fused_moe", "linear", "moe_route", "paged_attention", "recurrent_gated_delta_rule", "rms_norm",
           "sigmoid", "store_kv"]


# Which kernel runs each float32 shape class on the CPU (tsterm_kernels.cpu_select): measured once per machine,
# kept beside the built libraries. The lookups below are the ops' only use of it; a class's kernel is the same for
# every row count.
_TIME_PER_CANDIDATE_S = 0.02  # each candidate's share of a class's measurement (the minimum of repeated calls)


@functools.cache
def _machine() -> tuple[cpu_select.CpuInfo, tuple[str, ...], Path]:
    """This process's CPU, the candidates it has and its plan file (the C builds are loaded, the AVX2 one built on
    a CPU with AVX-512, on the first call)."""
    cpu = cpu_select.CpuInfo.detect()
    native = cpu_native.load()
    avx2 = cpu_native.load_variant("avx2") if native is not None and native.isa_bits & cpu_native.ISA_AVX512 else None
    builds = {"native": native, "avx2": avx2}
    candidates = cpu_select.available(cpu, {k: None if b is None else b.isa_bits for k, b in builds.items()})
    path = cpu_select.plan_path(cpu, {k: None if b is None else str(b.path) for k, b in builds.items()})
    return cpu, candidates, path


def cpu_kernel_plan(shapes, override: str | None = None) -> dict[str, Choice]:
    """Each shape class's kernel on this machine (`cpu_select.resolve`): read from the plan file, measured now for
    the classes it lacks (a few tens of milliseconds per candidate) and stored. override: TSTERM_CPU_KERNELS's
    form; default: the variable's value."""
    cpu, _, path = _machine()
    text = os.environ.get(cpu_select.ENV, "") if override is None else override
    forced, shapes = cpu_select.parse_override(text), list(shapes)
    plan = {}
    for kind in dict.fromkeys(s.kind for s in shapes):  # each kind among its own candidates
        plan.update(cpu_select.resolve([s for s in shapes if s.kind == kind], cpu, cpu_candidates(kind),
                                       _time_candidates, path, forced))
    return {s.key: plan[s.key] for s in shapes}


def cpu_candidates(kind: str) -> tuple[str, ...]:
    """The candidates this machine has for a kind of shape class, as `cpu_kernel_plan` chooses among them: the C
    builds and torch for the float32 kinds (torch alone without the C kernels), csrc/bf16.c's arithmetics for "bf16",
    AMX's or the widened one for "bf16-attention"."""
    cpu, candidates, _ = _machine()
    if kind == "bf16":
        return cpu_select.bf16_available(cpu, _bf16_bits())
    if kind == "bf16-attention":
        return cpu_select.bf16_attention_available(cpu, _bf16_bits())
    return ("torch",) if cpu_native.load() is None else candidates


def cpu_plan_path() -> Path:
    """The file this machine's choices are kept in (next to the C builds; named by what the choices depend on)."""
    return _machine()[2]


def cpu_machine() -> cpu_select.CpuInfo:
    """This machine's CPU, as the choices see it."""
    return _machine()[0]


@functools.cache
def _planned(kind: str, dims: tuple[int, ...], override: str) -> str:
    shape = ShapeClass(kind, dims)
    return cpu_kernel_plan([shape], override)[shape.key].candidate


def _chosen(kind: str, dims: tuple[int, ...]) -> "cpu_native.NativeKernels | None":
    """The C build that runs this shape class, or None where torch's path does (the C kernels unavailable, or the
    class's choice). Chosen once per class per process, whatever the rows."""
    if cpu_native.load() is None:
        return None
    candidate = _planned(kind, dims, os.environ.get(cpu_select.ENV, ""))
    return None if candidate == "torch" else cpu_native.load_variant(cpu_select.VARIANT_OF[candidate])


def _time_candidates(shape: ShapeClass, candidates: tuple[str, ...]) -> dict[str, float]:
    """Seconds of one call of each candidate on `shape` at shape.rows rows, on random inputs of the class's sizes: the
    minimum over rounds that call every candidate once in turn, for about _TIME_PER_CANDIDATE_S per candidate, on one
    thread by its CPU clock (`cpu_select.measure`). Weights are cut to 4 M values (the per-output work is what differs
    between the kernels; a vocabulary-sized one would time memory) and stacks of experts to 8."""
    gen = torch.Generator().manual_seed(0)
    rows = shape.rows
    if shape.kind == "bf16":
        out_f, in_f = shape.dims
        x = torch.randn(rows, in_f, generator=gen)
        w = torch.randn(min(out_f, max(32, (1 << 22) // in_f)), in_f, generator=gen).to(torch.bfloat16)
        runs = {name: (lambda: F.linear(x.to(torch.bfloat16), w)) if name == "torch" else
                functools.partial(_bf16_gemm, cpu_native.load(), _bf16_isa(name), x, w) for name in candidates}
    elif shape.kind == "bf16-attention":
        heads, kv_heads, head_dim = shape.dims
        block, blocks = 16, -(-rows // 16)
        q = torch.randn(rows, heads, head_dim, generator=gen)
        k_cache, v_cache = (torch.randn(blocks, block, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
                            for _ in range(2))
        table = torch.arange(blocks, dtype=torch.int32)
        out = torch.empty_like(q)
        native = cpu_native.load()
        runs = {name: functools.partial(
            native.prefill_attention_amx if name == "c-amx" else native.prefill_attention_bf16, q.data_ptr(),
            q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), rows, rows, heads, kv_heads,
            head_dim, block, head_dim ** -0.5, out.data_ptr(), out.stride(0), None, 0) for name in candidates}
    elif shape.kind == "gemm":
        out_f, in_f = shape.dims
        x = torch.randn(rows, in_f, generator=gen)
        w = torch.randn(min(out_f, max(32, (1 << 22) // in_f)), in_f, generator=gen)

        def runner(native):
            return (lambda: F.linear(x, w)) if native is None else (lambda: cpu_native.f32_gemm(native, x, w))
    elif shape.kind == "experts":
        experts, two_inter, hidden, top_k = shape.dims
        experts = min(experts, 8)
        x = torch.randn(rows, hidden, generator=gen)
        w13 = torch.randn(experts, two_inter, hidden, generator=gen) * hidden ** -0.5
        w2 = torch.randn(experts, hidden, two_inter // 2, generator=gen) * (two_inter // 2) ** -0.5
        ids = torch.rand(rows, experts, generator=gen).argsort(-1)[:, :min(top_k, experts)].contiguous()
        weights = torch.rand(ids.shape, generator=gen)
        out = torch.zeros(rows, hidden)

        def runner(native):
            mlp = expert_mlp if native is not None else _torch_expert_mlp
            return lambda: _fused_moe_with(native, x, w13, w2, weights, ids, out, mlp)
    else:
        heads, kv_heads, head_dim = shape.dims
        block = 16
        blocks = -(-rows // block)
        q = torch.randn(rows, heads, head_dim, generator=gen)
        k_cache, v_cache = (torch.randn(blocks, block, kv_heads, head_dim, generator=gen) for _ in range(2))
        table = torch.arange(blocks, dtype=torch.int32)
        out = torch.empty_like(q)
        scale = head_dim ** -0.5

        def runner(native):
            if native is None:
                return lambda: _extend_attention(q, k_cache, v_cache, [(0, blocks)], rows, scale, out)
            return lambda: native.prefill_attention(
                q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), rows, rows, heads,
                kv_heads, head_dim, block, scale, out.data_ptr(), out.stride(0))
    if shape.kind not in ("bf16", "bf16-attention"):
        runs = {name: runner(None if name == "torch" else cpu_native.load_variant(cpu_select.VARIANT_OF[name]))
                for name in candidates}
    return cpu_select.measure(runs, _TIME_PER_CANDIDATE_S)  # one thread, its CPU clock: the neighbours do not decide


# Small-M matmuls on the CPU. MKL runs `x @ W.T` with few rows of x on one core, at about half the memory
# bandwidth two cores can stream, and that is all of batch-1 decode. Viewing W's rows as S stacked blocks
# (`W.view(S, O/S, I)`, no copy) and multiplying all blocks in one `bmm` spreads the weight stream over the
# cores: measured 2x on the bench model's 2-6 MB projections at M = 1 (2 cores, float32). Up to 3 rows, the
# weight-stationary form (x transposed as the small operand) keeps streaming: 4 MB matrices, cold cache, GB/s at
# M = 1/2/3/4: 31.6/29.3/23.0/14.6 (row-split form at M = 3: 14.2; F.linear: 16.7/10.6/9.0/10.7).
_SPLIT_MAX_ROWS = 32
_SPLITS = 4
# Up to this many rows of float32 x, tsterm's C kernel for few rows (csrc/gemm.c's tsterm_f32_matmul: the weight's
# rows transposed in registers, the GEMM's summation order, so a row's result is the bits a GEMM of any number of
# rows gives it). More rows (prefill) take the C GEMM (csrc/gemm.c), 1.3-1.6x MKL on the experts' tens of rows
# (benchmarks/prefill_kernels.py); the row-split bmm is then the path of a machine without the C kernels.
_NATIVE_MAX_ROWS = 4
_FEW_PAIRS = 64  # fused_moe groups at most this many (token, expert) pairs on the host


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); x: [M, I], weight: [O, I] -> [M, O]. Float32 on the CPU: tsterm's C GEMV (M <= 4)
    or GEMM, of the build chosen for the weight's shape class (`cpu_select`: the same for every M); without the C
    kernels (or where the class chose torch) small M runs as a row-split bmm.

    The model's one matmul seam: a `QuantizedWeight` (weight-only int8 / int4) runs its quantized kernel here."""
    if isinstance(weight, QuantizedWeight):
        return quantized_linear(x, weight, bias)
    if weight.dtype is torch.bfloat16 and weight.is_cpu and x.is_cpu and x.dim() == 2:
        return _bf16_linear(x, weight, bias).to(x.dtype)
    rows, (out_features, in_features) = x.shape[0], weight.shape
    if (rows <= _NATIVE_MAX_ROWS and x.dim() == 2 and x.is_cpu and x.dtype is torch.float32
            and weight.dtype is torch.float32 and weight.is_cpu and weight.is_contiguous() and rows > 0):
        native = _chosen("gemm", (out_features, in_features))
        if native is not None:
            x = x if x.is_contiguous() else x.contiguous()
            y = torch.empty((rows, out_features), dtype=torch.float32)
            native.f32_matmul(x.data_ptr(), rows, in_features, weight.data_ptr(), out_features, y.data_ptr())
            return y if bias is None else y + bias
    if rows > _NATIVE_MAX_ROWS and cpu_native.gemm_fits(x, weight):
        native = _chosen("gemm", (out_features, in_features))
        if native is not None:
            y = cpu_native.f32_gemm(native, x, weight)
            return y if bias is None else y + bias
    if (x.device.type != "cpu" or rows > _SPLIT_MAX_ROWS or x.dim() != 2 or out_features % _SPLITS
            or not weight.is_contiguous()):
        return F.linear(x, weight, bias)
    blocks = weight.view(_SPLITS, out_features // _SPLITS, in_features)  # [S, O/S, I] view
    if rows <= 3:  # weight-stationary: [S, O/S, I] @ [S, I, M] -> [S, O/S, M]
        y = torch.bmm(blocks, x.t().expand(_SPLITS, in_features, rows))
        y = y.view(1, out_features) if rows == 1 else y.permute(2, 0, 1).contiguous().view(rows, out_features)
    else:  # [S, M, I] @ [S, I, O/S] -> [S, M, O/S]
        y = torch.bmm(x.expand(_SPLITS, rows, in_features), blocks.transpose(1, 2))
        y = y.transpose(0, 1).contiguous().view(rows, out_features)  # [M, O]: a copy of the small output only
    return y if bias is None else y + bias


def decode_stack(layers: list[StackLayer], num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 scale: float) -> DecodeStack | None:
    """A model's decoder layers as one C call per decode step (`tsterm_kernels.cpu_stack`), or None where the C
    kernels cannot run them, or where a shape class of theirs runs torch's path (`cpu_select`: one kernel per class,
    in a decode as in a prefill); the model then runs every step layer by layer through the ops here. A bfloat16
    model's linears run in the arithmetic of their "bf16" classes (csrc/bf16.c's; a class that chose torch's matmul
    keeps the model layer by layer)."""
    amx = bool(layers) and layers[0].k_cache.dtype is torch.bfloat16 and bf16_attention_amx(num_heads, num_kv_heads,
                                                                                            head_dim)
    stack = DecodeStack.build(layers, num_heads, num_kv_heads, head_dim, eps, scale, _bf16_stack_isa, amx)
    if stack is None:
        return None
    classes = [("attention", (num_heads, num_kv_heads, head_dim))]
    if stack.dtype is torch.bfloat16:  # (its weights' classes: checked by _bf16_stack_isa as it was built)
        return None if not amx and _chosen(*classes[0]) is None else stack
    for layer in layers:
        for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down, layer.router, layer.shared_gate):
            if isinstance(w, torch.Tensor) and w.dim() == 2:
                classes.append(("gemm", tuple(w.shape)))
        if layer.router is not None and isinstance(layer.gate_up, torch.Tensor):
            classes.append(("experts", (*layer.gate_up.shape, layer.top_k)))
        if layer.shared_gate_up is not None and isinstance(layer.shared_gate_up, torch.Tensor):
            classes.append(("experts", (*layer.shared_gate_up.shape, 1)))
    return None if any(_chosen(kind, dims) is None for kind, dims in dict.fromkeys(classes)) else stack


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of `x` (+ `residual` first, when given). Returns (normed, new_residual).

    x, residual: [T, H]; weight: [H]. The residual sum is what the next layer adds onto. On the CPU in float32 it is
    one C call (`csrc/decode.c`), which adds x into `residual` in place and returns it as the new residual.
    bfloat16 on the CPU: the sum rounded to bfloat16, normed in float32 by the same C call, rounded once.
    """
    if x.dtype is torch.bfloat16 and x.is_cpu and x.dim() == 2 and cpu_native.load() is not None:
        return _bf16_rms_norm(x, weight, eps, residual)
    native = _native_f32(x, weight) if residual is None or _is_f32_cpu(residual) else None
    if native is not None and x.dim() == 2:
        out = torch.empty_like(x)
        native.add_rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                            x.shape[0], x.shape[1], eps, out.data_ptr())
        return out, residual
    if residual is not None:
        x = x + residual  # [T, H]
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one fused op: the same arithmetic
        return F.rms_norm(x, weight.shape, weight, eps), residual
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [T, H]
    return weight * xf.to(dtype), residual


def _is_f32_cpu(t: torch.Tensor) -> bool:
    return t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()


def _native_f32(*tensors: torch.Tensor) -> "cpu_native.NativeKernels | None":
    """The C kernels, when every tensor is a contiguous float32 CPU tensor and they are available."""
    for t in tensors:
        if not _is_f32_cpu(t):
            return None
    return cpu_native.load()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write the new tokens' K/V into their slots of the paged pool, in place.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot_mapping: [T] int64. A negative
    slot (a padding row of a padded step) writes nothing.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    rows_ok = cpu_native.rows_contiguous_f32(k) and cpu_native.rows_contiguous_f32(v)
    native = _native_f32(k_cache, v_cache) if rows_ok else None
    # A dispatch mode (tsterm's copy audit) sees torch's copies, not the C call's: it gets the torch path.
    if (native is not None and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and _get_current_dispatch_mode() is None):
        native.store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], num_kv_heads * head_dim,
                        k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr())  # one call, no host sync
        return
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _run_view(cache: torch.Tensor, first_block: int, num_blocks: int, n: int) -> torch.Tensor:
    """The first n slots of a run of consecutive blocks of `cache` [num_blocks, B, Hkv, D], as one [n, Hkv, D] view."""
    return cache[first_block:first_block + num_blocks].flatten(0, 1)[:n]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sinks: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context, read in place from the pool.

    sinks [Hq] float32 (gpt-oss): a learned logit per head that joins each softmax's denominator (a key whose value
    is zero); window: each query sees only the last `window` positions, itself included (gpt-oss's sliding layers).
    The C kernels take both (skipping the splits of keys wholly before a row's window); elsewhere (another device,
    dtype or head size) they take `_sink_window_attention`.

    q: [T, Hq, D] (new tokens, flattened over sequences); k_cache, v_cache: [num_blocks, B, Hkv, D], already
    holding the new tokens' K/V. Returns [T, Hq, D].

    The context is never gathered into a new buffer. Float32 on the CPU, a sequence is one C call that reads the
    pool through its block table (csrc/decode.c for one new token per sequence, csrc/prefill.c for more); otherwise
    each run of consecutive blocks is a view of the pool, attended separately, and the partial results are merged
    by their log-sum-exp.
    """
    if q.dtype is torch.bfloat16 and k_cache.dtype is torch.bfloat16 and q.is_cpu and cpu_native.load() is not None:
        return _bf16_attention(q, k_cache, v_cache, meta, scale, sinks, window)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    sink_window = sinks is not None or window is not None
    sinks = _checked_sink_window(num_heads, sinks, window)
    if num_tokens == len(meta.seq_lens) and q.dtype is torch.float32 and q.stride(2) == 1 and q.stride(1) == head_dim:
        # decode (one new token per sequence): one C call over every sequence's blocks, however many runs
        native = _native_f32(k_cache, v_cache) and _chosen("attention", (num_heads, num_kv_heads, head_dim))
        tables = meta.block_tables
        if (native is not None and tables.dtype is torch.int32 and tables.is_cpu and tables.is_contiguous()
                and head_dim % 16 == 0 and num_heads % num_kv_heads == 0 and (sinks is None or sinks.is_cpu)):
            return _native_decode_attention(native, q, k_cache, v_cache, meta, scale, sinks, window)
    flash = device.type == "cpu" and _FLASH_CPU is not None
    prefill = _native_prefill(q, k_cache, v_cache, meta)
    if sink_window and (prefill is None or (sinks is not None and not sinks.is_cpu)):
        return _sink_window_attention(q, k_cache, v_cache, meta, scale, sinks, window)
    sink_ptr = None if sinks is None else sinks.data_ptr()
    if prefill is None and head_dim % 16 and q.dtype is torch.float32 and _native_f32(k_cache, v_cache) is not None:
        return _rows_alone_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens):
        q_start, q_end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        num_q = q_end - q_start
        if prefill is not None:  # one C call over the sequence's blocks (csrc/prefill.c; a decode row too, same bits)
            table = meta.block_tables[i]
            args = (q[q_start].data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
                    seq_len, num_q, num_heads, num_kv_heads, head_dim, block_size, scale, out[q_start].data_ptr(),
                    out.stride(0))
            status = (prefill.prefill_attention_sw(*args, sink_ptr, window or 0) if sink_window
                      else prefill.prefill_attention(*args))
            if status == -1:
                raise MemoryError("prefill attention: out of memory for its scratch")
            if status != 0:
                raise ValueError(f"prefill attention: sequence {i} has {num_q} new tokens in a context of {seq_len}")
            continue
        if num_q == 1 and flash and len(meta.block_runs[i]) == 1:
            # Decode over one run of blocks (the usual case): one kernel call on views, no mask, nothing to merge.
            first_block, num_blocks = meta.block_runs[i][0]
            k = _run_view(k_cache, first_block, num_blocks, seq_len)
            v = _run_view(v_cache, first_block, num_blocks, seq_len)
            qh = q[q_start].view(1, num_kv_heads, group, head_dim)  # [1, Hkv, G, D]: the group as rows
            o = _FLASH_CPU(qh, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], 0.0, False, scale=scale)[0]
            if len(meta.seq_lens) == 1:
                return o.reshape(1, num_heads, head_dim)
            out[q_start].view(num_kv_heads, group, head_dim).copy_(o[0])
            continue
        if num_q >= _CAUSAL_MIN_QUERIES and flash:
            _extend_attention(q[q_start:q_end], k_cache, v_cache, meta.block_runs[i], seq_len, scale,
                              out[q_start:q_end])
            continue
        # [Hkv, G * nq, D]: one KV head's query group as rows; small (new tokens only), so this copy is cheap.
        qh = q[q_start:q_end].view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qh = qh.reshape(num_kv_heads, group * num_q, head_dim)
        q_pos = None  # [G*nq] position of each row, built when a run needs the causal mask
        acc = lse = None  # merged output so far [Hkv, G*nq, D] and its log-sum-exp [Hkv, G*nq]
        pos = 0
        for first_block, num_blocks in meta.block_runs[i]:
            n = min(num_blocks * block_size, seq_len - pos)
            k, v = _run_view(k_cache, first_block, num_blocks, n), _run_view(v_cache, first_block, num_blocks, n)
            mask = None
            if pos + n - 1 > seq_len - num_q:  # some keys lie after some queries: causal mask
                if q_pos is None:
                    q_pos = torch.arange(seq_len - num_q, seq_len, device=device).repeat(group)
                k_pos = torch.arange(pos, pos + n, device=device)
                mask = k_pos[None, :] <= q_pos[:, None]  # [G*nq, n]
            o_run, lse_run = _attend(qh, k.permute(1, 0, 2), v.permute(1, 0, 2), mask, scale)
            if acc is None:  # the first run holds position 0, which every row sees: nothing to merge yet
                acc, lse = o_run, lse_run
            else:
                new_lse = torch.logaddexp(lse, lse_run)  # [Hkv, G*nq]
                seen = torch.isfinite(lse_run)[..., None]  # rows with no visible key in this run add nothing
                acc = acc * torch.exp(lse - new_lse)[..., None] + \
                    torch.where(seen, o_run * torch.exp(lse_run - new_lse)[..., None], 0.0)
                lse = new_lse
            pos += n
        o = acc.view(num_kv_heads, group, num_q, head_dim).permute(2, 0, 1, 3).reshape(num_q, num_heads, head_dim)
        if len(meta.seq_lens) == 1:  # like the one-run decode: no copy into `out` (a view when num_q == 1)
            return o.to(q.dtype)
        out[q_start:q_end] = o.to(q.dtype)
    return out


def _checked_sink_window(num_heads: int, sinks: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
    """`paged_attention`'s sinks and window checked; the sinks as float32 where they are on the CPU (the loader keeps
    them so: no copy)."""
    if window is not None and window < 1:
        raise ValueError(f"paged_attention: window must be a positive number of positions, got {window}")
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"paged_attention: sinks must be [{num_heads}] (one logit per query head), got "
                             f"{tuple(sinks.shape)}")
        if sinks.is_cpu:
            sinks = sinks.to(torch.float32).contiguous()
    return sinks


_SINK_ROWS_ALONE = 16  # a sequence with at most this many new tokens (a decode, a verify) runs each row alone
_SINK_QUERY_ROWS = 128  # a longer one (a prompt chunk): new tokens per masked score matrix


def _sink_window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """`paged_attention` with attention sinks and / or a sliding window, in float32 on any device.

    Each new token attends over the keys it sees (positions [0, p], or [p - window + 1, p] with a window), gathered
    from the pool through the block table, with each head's sink logit in the denominator:
    p = exp(s - m) / (sum exp(s - m) + exp(sink - m)), m the row's maximum over its keys and the sink.

    A sequence with few new tokens (`_SINK_ROWS_ALONE`: a decode, a verify) runs each row alone over exactly its
    keys, so a row's bits do not depend on the rows beside it (a verify's rows are the decode's). A prompt chunk runs
    `_SINK_QUERY_ROWS` rows at a time over the keys the rows see together, masked (causal, and query - key < window):
    the same values to rounding, at GEMM speed.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = q.device
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    sink = None if sinks is None else sinks.float().view(num_kv_heads, group, 1)
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens):
        q_start, q_end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        first_pos = seq_len - (q_end - q_start)  # the position of the sequence's first new token
        table = meta.block_tables[i]
        alone = q_end - q_start <= _SINK_ROWS_ALONE
        for a in range(q_start, q_end, 1 if alone else _SINK_QUERY_ROWS):
            b = a + 1 if alone else min(a + _SINK_QUERY_ROWS, q_end)
            pos_a, pos_b = first_pos + a - q_start, first_pos + b - q_start  # the rows' positions [pos_a, pos_b)
            k_pos = torch.arange(0 if window is None else max(0, pos_a - window + 1), pos_b, device=device)  # [n]
            slots = table[k_pos // block_size].long() * block_size + k_pos % block_size
            k = k_flat[slots].float().permute(1, 2, 0)  # [Hkv, D, n]
            v = v_flat[slots].float().permute(1, 0, 2)  # [Hkv, n, D]
            # [Hkv, G * nq, D]: each KV head's query rows (a copy: its own buffer, whatever the row's place in q)
            qh = q[a:b].to(torch.float32, copy=True).view(b - a, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            scores = torch.bmm(qh.reshape(num_kv_heads, group * (b - a), head_dim), k).mul_(scale)
            scores = scores.view(num_kv_heads, group, b - a, -1)  # [Hkv, G, nq, n]
            if not alone:  # keys after a row, or before its window, are not its own
                q_pos = torch.arange(pos_a, pos_b, device=device)[:, None]  # [nq, 1]
                visible = k_pos[None, :] <= q_pos
                if window is not None:
                    visible &= k_pos[None, :] > q_pos - window
                scores.masked_fill_(~visible, float("-inf"))
            top = scores.amax(-1, keepdim=True)  # [Hkv, G, nq, 1]: finite, every row sees itself
            if sink is not None:
                top = torch.maximum(top, sink[..., None])
            p = torch.exp(scores - top)
            denom = p.sum(-1, keepdim=True)
            if sink is not None:
                denom = denom + torch.exp(sink[..., None] - top)
            o = torch.bmm((p / denom).view(num_kv_heads, group * (b - a), -1), v)  # [Hkv, G * nq, D]
            out[a:b] = o.view(num_kv_heads, group, b - a, head_dim).permute(2, 0, 1, 3).reshape(
                b - a, num_heads, head_dim).to(q.dtype)
    return out


def _rows_alone_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float) -> torch.Tensor:
    """`paged_attention` for a head size the C kernels do not take (not whole 16s), beside them on the CPU: each new
    token alone over its keys [0, p], gathered through the block table, so its bits do not depend on the rows of its
    step (torch's flash kernel, the other path, blocks its work by the row count: a verify's or a batch's rows would
    not be the decode's). A row's cost is its context's; such heads are the tiny test models'."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens):
        q_start, q_end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        table = meta.block_tables[i].long()
        for row in range(q_start, q_end):
            k_pos = torch.arange(seq_len - (q_end - row) + 1)  # the row's keys: positions [0, p]
            slots = table[k_pos // block_size] * block_size + k_pos % block_size
            qh = q[row].to(torch.float32, copy=True).view(num_kv_heads, group, head_dim)
            scores = torch.bmm(qh, k_flat[slots].permute(1, 2, 0)).mul_(scale)  # [Hkv, G, n]
            p = torch.softmax(scores, dim=-1)
            out[row] = torch.bmm(p, v_flat[slots].permute(1, 0, 2)).view(num_heads, head_dim)
    return out


def _native_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> "cpu_native.NativeKernels | None":
    """The C kernels when csrc/prefill.c can run this step's attention: float32 on the CPU, contiguous head rows,
    an int32 block table, a head size in whole 16s."""
    num_heads, head_dim = q.shape[1:]
    tables = meta.block_tables
    if (q.dtype is not torch.float32 or not q.is_cpu or q.stride(2) != 1 or q.stride(1) != head_dim
            or head_dim % 16 or num_heads % k_cache.shape[2] or tables.dtype is not torch.int32 or not tables.is_cpu
            or not tables.is_contiguous() or _native_f32(k_cache, v_cache) is None):
        return None
    return _chosen("attention", (num_heads, k_cache.shape[2], head_dim))  # the build its shape class runs, or torch


def _native_decode_attention(native: "cpu_native.NativeKernels", q: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                             sinks: torch.Tensor | None = None, window: int | None = None,
                             amx: bool = False) -> torch.Tensor:
    seq_lens = meta.seq_lens_device
    if seq_lens is None or not seq_lens.is_cpu:
        seq_lens = meta.seq_lens_device = torch.tensor(meta.seq_lens, dtype=torch.int32)  # once per step
    out = torch.empty(q.shape, dtype=torch.float32)
    tables = meta.block_tables
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            seq_lens.data_ptr(), len(meta.seq_lens), q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
            out.data_ptr())
    if amx:  # a bfloat16 pool in attention.c's AMX arithmetic (the class "bf16-attention" chose it)
        rc = native.decode_attention_amx(*args, None if sinks is None else sinks.data_ptr(), window or 0)
    elif k_cache.dtype is torch.bfloat16:  # read in place, widened as it is read (csrc/decode.c)
        rc = native.decode_attention_bf16(*args, None if sinks is None else sinks.data_ptr(), window or 0)
    elif sinks is None and window is None:
        rc = native.decode_attention(*args)
    else:  # (csrc/decode.c's tsterm_decode_attention_sw)
        rc = native.decode_attention_sw(*args, None if sinks is None else sinks.data_ptr(), window or 0)
    if rc == -1:
        raise MemoryError("decode attention: out of memory for its partial results")
    if rc != 0:
        raise ValueError(f"decode attention: {q.shape[1]} query heads of size {q.shape[2]} (the C kernel takes up to "
                         f"64 heads of a size that is a multiple of 8)")
    return out


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CAUSAL_MIN_QUERIES = 8  # from this many new tokens, a sequence's attention runs as unmasked + causal pieces


def _extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      runs: list[tuple[int, int]], seq_len: int, scale: float, out: torch.Tensor) -> None:
    """Prefill/extend on the CPU: q [nq, Hq, D] are the last nq positions of a context of `seq_len`; writes out.

    No mask is built. The keys before the first new token are seen by every query: an unmasked piece. A piece of
    keys starting at position p >= first new position is causal for the queries from position p on, exactly the
    kernel's top-left `is_causal` (query row i sees key i and before), and invisible to the queries before p.
    The causal kernel skips the masked half of the work. GQA: an unmasked piece takes each KV head's whole query
    group as rows (the keys are read once per row block); a causal piece takes the group as the kernel's head axis
    with its KV head broadcast over it (stride 0, no copy). Pieces merge by log-sum-exp into their rows.
    """
    num_q, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    first_q = seq_len - num_q
    qh = q.view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, nq, D] view
    acc = lse = q_rows = None  # [Hkv, G, nq, D] float32, [Hkv, G, nq]; q as one row block per KV head
    pos = 0
    for first_block, num_blocks in runs:
        n = min(num_blocks * block_size, seq_len - pos)
        k, v = _run_view(k_cache, first_block, num_blocks, n), _run_view(v_cache, first_block, num_blocks, n)
        split = min(max(first_q - pos, 0), n)  # keys [0, split) of this run precede every query
        pieces = ([(0, split, 0, False)] if split else []) + ([(split, n, pos + split - first_q, True)]
                                                              if split < n else [])
        for a, c, row0, causal in pieces:
            kp, vp = k[a:c].permute(1, 0, 2), v[a:c].permute(1, 0, 2)  # [Hkv, n, D] views
            if causal:
                kp = kp[:, None].expand(num_kv_heads, group, c - a, head_dim)
                vp = vp[:, None].expand(num_kv_heads, group, c - a, head_dim)
                o, piece_lse = _FLASH_CPU(qh[:, :, row0:], kp, vp, 0.0, True, scale=scale)[:2]
            else:  # the group's rows share one pass over the keys: a long prefix is read once per row block
                if q_rows is None:
                    q_rows = qh.reshape(num_kv_heads, group * num_q, head_dim)  # [Hkv, G*nq, D] (new tokens only)
                o, piece_lse = _FLASH_CPU(q_rows[None], kp[None], vp[None], 0.0, False, scale=scale)[:2]
                o, piece_lse = o[0].view(qh.shape), piece_lse[0].view(qh.shape[:3])
            if acc is None:  # the piece holding position 0: it covers every row (row0 = 0)
                acc, lse = o.float(), piece_lse
                continue
            rows_acc, rows_lse = acc[:, :, row0:], lse[:, :, row0:]  # every row of a piece sees >= 1 of its keys
            new_lse = torch.logaddexp(rows_lse, piece_lse)
            rows_acc.mul_(torch.exp(rows_lse - new_lse)[..., None]).add_(o * torch.exp(piece_lse - new_lse)[..., None])
            rows_lse.copy_(new_lse)
        pos += n
    out.view(num_q, num_kv_heads, group, head_dim).copy_(acc.permute(2, 0, 1, 3))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [Hkv, R, D] over views k, v [Hkv, n, D] with an optional boolean mask [R, n] (True: visible).

    Returns (out [Hkv, R, D] float32, log-sum-exp [Hkv, R] float32). On the CPU this is torch's fused flash
    kernel, which reads the strided views of the pool as they are (no copy, no [R, n] score matrix in memory).
    """
    if q.device.type == "cpu" and _FLASH_CPU is not None:
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = _FLASH_CPU(q[None], k[None], v[None], 0.0, False, attn_mask=bias, scale=scale)[:2]
        lse = lse[0].float()
        if mask is not None:  # the kernel reports 0, not -inf, for a row that sees no key
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out[0].float(), lse
    # Matmuls run in the cache dtype: converting the context to float32 first would copy it every step.
    scores = torch.matmul(q * scale, k.transpose(1, 2)).float()  # [Hkv, R, n]
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, R]
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.matmul(p.to(v.dtype), v).float(), lse


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid(x); float32 on the CPU by the C kernels' 1 / (1 + e^-x), the decode stack's shared-expert gate
    (bfloat16 on the CPU: the same in float32, rounded)."""
    if x.dtype is torch.bfloat16 and x.is_cpu and cpu_native.load() is not None:
        return sigmoid(x.float()).to(x.dtype)
    native = _native_f32(x) if x.is_contiguous() else None
    if native is None:
        return torch.sigmoid(x)
    out = torch.empty_like(x)
    native.sigmoid(x.data_ptr(), x.numel(), out.data_ptr())
    return out


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
              routing: Routing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax -> top-k -> optional renormalisation. router_logits: [T, E]. routing: the router's kind
    (`tsterm_kernels.routing`: sigmoid scores, a selection bias, group-limited choice, a scale); None: softmax.

    Returns (weights [T, k] float32, expert_ids [T, k] int64). Stays on the device. Float32 logits on the CPU take
    the C decode stack's routing (csrc/stack.c), so a token routes the same in a prefill and in a decode step.
    """
    routing = routing_or_default(routing)
    if router_logits.dtype is torch.bfloat16 and router_logits.is_cpu:  # routed in float32, as a float32 model is
        router_logits = router_logits.float()
    if routing is not None:
        return _scored_route(router_logits, top_k, renormalize, routing)
    native = _native_f32(router_logits) if router_logits.dim() == 2 and router_logits.is_contiguous() else None
    if native is not None:
        tokens, num_experts = router_logits.shape
        expert_ids = torch.empty((tokens, top_k), dtype=torch.int64)
        weights = torch.empty((tokens, top_k), dtype=torch.float32)
        native.moe_route(router_logits.data_ptr(), tokens, num_experts, top_k, int(renormalize), expert_ids.data_ptr(),
                         weights.data_ptr())
        return weights, expert_ids
    if renormalize:  # softmax over all experts, renormalised over the top k = softmax over the top-k logits
        top_logits, expert_ids = torch.topk(router_logits, top_k, dim=-1)  # [T, k]
        return torch.softmax(top_logits, dim=-1, dtype=torch.float32), expert_ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    return torch.topk(probs, top_k, dim=-1)  # [T, k], [T, k]


def _scored_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                  routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route` of a non-default kind (see `tsterm_kernels.routing`), in float32 torch ops on any device."""
    tokens, num_experts = router_logits.shape
    routing.check(num_experts, top_k)
    native = _native_f32(router_logits) if routing.scoring == "sigmoid" and router_logits.is_contiguous() else None
    if native is not None:  # float32 on the CPU: one C call (csrc/stack.c), the same choice
        expert_ids = torch.empty((tokens, top_k), dtype=torch.int64)
        weights = torch.empty((tokens, top_k), dtype=torch.float32)
        bias = None if routing.bias is None else routing.bias.contiguous()
        native.moe_route_sigmoid(router_logits.data_ptr(), tokens, num_experts, top_k, int(renormalize),
                                 None if bias is None else bias.data_ptr(), routing.num_groups, routing.topk_groups,
                                 routing.scale, expert_ids.data_ptr(), weights.data_ptr())
        return weights, expert_ids
    logits = router_logits.float()
    scores = torch.sigmoid(logits) if routing.scoring == "sigmoid" else torch.softmax(logits, dim=-1)  # [T, E]
    choice = scores if routing.bias is None else scores + routing.bias.to(scores.device)  # [T, E]
    if routing.num_groups > 1:
        grouped = choice.view(tokens, routing.num_groups, -1)  # [T, G, E/G]
        best2 = torch.topk(grouped, 2, dim=-1).values  # [T, G, 2]
        group_scores = best2[..., 0] + best2[..., 1]  # [T, G]
        kept = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :routing.topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, num_experts)
    # stable: equal choices go to the lower expert id, as in the C and Triton kernels
    expert_ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
    weights = scores.gather(1, expert_ids)  # [T, k]: the unbiased scores
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return weights, expert_ids


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: x [n, H], w13 [2I, H] (gate rows then up rows), w2 [H, I] -> [n, H]."""
    if _bf16_cpu(w13, w2) and x.is_cpu:
        return _bf16_expert_mlp(x, w13, w2).to(x.dtype)
    h = linear(x, w13)  # [n, 2I]
    inter = w2.shape[1]
    native = _native_f32(h)
    if native is not None and h.dim() == 2:  # one C call (csrc/decode.c), into a contiguous [n, I]
        gate = torch.empty((h.shape[0], inter), dtype=torch.float32)
        native.swiglu(h.data_ptr(), h.shape[0], inter, gate.data_ptr())
    else:
        gate = F.silu(h[:, :inter], inplace=True).mul_(h[:, inter:])  # silu(gate) * up, in h's gate half
    return linear(gate, w2)  # [n, H]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              expert_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out += sum_k weights[:, k] * expert_{ids[:, k]}(x), with SwiGLU experts, accumulated in place.

    x: [T, H]; w13: [E, 2I, H] (gate rows then up rows, [out, in] layout); w2: [E, H, I]; weights: [T, k];
    expert_ids: [T, k]; out: [T, H]. Only the experts that received tokens are touched. An id equal to E names an
    expert this rank does not hold (expert parallelism): that pair adds nothing.
    """
    if _bf16_cpu(w13, w2) and x.is_cpu:
        return _bf16_fused_moe(x, w13, w2, weights, expert_ids, out)
    num_experts, top_k = w13.shape[0], expert_ids.shape[1]
    floats = isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and expert_ids.dtype is torch.int64
    native = _native_f32(x, w13, w2, weights, out) if floats else None
    mlp = expert_mlp
    if native is not None:  # the build its shape class runs (cpu_select), or torch's op loop with torch's matmuls
        native = _chosen("experts", (num_experts, w13.shape[1], w13.shape[2], top_k))
        mlp = expert_mlp if native is not None else _torch_expert_mlp
    return _fused_moe_with(native, x, w13, w2, weights, expert_ids, out, mlp)


def _torch_expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """expert_mlp by torch's ops alone (the experts' shape class chose torch)."""
    h = F.linear(x, w13)
    inter = w2.shape[1]
    return F.linear(F.silu(h[:, :inter]).mul_(h[:, inter:]), w2)


def _fused_moe_with(native: "cpu_native.NativeKernels | None", x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, expert_ids: torch.Tensor, out: torch.Tensor, mlp=expert_mlp) -> torch.Tensor:
    """fused_moe by the C build `native` (one call), else by a loop of torch ops with `mlp` per expert."""
    num_tokens, top_k = expert_ids.shape
    num_experts = w13.shape[0]
    if native is not None and expert_ids.is_contiguous() and _get_current_dispatch_mode() is None:
        # one C call (csrc/moe.c), the same bits as the loop below; the copy audit (a dispatch mode) gets the loop
        if native.moe_prefill(x.data_ptr(), num_tokens, x.shape[1], w13.data_ptr(), w2.data_ptr(), num_experts,
                              w2.shape[2], expert_ids.data_ptr(), weights.data_ptr(), top_k, out.data_ptr()) != 0:
            raise MemoryError("fused_moe: out of memory for its scratch")
        return out
    if num_tokens * top_k <= _FEW_PAIRS and x.device.type == "cpu":
        # Decode: a handful of (token, expert) pairs, grouped on the host (the ids are already in host memory);
        # a single token reads its row of x as a view. Experts go in ascending id and each weighted output is
        # rounded before it is added, as in the loop below: a token's sum does not depend on its neighbours.
        by_expert: dict[int, list[tuple[int, float]]] = {}
        for token, (ids, ws) in enumerate(zip(expert_ids.tolist(), weights.tolist())):
            for expert, weight in zip(ids, ws):
                if expert < num_experts:
                    by_expert.setdefault(expert, []).append((token, weight))
        for expert in sorted(by_expert):
            pairs = by_expert[expert]
            if len(pairs) == 1:
                token, weight = pairs[0]
                out[token:token + 1].add_(mlp(x[token:token + 1], w13[expert], w2[expert]).mul_(weight))
                continue
            tokens = torch.tensor([t for t, _ in pairs], device=x.device)
            ys = mlp(x.index_select(0, tokens), w13[expert], w2[expert])  # [n, H]
            out.index_add_(0, tokens, ys.mul_(torch.tensor([w for _, w in pairs], dtype=ys.dtype)[:, None]))
        return out
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # token/expert pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()[:num_experts]  # host sync: CPU path only
    token_of_pair = order // top_k  # [T*k]
    weight_of_pair = weights.reshape(-1)[order]  # [T*k]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of_pair[start:start + count]  # [n]
        y = mlp(x[tokens], w13[expert], w2[expert])  # [n, H]
        out.index_add_(0, tokens, y.mul_(weight_of_pair[start:start + count, None].to(y.dtype)))
        start += count
    return out


# bfloat16 on the CPU (a model run with dtype bfloat16): its linears take csrc/bf16.c (AMX tiles, AVX512-BF16, or
# plain C: the arithmetic its "bf16" shape class chose, the same for every row count), with float32 sums; the ops
# between them run in float32 by the float32 path's C kernels on the exact float32 values of their bfloat16 inputs
# (norms, routing, SwiGLU, attention over the blocks a step reads), rounded to bfloat16 where the model's dtype
# wants it. So a row's bits do not depend on the rows beside it, as in float32 (README "Same answer whatever the
# cache or the batch").


@functools.cache
def _bf16_bits() -> int | None:
    """The native build's csrc/bf16.c instruction sets (tsterm_bf16_isa(): 1 AVX512-BF16, 2 AMX granted), or None
    without the C kernels."""
    native = cpu_native.load()
    return None if native is None else native.bf16_isa()


def _bf16_isa(candidate: str) -> int:
    """csrc/bf16.c's isa argument for a "bf16" candidate: c-amx's, or c-bf16's (AVX512-BF16 where built, else plain)."""
    return cpu_select.BF16_ISA.get(candidate, 1 if (_bf16_bits() or 0) & 1 else 0)


def _bf16_cpu(*tensors) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype is torch.bfloat16 and t.is_cpu for t in tensors)


def _bf16_stack_isa(shape: tuple[int, int]) -> int | None:
    """csrc/bf16.c's instruction set for a bfloat16 weight of this shape in the decode stack: its "bf16" class's
    (what `_bf16_linear` runs it with), or None where the class runs torch or the C kernels are unavailable."""
    if cpu_native.load() is None:
        return None
    candidate = _planned("bf16", tuple(shape), os.environ.get(cpu_select.ENV, ""))
    return None if candidate == "torch" else _bf16_isa(candidate)


def _bf16_gemm(native: "cpu_native.NativeKernels", isa: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, I] (float32, rounded to bfloat16 by the kernel, or bfloat16) @ weight [O, I] bfloat16 .T -> a new float32
    [M, O], by csrc/bf16.c with instruction set `isa`."""
    if x.stride(-1) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        x = x.to(torch.float32).contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    rc = native.bf16_gemm(x.data_ptr(), int(x.dtype is torch.bfloat16), x.stride(0), x.shape[0], x.shape[1],
                          weight.data_ptr(), weight.shape[0], y.data_ptr(), y.stride(0), isa)
    if rc == -1:
        raise MemoryError("bfloat16 linear: out of memory for its rounded inputs")
    if rc != 0:
        raise RuntimeError(f"bfloat16 linear: this build has no code for instruction set {isa}")
    return y


def _bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` of a bfloat16 weight on the CPU, as float32 [M, O] (the sums, + bias, not yet rounded): the kernel
    its shape class chose (`cpu_select`: csrc/bf16.c's AMX or AVX512-BF16 / plain code), or torch's bfloat16 matmul
    where the class runs torch (forced) or the C kernels are unavailable."""
    native = cpu_native.load()
    candidate = "torch" if native is None else _planned("bf16", tuple(weight.shape), os.environ.get(cpu_select.ENV, ""))
    if candidate == "torch" or x.shape[0] == 0:
        y = F.linear(x.to(torch.bfloat16), weight).float()
    else:
        y = _bf16_gemm(native, _bf16_isa(candidate), x, weight)
    return y if bias is None else y.add_(bias.float())


def _bf16_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rms_norm` of bfloat16 rows on the CPU: x + residual rounded (the new residual), normed by the float32 C call
    on its exact float32 values, times the weight, rounded once."""
    if residual is not None:
        x = residual = x + residual  # [T, H] bfloat16: each sum rounded once, whatever the rows
    xf = x.float().contiguous()
    w = weight.float().contiguous()
    out = torch.empty_like(xf)
    cpu_native.load().add_rms_norm(xf.data_ptr(), 0, w.data_ptr(), xf.shape[0], xf.shape[1], eps, out.data_ptr())
    return out.to(x.dtype), residual


def bf16_attention_amx(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the attention of a bfloat16 pool with these heads runs csrc/attention.c's AMX arithmetic (its
    "bf16-attention" class chose "c-amx"), in a prefill, a decode and the decode stack alike; else the pool is widened
    to float32 as it is read."""
    if cpu_native.load() is None:
        return False
    dims = (num_heads, num_kv_heads, head_dim)
    return _planned("bf16-attention", dims, os.environ.get(cpu_select.ENV, "")) == "c-amx"


def _bf16_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """`paged_attention` over a bfloat16 pool on the CPU, rounded to bfloat16, in the arithmetic its "bf16-attention"
    class chose: AMX's (`bf16_attention_amx`: csrc/attention.c's bfloat16 products on AMX tiles, the same bits in a
    decode and a prefill), or the C kernels of the float32 path (csrc/decode.c for one new token per sequence,
    csrc/prefill.c for more) reading the pool in place, each K and V row widened to float32 as it is loaded, with q's
    float32 values (the new tokens only are converted). A widened row's result is the bits the float32 path gives on
    the pool converted to float32, which is what runs where those kernels do not (`_bf16_attention_converted`: a head
    size or layout they do not take, or the attention class chose torch)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    tables = meta.block_tables
    native, amx = None, False
    if (head_dim % 16 == 0 and num_heads % num_kv_heads == 0 and v_cache.dtype is torch.bfloat16
            and k_cache.is_contiguous() and v_cache.is_contiguous() and tables.dtype is torch.int32 and tables.is_cpu
            and tables.is_contiguous() and (sinks is None or sinks.is_cpu)):
        amx = bf16_attention_amx(num_heads, num_kv_heads, head_dim)
        # AMX's arithmetic runs in the native build; else the float32 path's build, or torch
        native = cpu_native.load() if amx else _chosen("attention", (num_heads, num_kv_heads, head_dim))
    if native is None:
        return _bf16_attention_converted(q, k_cache, v_cache, meta, scale, sinks, window)
    sinks = _checked_sink_window(num_heads, sinks, window)
    qf = q.float()  # [T, Hq, D] contiguous: the step's new tokens
    if num_tokens == len(meta.seq_lens):  # one new token per sequence: one call over every sequence's blocks
        return _native_decode_attention(native, qf, k_cache, v_cache, meta, scale, sinks, window,
                                        amx).to(q.dtype)
    out = torch.empty_like(qf)
    sink_ptr = None if sinks is None else sinks.data_ptr()
    prefill = native.prefill_attention_amx if amx else native.prefill_attention_bf16
    for i, seq_len in enumerate(meta.seq_lens):  # one call per sequence over its blocks (csrc/prefill.c)
        q_start, num_q = meta.query_start_loc[i], meta.query_start_loc[i + 1] - meta.query_start_loc[i]
        status = prefill(
            qf[q_start].data_ptr(), qf.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables[i].data_ptr(), seq_len,
            num_q, num_heads, num_kv_heads, head_dim, k_cache.shape[1], scale, out[q_start].data_ptr(), out.stride(0),
            sink_ptr, window or 0)
        if status == -1:
            raise MemoryError("prefill attention: out of memory for its scratch")
        if status != 0:
            raise ValueError(f"prefill attention: sequence {i} has {num_q} new tokens in a context of {seq_len}")
    return out.to(q.dtype)


def _bf16_attention_converted(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """`_bf16_attention` where the C kernels do not read the pool: the blocks each sequence reads, converted to
    float32 (exact) into a small pool of their own (one after another: a block two sequences share is copied for
    each), and the float32 path over it, rounded to bfloat16. The copy is the step's context once per layer."""
    block_size = k_cache.shape[1]
    counts = [-(-n // block_size) for n in meta.seq_lens]  # blocks each sequence's context uses
    starts = [0, *itertools.accumulate(counts)][:-1]  # each sequence's first block in the small pool
    tables = meta.block_tables
    blocks = tables[0, :counts[0]] if len(counts) == 1 else torch.cat([tables[i, :c] for i, c in enumerate(counts)])
    local_tables = torch.full((len(counts), max(max(counts, default=0), 1)), -1, dtype=torch.int32)
    for i, (start, c) in enumerate(zip(starts, counts)):
        local_tables[i, :c] = torch.arange(start, start + c, dtype=torch.int32)
    host = BlockRuns([list(range(start, start + c)) for start, c in zip(starts, counts)])
    meta32 = AttentionMetadata(meta.query_start_loc, meta.seq_lens, host, meta.slot_mapping, local_tables,
                               meta.block_size, seq_lens_device=meta.seq_lens_device)
    blocks = blocks.long()
    k32, v32 = k_cache.index_select(0, blocks).float(), v_cache.index_select(0, blocks).float()
    return paged_attention(q.float(), k32, v32, meta32, scale, sinks, window).to(q.dtype)


def _bf16_expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert of bfloat16 weights on the CPU, as float32 [n, H]: gate and up as float32 sums, SwiGLU by the
    C call in float32, its result rounded to bfloat16 by the down projection's kernel."""
    h = _bf16_linear(x, w13)  # [n, 2I] float32
    inter = w2.shape[1]
    gate = torch.empty((h.shape[0], inter), dtype=torch.float32)
    cpu_native.load().swiglu(h.data_ptr(), h.shape[0], inter, gate.data_ptr())
    return _bf16_linear(gate, w2)


def _bf16_fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    expert_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`fused_moe` of bfloat16 experts on the CPU: each expert with tokens runs its rows at once (`_bf16_expert_mlp`),
    and a token's weighted outputs are summed in float32 in ascending expert id, then added to `out` (one rounding):
    the same sequence of operations for a token whatever the other tokens of the step."""
    num_experts, top_k = w13.shape[0], expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert; ids == E (another rank's) last
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    token_of_pair = order // top_k
    weight_of_pair = weights.reshape(-1).float()[order]
    acc = torch.zeros(out.shape, dtype=torch.float32)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of_pair[start:start + count]  # [n], distinct tokens (top-k picks distinct experts)
        y = _bf16_expert_mlp(x.index_select(0, tokens), w13[expert], w2[expert])  # [n, H] float32
        acc.index_add_(0, tokens, y.mul_(weight_of_pair[start:start + count, None]))
        start += count
    return out.add_(acc)

"""Fused MoE: grouped GEMMs over expert-aligned token tiles, SwiGLU fused into the first, the routing weight
and the combine fused into the second, which atomically adds straight into `out` (no [T, k, H] temporary).

Twin: `tsterm_kernels.torch_ops.fused_moe`. The expert stacks are float, or int8 / int4 / fp8 / mxfp4 `QuantizedWeight`s
read as stored and dequantized in registers by the quantized linear layer's K loop (`triton_quant_linear.quant_dot`;
its twin is the reference with the dequantized stacks). Tile sizes come from `moe_tiles.json` (device name x M bucket).
The only temporary is the SwiGLU activation, [T*k, I] in the activation dtype. Rounding follows the twin: the
projections and the activation are rounded to the storage dtype where the twin's F.linear would round them.
Loads are cast to float32 at once; dot operands go back to the storage dtype (tensor cores for bf16/fp16), and
float32 dots are exact ("ieee", not tf32), as the twin's float32 matmuls are.
gpt-oss's experts run here too (one launch of each kernel per layer): per-expert biases on both projections and the
clamped SwiGLU (constexpr variants HAS_BIAS / CLAMPED; their twin is `tsterm.model.clamped_swiglu`'s per-expert loop).
w13's rows are gate rows, then up rows, as the loader stores gpt-oss's interleaved `gate_up_proj` (de-interleaved).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from tsterm_kernels.quant import FP8_BLOCK, QuantizedWeight
from tsterm_kernels.triton_moe_align import moe_align
from tsterm_kernels.triton_quant_linear import KIND_IDS, quant_dot

TILES_FILE = Path(__file__).with_name("moe_tiles.json")


@triton.jit
def _gate_up_kernel(
    # pointers
    x_ptr, w13_ptr, scale13_ptr, sorted_pairs_ptr, tile_experts_ptr, act_ptr, b13_ptr,
    # sizes and strides (the reduction dimension is unit-stride)
    num_pairs, top_k, hidden_size, inter_size,
    stride_x_token, stride_w13_expert, stride_w13_row, stride_s13_expert, stride_s13_row, stride_s13_col,
    stride_act_pair, stride_b13_expert,
    # the clamped SwiGLU's sigmoid scale and clamp limit (read when CLAMPED)
    alpha, limit,
    # meta-parameters
    # (the tile sizes last: sm90_compile's report lists them together)
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    n_tile = tl.program_id(1)

    # ---- this tile's expert and token rows (spare tiles of the upper bound leave at once)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_valid = pairs < num_pairs
    tokens = tl.where(row_valid, pairs // top_k, 0).to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] rows of the gate (and, +I, the up) projection
    col_valid = cols < inter_size
    ks = tl.arange(0, BLOCK_K)

    # ---- gate and up projections over the hidden dimension
    if KIND < 0:  # float weights
        x_ptrs = x_ptr + tokens[:, None] * stride_x_token + ks[None, :]  # [BLOCK_M, BLOCK_K]
        gate_ptrs = (w13_ptr + expert.to(tl.int64) * stride_w13_expert
                     + cols[None, :].to(tl.int64) * stride_w13_row + ks[:, None])  # [BLOCK_K, BLOCK_N]
        up_ptrs = gate_ptrs + inter_size * stride_w13_row
        dot_dtype = w13_ptr.dtype.element_ty
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden_size, BLOCK_K):
            k_valid = k0 + ks < hidden_size
            x = tl.load(x_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
            w_mask = k_valid[:, None] & col_valid[None, :]
            w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0).to(tl.float32)
            gate = tl.dot(x.to(dot_dtype), w_gate.to(dot_dtype), gate, input_precision="ieee")
            up = tl.dot(x.to(dot_dtype), w_up.to(dot_dtype), up, input_precision="ieee")
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K
            up_ptrs += BLOCK_K
    else:  # int8 / int4 / fp8 / mxfp4 weights, dequantized in registers (the quantized linear layer's K loop)
        x_rows = x_ptr + tokens[:, None] * stride_x_token  # [BLOCK_M, 1]
        gate_cols = w13_ptr + expert.to(tl.int64) * stride_w13_expert + cols[None, :].to(tl.int64) * stride_w13_row
        up_cols = gate_cols + inter_size * stride_w13_row
        scales = scale13_ptr + expert.to(tl.int64) * stride_s13_expert
        if KIND == 2:  # fp8: a row of scales per 128 rows of w13 (the up rows start at row I)
            gate_s = scales + (cols // 128).to(tl.int64) * stride_s13_row
            up_s = scales + ((cols + inter_size) // 128).to(tl.int64) * stride_s13_row
        else:
            gate_s = scales + cols.to(tl.int64) * stride_s13_row
            up_s = gate_s + inter_size * stride_s13_row
        zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        gate = quant_dot(zero, x_rows, row_valid, gate_cols, col_valid, gate_s, stride_s13_col, hidden_size,
                         KIND, BLOCK_K)
        up = quant_dot(zero, x_rows, row_valid, up_cols, col_valid, up_s, stride_s13_col, hidden_size, KIND, BLOCK_K)

    # ---- the expert's biases (added to the float32 sums: one rounding of each projection, as F.linear's)
    if HAS_BIAS:
        biases = b13_ptr + expert.to(tl.int64) * stride_b13_expert
        gate += tl.load(biases + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        up += tl.load(biases + inter_size + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]

    # ---- SwiGLU, one row per pair
    act_dtype = act_ptr.dtype.element_ty
    gate = gate.to(act_dtype).to(tl.float32)
    up = up.to(act_dtype).to(tl.float32)
    if CLAMPED:  # gpt-oss: ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), each
        # op rounded to the storage dtype as the twin's (tsterm.model.clamped_swiglu) in-place ops round it
        gate = tl.minimum(gate, limit).to(act_dtype).to(tl.float32)
        up = tl.minimum(tl.maximum(up, -limit), limit).to(act_dtype).to(tl.float32)
        up = (up + 1.0).to(act_dtype).to(tl.float32)
        s = tl.sigmoid((gate * alpha).to(act_dtype).to(tl.float32)).to(act_dtype).to(tl.float32)
        act = (s * gate).to(act_dtype).to(tl.float32) * up
    else:
        act = (gate * tl.sigmoid(gate)).to(act_dtype).to(tl.float32) * up
    tl.store(act_ptr + pairs[:, None].to(tl.int64) * stride_act_pair + cols[None, :], act.to(act_dtype),
             mask=row_valid[:, None] & col_valid[None, :])


@triton.jit
def _down_kernel(
    # pointers
    act_ptr, w2_ptr, scale2_ptr, sorted_pairs_ptr, tile_experts_ptr, weights_ptr, out_ptr, b2_ptr,
    # sizes and strides (the reduction dimension is unit-stride)
    num_pairs, top_k, hidden_size, inter_size,
    stride_act_pair, stride_w2_expert, stride_w2_row, stride_s2_expert, stride_s2_row, stride_s2_col,
    stride_weights_token, stride_weights_slot, stride_out_token, stride_b2_expert,
    # meta-parameters
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    n_tile = tl.program_id(1)

    # ---- this tile's expert and pair rows
    expert = tl.load(tile_experts_ptr + tile)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_valid = pairs < num_pairs
    safe_pairs = tl.where(row_valid, pairs, 0).to(tl.int64)
    tokens = safe_pairs // top_k
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    col_valid = cols < hidden_size
    ks = tl.arange(0, BLOCK_K)

    # ---- down projection over the intermediate dimension
    if KIND < 0:  # float weights
        act_ptrs = act_ptr + safe_pairs[:, None] * stride_act_pair + ks[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = (w2_ptr + expert.to(tl.int64) * stride_w2_expert
                  + cols[None, :].to(tl.int64) * stride_w2_row + ks[:, None])  # [BLOCK_K, BLOCK_N]
        dot_dtype = w2_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            k_valid = k0 + ks < inter_size
            act = tl.load(act_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(act.to(dot_dtype), w.to(dot_dtype), acc, input_precision="ieee")
            act_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:  # int8 / int4 / fp8 / mxfp4 weights, dequantized in registers
        act_rows = act_ptr + safe_pairs[:, None] * stride_act_pair  # [BLOCK_M, 1]
        w_cols = w2_ptr + expert.to(tl.int64) * stride_w2_expert + cols[None, :].to(tl.int64) * stride_w2_row
        scales = scale2_ptr + expert.to(tl.int64) * stride_s2_expert
        if KIND == 2:  # fp8: a row of scales per 128 rows of w2
            s_cols = scales + (cols // 128).to(tl.int64) * stride_s2_row
        else:
            s_cols = scales + cols.to(tl.int64) * stride_s2_row
        acc = quant_dot(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), act_rows, row_valid, w_cols, col_valid, s_cols,
                        stride_s2_col, inter_size, KIND, BLOCK_K)

    # ---- the expert's down bias (to the float32 sums, before the one rounding), then weight by the routing
    # probability and add into the token's output row
    if HAS_BIAS:
        acc += tl.load(b2_ptr + expert.to(tl.int64) * stride_b2_expert + cols, mask=col_valid,
                       other=0.0).to(tl.float32)[None, :]
    # (a token picks an expert at most once, so the rows of one tile never hit the same address)
    out_dtype = out_ptr.dtype.element_ty
    routing = tl.load(weights_ptr + tokens * stride_weights_token + (safe_pairs % top_k) * stride_weights_slot,
                      mask=row_valid, other=0.0).to(tl.float32)  # [BLOCK_M]
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * routing.to(act_ptr.dtype.element_ty).to(tl.float32)[:, None]
    tl.atomic_add(out_ptr + tokens[:, None] * stride_out_token + cols[None, :], y.to(out_dtype),
                  mask=row_valid[:, None] & col_valid[None, :], sem="relaxed")


@functools.lru_cache(maxsize=None)
def _tile_table() -> dict:
    if not TILES_FILE.is_file():
        raise FileNotFoundError(f"{TILES_FILE} is missing: it ships with the kernels (package data of tsterm_kernels); "
                                "reinstall, or copy it from the repository's kernels/ directory")
    return json.loads(TILES_FILE.read_text())


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def tile_config(device: torch.device, num_tokens: int) -> dict[str, int]:
    """Tile sizes for `num_tokens` on `device`: the smallest M bucket >= num_tokens, else the largest."""
    table = _tile_table()
    buckets = table.get(_device_name(device), table["default"])
    sizes = sorted(int(m) for m in buckets)
    chosen = next((m for m in sizes if m >= num_tokens), sizes[-1])
    return buckets[str(chosen)]


def _weight_args(w: "torch.Tensor | QuantizedWeight", name: str) -> tuple:
    """(data, scale, data strides [expert, row], scale strides [expert, row, block], kind id) of an expert stack."""
    if isinstance(w, QuantizedWeight):
        assert w.kind in KIND_IDS, f"{name}: the Triton fused MoE reads int8, int4, fp8 and mxfp4 stacks, not {w.kind}"
        data, scale = w.data, w.scale
        assert data.stride(-1) == 1 and scale.device == data.device, f"{name}: unit-stride rows on one device"
        assert w.kind == "int8" or scale.stride(-1) == 1, f"{name}: int4 (d, m) pairs must be adjacent"
        return data, scale, data.stride(0), data.stride(1), scale.stride(0), scale.stride(1), scale.stride(2), \
            KIND_IDS[w.kind]
    assert w.stride(-1) == 1, f"{name} must have a unit last stride, got {w.stride()}"
    return w, w, w.stride(0), w.stride(1), 0, 0, 0, -1  # (no scales: the data pointer stands in, never read)


def _bias_args(bias: torch.Tensor | None, num_experts: int, rows: int, x: torch.Tensor, name: str) -> tuple:
    """(pointer, expert stride, present) of an optional [E, rows] per-expert bias (x's pointer stands in for none,
    never read)."""
    if bias is None:
        return x, 0, False
    assert tuple(bias.shape) == (num_experts, rows) and bias.is_floating_point(), \
        f"{name} must be [{num_experts}, {rows}] float, got {tuple(bias.shape)} {bias.dtype}"
    assert bias.stride(1) == 1 and bias.device == x.device, f"{name}: unit-stride rows on x's device"
    return bias, bias.stride(0), True


def fused_moe(x: torch.Tensor, w13: "torch.Tensor | QuantizedWeight", w2: "torch.Tensor | QuantizedWeight",
              weights: torch.Tensor, expert_ids: torch.Tensor, out: torch.Tensor, *,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              clamped_swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """w13, w2: float stacks in x's dtype, or QuantizedWeight stacks (int8 / int4 / fp8 / mxfp4, each on its own;
    int8 / int4 / mxfp4 need whole blocks of 32 inputs, as their format does); the dot then runs in x's dtype.

    gpt-oss's experts (the twin: `tsterm.model.clamped_swiglu.clamped_swiglu_experts`): w13_bias [E, 2I] (gate
    biases, then up biases, as w13's rows) added to the projections before the activation, w2_bias [E, H] added to
    the down projection before the routing weight scales it; clamped_swiglu = (alpha, limit): the activation
    ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)) instead of silu(gate) * up."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with unit last stride, got {x.stride()}"
    num_tokens, hidden_size = x.shape
    assert w13.dim() == 3 and w13.shape[2] == hidden_size and w13.shape[1] % 2 == 0, \
        f"w13 must be [E, 2I, {hidden_size}], got {tuple(w13.shape)}"
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    assert tuple(w2.shape) == (num_experts, hidden_size, inter_size), \
        f"w2 must be [{num_experts}, {hidden_size}, {inter_size}], got {tuple(w2.shape)}"
    assert expert_ids.dim() == 2 and expert_ids.shape[0] == num_tokens, f"expert_ids must be [T, k], got {tuple(expert_ids.shape)}"
    assert expert_ids.dtype in (torch.int32, torch.int64), f"expert_ids dtype {expert_ids.dtype}"
    top_k = expert_ids.shape[1]
    assert weights.shape == expert_ids.shape and weights.is_floating_point(), \
        f"weights must be [T, {top_k}] float, got {tuple(weights.shape)} {weights.dtype}"
    assert out.shape == x.shape and out.stride(1) == 1, f"out must be [T, H] with unit last stride, got {tuple(out.shape)}"
    data13, scale13, *strides13, kind13 = _weight_args(w13, "w13")
    data2, scale2, *strides2, kind2 = _weight_args(w2, "w2")
    floats = [w.dtype for w in (w13, w2) if not isinstance(w, QuantizedWeight)]
    assert all(d == x.dtype for d in [out.dtype, *floats]), \
        f"dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}, out {out.dtype}"
    assert x.device == w13.device == w2.device == weights.device == expert_ids.device == out.device
    b13, stride_b13, has_b13 = _bias_args(w13_bias, num_experts, 2 * inter_size, x, "w13_bias")
    b2, stride_b2, has_b2 = _bias_args(w2_bias, num_experts, hidden_size, x, "w2_bias")
    alpha, limit = (0.0, 0.0) if clamped_swiglu is None else (float(clamped_swiglu[0]), float(clamped_swiglu[1]))
    assert clamped_swiglu is None or limit > 0, f"clamped_swiglu limit must be > 0, got {limit}"
    if num_tokens == 0:
        return out
    tiles = tile_config(x.device, num_tokens)
    block_m = tiles["BLOCK_M"]
    assert FP8_BLOCK % tiles["BLOCK_K"] == 0 or KIND_IDS["fp8"] not in (kind13, kind2), \
        f"fp8 stacks need a BLOCK_K that divides {FP8_BLOCK}, got {tiles['BLOCK_K']}"
    launch = dict(num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])

    sorted_pairs, tile_experts = moe_align(expert_ids.contiguous(), num_experts, block_m)
    num_pairs, num_tiles = expert_ids.numel(), tile_experts.numel()
    act = torch.empty((num_pairs, inter_size), dtype=x.dtype, device=x.device)  # [T*k, I]
    _gate_up_kernel[(num_tiles, triton.cdiv(inter_size, tiles["BLOCK_N"]))](
        x, data13, scale13, sorted_pairs, tile_experts, act, b13,
        num_pairs, top_k, hidden_size, inter_size,
        x.stride(0), *strides13, act.stride(0), stride_b13, alpha, limit,
        KIND=kind13, BLOCK_M=block_m, BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"], HAS_BIAS=has_b13,
        CLAMPED=clamped_swiglu is not None, **launch,
    )
    _down_kernel[(num_tiles, triton.cdiv(hidden_size, tiles["BLOCK_N"]))](
        act, data2, scale2, sorted_pairs, tile_experts, weights, out, b2,
        num_pairs, top_k, hidden_size, inter_size,
        act.stride(0), *strides2, weights.stride(0), weights.stride(1), out.stride(0), stride_b2,
        KIND=kind2, BLOCK_M=block_m, BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"], HAS_BIAS=has_b2, **launch,
    )
    return out

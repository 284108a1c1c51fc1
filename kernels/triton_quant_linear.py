"""Weight-only quantized linear layer: y[M, O] = x[M, I] @ W^T (+ bias) for W an int8, int4, fp8 or mxfp4
`QuantizedWeight`.

Twin: `tsterm_kernels.quant.dequantized_linear` (F.linear of float32 x and the dequantized weight). The weight is
read as stored and dequantized in registers, never written out. One K step covers one scale block along the inputs
(32 for int8 / int4 / mxfp4, up to 128 for fp8), so its scale factors out of the step's dot: the dot multiplies x
by the raw codes (int8 codes, int4 nibbles, fp8 values and e2m1 values are exact in bf16 / fp16, so a half-precision
dot loses nothing to the weight), accumulates in float32, and the block's scale multiplies that partial sum per
output column (int4's offset m adds m * sum(x) over the block; mxfp4's E8M0 scale is a power of two, made from its
bits). mxfp4's low nibbles are a block's even inputs and its high nibbles the odd ones: two dots, against x's even
and odd columns. The result is rounded once, to x's dtype, after the bias.

Tile sizes come from `TILES` (x's dtype and rows -> tiles): narrow N tiles for decode (M <= 16) so that a matrix
spreads over many programs, wider M x N tiles for prefill.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:  # `tsterm_kernels.quant` imports this module (lazily): no import back
    from tsterm_kernels.quant import QuantizedWeight

BLOCK, FP8_BLOCK = 32, 128  # quant.BLOCK, quant.FP8_BLOCK: the kernel's 32 and 128 are these formats'
KIND_IDS = {"int8": 0, "int4": 1, "fp8": 2, "mxfp4": 3}
# x's dtype class -> ((most rows of x, tiles), ...): the first entry with room for M rows. BLOCK_K is fp8's K step
# (a divisor of 128); int8 / int4 / mxfp4 always step one block of 32 inputs. float32 dots run on FMA units ("ieee"), whose
# operands live in registers: smaller tiles (checked for sm_90 register spills by compiling every entry).
TILES = {
    "half": (  # bfloat16 / float16: tensor cores
        (16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)),  # decode
        (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)),
        (None, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)),  # prefill
    ),
    "float32": (
        (16, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=3)),
        (None, dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=3)),
    ),
}


@triton.jit
def _e2m1(code):
    """e2m1 codes (0..15) -> their float32 values: sign bit 3; exponent bits 2-1, mantissa bit 0: 0, 0.5 (exponent 0),
    else (1 + m / 2) * 2^(e - 1): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    magnitude = tl.where(e == 0, 0.5 * m, (2.0 + m) * tl.where(e == 1, 0.5, tl.where(e == 2, 1.0, 2.0)))
    return tl.where((c & 8) != 0, -magnitude, magnitude)


@triton.jit
def quant_dot(acc, x_rows, row_valid, w_cols, col_valid, s_cols, stride_scale_col, in_features,
              KIND: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += x @ W^T over all `in_features`, W read as stored and dequantized in registers.

    x_rows [BLOCK_M, 1]: pointers to the rows of x (unit-stride); w_cols [1, BLOCK_N]: to the rows of W's codes /
    values (W^T's columns); s_cols [BLOCK_N]: to each column's first scale (int8 / int4: its row of scales; fp8: the
    row of scales of its 128-row block), scales of later input blocks `stride_scale_col` apart. The dot runs in x's
    dtype. Shared by the quantized linear layer and the fused MoE (tsterm_kernels.triton_fused_moe)."""
    dot_dtype = x_rows.dtype.element_ty
    if KIND == 0:
        # ---- int8: W = code * d, one K step per block of 32 inputs
        ks = tl.arange(0, 32)
        for k0 in range(0, in_features, 32):
            x = tl.load(x_rows + k0 + ks[None, :], mask=row_valid[:, None], other=0.0)  # [BLOCK_M, 32]
            codes = tl.load(w_cols + k0 + ks[:, None], mask=col_valid[None, :], other=0)  # [32, BLOCK_N]
            part = tl.dot(x.to(dot_dtype), codes.to(dot_dtype), input_precision="ieee")
            d = tl.load(s_cols + (k0 // 32) * stride_scale_col, mask=col_valid, other=0.0).to(tl.float32)
            acc += part * d[None, :]
    elif KIND == 1:
        # ---- int4: W = code * d + m; a block's byte j holds input j (low nibble) and input j + 16 (high nibble)
        js = tl.arange(0, 16)
        for k0 in range(0, in_features, 32):
            x_low = tl.load(x_rows + k0 + js[None, :], mask=row_valid[:, None], other=0.0)  # [BLOCK_M, 16]
            x_high = tl.load(x_rows + k0 + 16 + js[None, :], mask=row_valid[:, None], other=0.0)
            packed = tl.load(w_cols + k0 // 2 + js[:, None], mask=col_valid[None, :], other=0)  # [16, BLOCK_N]
            low = (packed & 15).to(dot_dtype)
            high = (packed >> 4).to(dot_dtype)
            part = tl.dot(x_low.to(dot_dtype), low, input_precision="ieee")
            part = tl.dot(x_high.to(dot_dtype), high, part, input_precision="ieee")
            x_sum = tl.sum(x_low.to(tl.float32), axis=1) + tl.sum(x_high.to(tl.float32), axis=1)  # [BLOCK_M]
            d = tl.load(s_cols + (k0 // 32) * stride_scale_col, mask=col_valid, other=0.0).to(tl.float32)
            m = tl.load(s_cols + (k0 // 32) * stride_scale_col + 1, mask=col_valid, other=0.0).to(tl.float32)
            acc += part * d[None, :] + x_sum[:, None] * m[None, :]
    elif KIND == 3:
        # ---- mxfp4: W = e2m1(code) * 2^(scale - 127); a block's byte j holds input 2j (low nibble), 2j + 1 (high)
        js = tl.arange(0, 16)
        for k0 in range(0, in_features, 32):
            x_even = tl.load(x_rows + k0 + 2 * js[None, :], mask=row_valid[:, None], other=0.0)  # [BLOCK_M, 16]
            x_odd = tl.load(x_rows + k0 + 2 * js[None, :] + 1, mask=row_valid[:, None], other=0.0)
            packed = tl.load(w_cols + k0 // 2 + js[:, None], mask=col_valid[None, :], other=0)  # [16, BLOCK_N]
            part = tl.dot(x_even.to(dot_dtype), _e2m1(packed & 15).to(dot_dtype), input_precision="ieee")
            part = tl.dot(x_odd.to(dot_dtype), _e2m1(packed >> 4).to(dot_dtype), part, input_precision="ieee")
            s = tl.load(s_cols + (k0 // 32) * stride_scale_col, mask=col_valid, other=127).to(tl.int32)  # E8M0
            scale = (s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) for 1 <= s <= 254
            scale = tl.where(s == 0, 5.877471754111438e-39, tl.where(s == 255, float("nan"), scale))  # 2^-127
            acc += part * scale[None, :]
    else:
        # ---- fp8: W = value * the scale of its 128 x 128 block; BLOCK_K divides 128, so a K step is in one block
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, in_features, BLOCK_K):
            k_valid = k0 + ks < in_features  # the last block may be partial
            x = tl.load(x_rows + k0 + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            values = tl.load(w_cols + k0 + ks[:, None], mask=k_valid[:, None] & col_valid[None, :], other=0.0)
            part = tl.dot(x.to(dot_dtype), values.to(dot_dtype), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
            s = tl.load(s_cols + (k0 // 128) * stride_scale_col, mask=col_valid, other=0.0)  # [BLOCK_N] float32
            acc += part * s[None, :]
    return acc


@triton.jit
def _quant_linear_kernel(
    # pointers
    x_ptr, data_ptr, scale_ptr, bias_ptr, y_ptr,
    # sizes and strides (x, data and y rows are unit-stride)
    num_rows, out_features, in_features,
    stride_x_row, stride_data_row, stride_scale_row, stride_scale_col, stride_y_row,
    # meta-parameters
    KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features (rows of W)
    row_valid = rows < num_rows
    col_valid = cols < out_features
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x_row  # [BLOCK_M, 1]
    w_cols = data_ptr + cols[None, :].to(tl.int64) * stride_data_row  # [1, BLOCK_N]: W^T's columns
    if KIND == 2:  # fp8: one row of scales per 128 rows of W
        s_cols = scale_ptr + (cols // 128).to(tl.int64) * stride_scale_row  # [BLOCK_N]
    else:
        s_cols = scale_ptr + cols.to(tl.int64) * stride_scale_row
    acc = quant_dot(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), x_rows, row_valid, w_cols, col_valid, s_cols,
                    stride_scale_col, in_features, KIND, BLOCK_K)

    # ---- bias, one rounding to the output dtype
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y_row + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def tile_config(num_rows: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes for `num_rows` rows of x of `dtype`."""
    table = TILES["float32" if dtype == torch.float32 else "half"]
    return next(tiles for most, tiles in table if most is None or num_rows <= most)


def quant_linear(x: torch.Tensor, weight: "QuantizedWeight", bias: torch.Tensor | None = None,
                       tiles: dict[str, int] | None = None) -> torch.Tensor:
    """x [M, I] @ W^T (+ bias) -> [M, O] in x's dtype. `tiles`: override `tile_config` (tests)."""
    assert weight.kind in KIND_IDS, f"the Triton kernel reads int8, int4, fp8 and mxfp4 weights, not {weight.kind}"
    assert len(weight.dims) == 2, f"one [O, I] weight (index a stack of experts first), got {weight.dims}"
    out_features, in_features = weight.dims
    assert x.dim() == 2 and x.shape[1] == in_features and x.stride(1) == 1, \
        f"x must be [M, {in_features}] with unit last stride, got {tuple(x.shape)} {x.stride()}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    data, scale = weight.data, weight.scale
    assert data.stride(-1) == 1 and data.device == scale.device == x.device, \
        f"weight rows must be unit-stride and on x's device ({x.device}), got {data.stride()} on {data.device}"
    if weight.kind == "fp8":
        assert scale.dtype == torch.float32 and scale.shape == (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
    elif weight.kind == "mxfp4":
        assert in_features % BLOCK == 0 and scale.dtype == torch.uint8 and scale.shape == (out_features, in_features // BLOCK)
    else:
        assert in_features % BLOCK == 0 and scale.dtype == torch.float16 and scale.shape[:2] == (out_features, in_features // BLOCK)
        assert weight.kind == "int8" or scale.stride(2) == 1, f"int4 (d, m) pairs must be adjacent, got {scale.stride()}"
    if bias is not None:
        assert bias.shape == (out_features,) and bias.stride(0) == 1 and bias.device == x.device, \
            f"bias must be [{out_features}] unit-stride on {x.device}, got {tuple(bias.shape)} {bias.stride()}"
    num_rows = x.shape[0]
    y = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    tiles = dict(tile_config(num_rows, x.dtype) if tiles is None else tiles)
    assert FP8_BLOCK % tiles["BLOCK_K"] == 0, f"BLOCK_K must divide {FP8_BLOCK}, got {tiles['BLOCK_K']}"
    grid = (triton.cdiv(num_rows, tiles["BLOCK_M"]), triton.cdiv(out_features, tiles["BLOCK_N"]))
    _quant_linear_kernel[grid](
        x, data, scale, y if bias is None else bias, y,
        num_rows, out_features, in_features,
        x.stride(0), data.stride(0), scale.stride(0), scale.stride(1), y.stride(0),
        KIND=KIND_IDS[weight.kind], HAS_BIAS=bias is not None,
        BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"],
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
    )
    return y

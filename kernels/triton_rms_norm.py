"""RMSNorm fused with the residual add: one read of x (+ residual), one write of each output.

Twin: `tsterm_kernels.torch_ops.rms_norm`. Rounding follows the twin: the residual sum and the normalised row
are rounded to the storage dtype before they are used, so only the reductions differ in order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    # sizes and strides (the last dimension is unit-stride)
    num_rows, hidden_size, eps,
    stride_x_row, stride_residual_row, stride_out_row, stride_residual_out_row,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = (rows[:, None] < num_rows) & (cols[None, :] < hidden_size)  # [BLOCK_T, BLOCK_H]
    rows = rows.to(tl.int64)

    # ---- load, add the residual (rounded to the storage dtype, as the twin adds in that dtype)
    x = tl.load(x_ptr + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + rows[:, None] * stride_residual_row + cols[None, :],
                           mask=mask, other=0.0).to(tl.float32)
        x = (x + residual).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + rows[:, None] * stride_residual_out_row + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)

    # ---- normalise in float32, round, scale by the weight
    mean_square = tl.sum(x * x, axis=1) / hidden_size  # [BLOCK_T]
    normed = (x * tl.rsqrt(mean_square + eps)[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < hidden_size, other=0.0).to(tl.float32)  # [BLOCK_H]
    tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :], weight[None, :] * normed, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, H] with unit last stride, got {tuple(x.shape)} {x.stride()}"
    num_rows, hidden_size = x.shape
    assert weight.shape == (hidden_size,) and weight.is_contiguous(), f"weight must be [{hidden_size}] contiguous"
    assert weight.dtype == x.dtype, f"weight dtype {weight.dtype} != x dtype {x.dtype}"
    assert weight.device == x.device
    out = torch.empty((num_rows, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1, "residual must be [T, H] with unit last stride"
        assert residual.dtype == x.dtype and residual.device == x.device
        residual_out = torch.empty_like(out)
    if num_rows == 0:
        return out, residual_out
    block_h = triton.next_power_of_2(hidden_size)
    block_t = max(1, min(16, 4096 // block_h))  # several short rows (per-head q/k norms) per program
    _rms_norm_kernel[(triton.cdiv(num_rows, block_t),)](
        x, residual if residual is not None else x, weight, out, residual_out if residual_out is not None else out,
        num_rows, hidden_size, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        residual_out.stride(0) if residual_out is not None else 0,
        HAS_RESIDUAL=residual is not None, BLOCK_T=block_t, BLOCK_H=block_h,
        num_warps=4 if block_h <= 4096 else 8,
    )
    return out, residual_out

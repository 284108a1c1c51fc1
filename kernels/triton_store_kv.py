"""KV store: each new token's K and V rows go straight into their slots of the paged pool.

Twin: `tsterm_kernels.torch_ops.store_kv`. A negative slot (a padding token) is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    # pointers
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    # sizes and strides (head_dim is unit-stride everywhere)
    num_kv_heads, head_dim,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_k_cache_slot, stride_k_cache_head, stride_v_cache_slot, stride_v_cache_head,
    # meta-parameters
    BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]

    # ---- where this token goes
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim) & (slot >= 0)  # [BLOCK_HEADS, BLOCK_D]

    # ---- copy K and V rows (no arithmetic: values keep their bits)
    k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + slot * stride_k_cache_slot + heads[:, None] * stride_k_cache_head + dims[None, :],
             k, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + slot * stride_v_cache_slot + heads[:, None] * stride_v_cache_head + dims[None, :],
             v, mask=mask)


def _check_cache(cache: torch.Tensor, name: str) -> None:
    assert cache.dim() == 4, f"{name} must be [num_blocks, block_size, Hkv, D], got {tuple(cache.shape)}"
    assert cache.stride(3) == 1 and cache.stride(0) == cache.shape[1] * cache.stride(1), \
        f"{name} needs unit head_dim stride and slots laid out block after block, got strides {cache.stride()}"


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    _check_cache(k_cache, "k_cache")
    _check_cache(v_cache, "v_cache")
    num_tokens = k.shape[0]
    num_kv_heads, head_dim = k_cache.shape[2:]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and v.shape == k.shape, \
        f"k, v must be [T, {num_kv_heads}, {head_dim}], got {tuple(k.shape)} and {tuple(v.shape)}"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k, v need unit head_dim stride"
    assert v_cache.shape == k_cache.shape
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, \
        f"dtypes differ: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype}"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert k.device == k_cache.device == slot_mapping.device
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        num_kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=2,
    )

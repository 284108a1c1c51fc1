"""Gated DeltaNet decode: the causal conv's one-token update and one step of the gated delta rule, for every
sequence of a step at once, each reading and writing its state in its slot of the pool (in place).

Twins: `tsterm_kernels.reference_gated_delta.causal_conv1d_update` and `.recurrent_gated_delta_rule` (the math and
the shapes are documented there). The chunked prefill form has no kernel yet: prompts run the torch twin on the
device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(
    # pointers
    x_ptr, weight_ptr, states_ptr, slots_ptr, out_ptr,
    # sizes and strides (the channel dimension of x, out and weight rows is unit-stride)
    channels, stride_x, stride_out, stride_state_slot, stride_state_channel,
    # meta-parameters
    KERNEL: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask = cols < channels
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state = states_ptr + slot * stride_state_slot + cols.to(tl.int64) * stride_state_channel  # [BLOCK_C] pointers

    # ---- the window: K-1 stored inputs, then the new one; the stored ones shift left by one
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in tl.static_range(KERNEL - 1):
        past = tl.load(state + j, mask=mask, other=0.0).to(tl.float32)
        acc += past * tl.load(weight_ptr + cols * KERNEL + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(state + (j - 1), past, mask=mask)
    x = tl.load(x_ptr + seq * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    acc += x * tl.load(weight_ptr + cols * KERNEL + (KERNEL - 1), mask=mask, other=0.0).to(tl.float32)
    if KERNEL > 1:
        tl.store(state + (KERNEL - 2), x, mask=mask)

    # ---- SiLU
    tl.store(out_ptr + seq * stride_out + cols, acc / (1.0 + tl.exp(-acc)), mask=mask)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [S, C] with unit last stride, got {tuple(x.shape)}"
    num_seqs, channels = x.shape
    assert weight.dim() == 2 and weight.shape[0] == channels and weight.is_contiguous(), \
        f"weight must be [{channels}, K] contiguous, got {tuple(weight.shape)}"
    kernel = weight.shape[1]
    assert conv_states.dim() == 3 and conv_states.shape[1:] == (channels, kernel - 1) and conv_states.stride(2) == 1, \
        f"conv_states must be [slots, {channels}, {kernel - 1}], got {tuple(conv_states.shape)}"
    assert slots.shape == (num_seqs,) and not slots.is_floating_point(), "slots must be [S] integers"
    assert x.device == weight.device == conv_states.device == slots.device
    out = torch.empty((num_seqs, channels), dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    block_c = min(256, triton.next_power_of_2(channels))
    _conv_update_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, weight, conv_states, slots, out,
        channels, x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1),
        KERNEL=kernel, BLOCK_C=block_c,
    )
    return out


@triton.jit
def _recurrent_step_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, out_ptr,
    # sizes and strides (head dims are unit-stride; each slot of the pool is a contiguous [Hv, dk, dv])
    num_v_heads, group, k_dim, v_dim, scale,
    stride_q_seq, stride_q_head, stride_k_seq, stride_k_head, stride_v_seq, stride_v_head, stride_g_seq,
    stride_beta_seq, stride_state_slot,
    # meta-parameters
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq_head = tl.program_id(0)
    seq, head = seq_head // num_v_heads, seq_head % num_v_heads
    key_head = head // group
    rows = tl.arange(0, BLOCK_K)  # [BLOCK_K] key dims
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] value dims
    row_mask, col_mask = rows < k_dim, cols < v_dim
    slot = tl.load(slots_ptr + seq).to(tl.int64)

    # ---- q and k of this head's key head, L2-normalised
    q = tl.load(q_ptr + seq * stride_q_seq + key_head * stride_q_head + rows, mask=row_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * stride_k_seq + key_head * stride_k_head + rows, mask=row_mask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + seq * stride_v_seq + head * stride_v_head + cols, mask=col_mask, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + seq * stride_g_seq + head).to(tl.float32))
    beta = tl.load(beta_ptr + seq * stride_beta_seq + head).to(tl.float32)

    # ---- decay, the delta write, the read-out; the state tile is read from its slot and written back there
    state = states_ptr + slot * stride_state_slot + head * k_dim * v_dim + rows[:, None] * v_dim + cols[None, :]
    tile_mask = row_mask[:, None] & col_mask[None, :]
    s = tl.load(state, mask=tile_mask, other=0.0) * decay  # [BLOCK_K, BLOCK_V]
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_V]
    s += k[:, None] * delta[None, :]
    tl.store(state, s, mask=tile_mask)
    tl.store(out_ptr + seq_head.to(tl.int64) * v_dim + cols, tl.sum(s * q[:, None], axis=0), mask=col_mask)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    assert q.dim() == 3 and q.shape == k.shape and q.stride(2) == 1 and k.stride(2) == 1, \
        f"q, k must be [S, Hk, dk] with unit last stride, got {tuple(q.shape)}, {tuple(k.shape)}"
    num_seqs, num_k_heads, k_dim = q.shape
    assert v.dim() == 3 and v.shape[0] == num_seqs and v.stride(2) == 1, f"v must be [S, Hv, dv], got {tuple(v.shape)}"
    num_v_heads, v_dim = v.shape[1:]
    assert num_v_heads % num_k_heads == 0, f"{num_v_heads} value heads for {num_k_heads} key heads"
    assert g.shape == beta.shape == (num_seqs, num_v_heads) and g.stride(1) == 1 and beta.stride(1) == 1, \
        f"g, beta must be [{num_seqs}, {num_v_heads}]"
    _check_states(states, num_v_heads, k_dim, v_dim)
    assert slots.shape == (num_seqs,) and not slots.is_floating_point(), "slots must be [S] integers"
    assert q.device == k.device == v.device == g.device == beta.device == states.device == slots.device
    out = torch.empty((num_seqs, num_v_heads, v_dim), dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out
    block_k = triton.next_power_of_2(k_dim)
    block_v = min(triton.next_power_of_2(v_dim), max(16, 8192 // block_k))  # a [dk, BLOCK_V] tile per program
    _recurrent_step_kernel[(num_seqs * num_v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, states, slots, out,
        num_v_heads, num_v_heads // num_k_heads, k_dim, v_dim, k_dim ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        states.stride(0),
        BLOCK_K=block_k, BLOCK_V=block_v,
    )
    return out


def _check_states(states: torch.Tensor, num_v_heads: int, k_dim: int, v_dim: int) -> None:
    assert states.dim() == 4 and states.shape[1:] == (num_v_heads, k_dim, v_dim) and states.dtype == torch.float32, \
        f"states must be a float32 pool [slots, {num_v_heads}, {k_dim}, {v_dim}], got {tuple(states.shape)}"
    assert states.stride()[1:] == (k_dim * v_dim, v_dim, 1), "each slot of the state pool must be contiguous"

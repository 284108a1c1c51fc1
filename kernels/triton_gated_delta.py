"""Gated DeltaNet kernels, each sequence reading and writing its state in its slot of the pool (in place).

Decode: the causal conv's one-token update and one step of the gated delta rule, for every sequence of a step at
once. Prefill: the prompt rows of every sequence of a step in one launch each, the conv and then the chunked rule
(`bounds [N, 2]`: each sequence's rows). The chunked kernel runs one program per (sequence, value head, block of
value dims), which walks its sequence 64 tokens at a time with the state tile in registers: per chunk a few
matmuls (`tl.dot`, float32-accurate tf32x3) and the within-chunk unit lower-triangular system solved by forward
substitution, row by row (stable where it is close to singular, e.g. a repeated token; a product of powers of A
is not).

The decode kernels may write each new state into another slot than the one they read (`out_slots`; a
speculative verify step keeps each position's state in a slot of its own): a program loads its tile from the source
slot and stores it into the target slot, the arithmetic unchanged.

Twins: the functions of the same names in `tsterm_kernels.torch_gated_delta` (the math and the shapes are
documented there).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The chunked kernel's matmuls: float32-accurate from three tf32 tensor-core products ("ieee" runs them on the FMA
# units, which needs every operand row in registers: it spilled 52 KB per thread at dk = 128 in sm90_compile.py)
DOT_PRECISION = "tf32x3"


@triton.jit
def _conv_update_kernel(
    # pointers
    x_ptr, weight_ptr, states_ptr, slots_ptr, out_slots_ptr, out_ptr,
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
    # where the shifted window goes: the same slot, or another (its own program's columns only: no race)
    target = states_ptr + tl.load(out_slots_ptr + seq).to(tl.int64) * stride_state_slot + \
        cols.to(tl.int64) * stride_state_channel

    # ---- the window: K-1 stored inputs, then the new one; the stored ones shift left by one
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for j in tl.static_range(KERNEL - 1):
        past = tl.load(state + j, mask=mask, other=0.0).to(tl.float32)
        acc += past * tl.load(weight_ptr + cols * KERNEL + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(target + (j - 1), past, mask=mask)
    x = tl.load(x_ptr + seq * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    acc += x * tl.load(weight_ptr + cols * KERNEL + (KERNEL - 1), mask=mask, other=0.0).to(tl.float32)
    if KERNEL > 1:
        tl.store(target + (KERNEL - 2), x, mask=mask)

    # ---- SiLU
    tl.store(out_ptr + seq * stride_out + cols, acc / (1.0 + tl.exp(-acc)), mask=mask)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor, out_slots: torch.Tensor | None = None) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [S, C] with unit last stride, got {tuple(x.shape)}"
    num_seqs, channels = x.shape
    assert weight.dim() == 2 and weight.shape[0] == channels and weight.is_contiguous(), \
        f"weight must be [{channels}, K] contiguous, got {tuple(weight.shape)}"
    kernel = weight.shape[1]
    assert conv_states.dim() == 3 and conv_states.shape[1:] == (channels, kernel - 1) and conv_states.stride(2) == 1, \
        f"conv_states must be [slots, {channels}, {kernel - 1}], got {tuple(conv_states.shape)}"
    out_slots = _check_slots(slots, out_slots, num_seqs)
    assert x.device == weight.device == conv_states.device == slots.device
    out = torch.empty((num_seqs, channels), dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    block_c = min(256, triton.next_power_of_2(channels))
    _conv_update_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, weight, conv_states, slots, out_slots, out,
        channels, x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1),
        KERNEL=kernel, BLOCK_C=block_c,
    )
    return out


@triton.jit
def _recurrent_step_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, out_slots_ptr, out_ptr,
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
    out_slot = tl.load(out_slots_ptr + seq).to(tl.int64)  # where the new state goes (slot: in place)

    # ---- q and k of this head's key head, L2-normalised
    q = tl.load(q_ptr + seq * stride_q_seq + key_head * stride_q_head + rows, mask=row_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * stride_k_seq + key_head * stride_k_head + rows, mask=row_mask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + seq * stride_v_seq + head * stride_v_head + cols, mask=col_mask, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + seq * stride_g_seq + head).to(tl.float32))
    beta = tl.load(beta_ptr + seq * stride_beta_seq + head).to(tl.float32)

    # ---- decay, the delta write, the read-out; the state tile is read from its slot and written to its target
    tile = head * k_dim * v_dim + rows[:, None] * v_dim + cols[None, :]
    tile_mask = row_mask[:, None] & col_mask[None, :]
    s = tl.load(states_ptr + slot * stride_state_slot + tile, mask=tile_mask, other=0.0) * decay  # [BLOCK_K, BLOCK_V]
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_V]
    s += k[:, None] * delta[None, :]
    tl.store(states_ptr + out_slot * stride_state_slot + tile, s, mask=tile_mask)
    tl.store(out_ptr + seq_head.to(tl.int64) * v_dim + cols, tl.sum(s * q[:, None], axis=0), mask=col_mask)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               states: torch.Tensor, slots: torch.Tensor,
                               out_slots: torch.Tensor | None = None) -> torch.Tensor:
    assert q.dim() == 3 and q.shape == k.shape and q.stride(2) == 1 and k.stride(2) == 1, \
        f"q, k must be [S, Hk, dk] with unit last stride, got {tuple(q.shape)}, {tuple(k.shape)}"
    num_seqs, num_k_heads, k_dim = q.shape
    assert v.dim() == 3 and v.shape[0] == num_seqs and v.stride(2) == 1, f"v must be [S, Hv, dv], got {tuple(v.shape)}"
    num_v_heads, v_dim = v.shape[1:]
    assert num_v_heads % num_k_heads == 0, f"{num_v_heads} value heads for {num_k_heads} key heads"
    assert g.shape == beta.shape == (num_seqs, num_v_heads) and g.stride(1) == 1 and beta.stride(1) == 1, \
        f"g, beta must be [{num_seqs}, {num_v_heads}]"
    _check_states(states, num_v_heads, k_dim, v_dim)
    out_slots = _check_slots(slots, out_slots, num_seqs)
    assert q.device == k.device == v.device == g.device == beta.device == states.device == slots.device
    out = torch.empty((num_seqs, num_v_heads, v_dim), dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out
    block_k = triton.next_power_of_2(k_dim)
    block_v = min(triton.next_power_of_2(v_dim), max(16, 8192 // block_k))  # a [dk, BLOCK_V] tile per program
    _recurrent_step_kernel[(num_seqs * num_v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, states, slots, out_slots, out,
        num_v_heads, num_v_heads // num_k_heads, k_dim, v_dim, k_dim ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        states.stride(0),
        BLOCK_K=block_k, BLOCK_V=block_v,
    )
    return out


def _check_slots(slots: torch.Tensor, out_slots: torch.Tensor | None, num_seqs: int) -> torch.Tensor:
    """The target slots of a decode op (the source slots themselves when None), checked: [S] integers each."""
    assert slots.shape == (num_seqs,) and not slots.is_floating_point(), "slots must be [S] integers"
    if out_slots is None:
        return slots
    assert out_slots.shape == (num_seqs,) and not out_slots.is_floating_point() and out_slots.device == slots.device, \
        "out_slots must be [S] integers, on the slots' device"
    return out_slots


def _check_states(states: torch.Tensor, num_v_heads: int, k_dim: int, v_dim: int) -> None:
    assert states.dim() == 4 and states.shape[1:] == (num_v_heads, k_dim, v_dim) and states.dtype == torch.float32, \
        f"states must be a float32 pool [slots, {num_v_heads}, {k_dim}, {v_dim}], got {tuple(states.shape)}"
    assert states.stride()[1:] == (k_dim * v_dim, v_dim, 1), "each slot of the state pool must be contiguous"


# ---------------------------------------------------------------------------------------------------------------
# prefill: the prompt rows of every sequence of a step in one launch each (the conv, then the chunked rule)


@triton.jit
def _conv_input(x_ptr, states_ptr, positions, cols, start, end, stride_x, stride_state_channel, mask,
                KERNEL: tl.constexpr):
    """The conv's input at step rows `positions` (any shape, broadcast against `cols`): x's row where it is one of
    the sequence's rows [start, end), else the stored input K-1 + (position - start) (positions before start)."""
    from_x = mask & (positions >= start) & (positions < end)
    from_state = mask & (positions < start)
    past = tl.load(x_ptr + positions.to(tl.int64) * stride_x + cols, mask=from_x, other=0.0).to(tl.float32)
    stored = tl.load(states_ptr + cols.to(tl.int64) * stride_state_channel + (KERNEL - 1 + positions - start),
                     mask=from_state, other=0.0).to(tl.float32)
    return past + stored


@triton.jit
def _conv_prefill_kernel(
    # pointers
    x_ptr, weight_ptr, states_ptr, slots_ptr, bounds_ptr, out_ptr,
    # sizes and strides (the channel dimension of x, out and weight rows is unit-stride)
    channels, stride_x, stride_out, stride_state_slot, stride_state_channel,
    # meta-parameters
    KERNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_PAST: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    col_mask = cols < channels
    start, end = tl.load(bounds_ptr + 2 * seq), tl.load(bounds_ptr + 2 * seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state = states_ptr + slot * stride_state_slot  # this sequence's [C, K-1]

    # ---- the outputs, a block of rows at a time: row t reads the inputs t-K+1 .. t
    for block in range(start, end, BLOCK_T):
        rows = block + tl.arange(0, BLOCK_T)  # [BLOCK_T]
        mask = (rows < end)[:, None] & col_mask[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(KERNEL):
            w = tl.load(weight_ptr + cols * KERNEL + j, mask=col_mask, other=0.0).to(tl.float32)
            acc += w[None, :] * _conv_input(x_ptr, state, (rows - (KERNEL - 1) + j)[:, None], cols[None, :], start, end,
                                            stride_x, stride_state_channel, mask, KERNEL)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], acc / (1.0 + tl.exp(-acc)),
                 mask=mask)

    # ---- the new state: the last K-1 inputs (stored ones among them when the rows are fewer than K-1)
    past = tl.arange(0, BLOCK_PAST)  # [BLOCK_PAST]
    mask = (past < KERNEL - 1)[:, None] & col_mask[None, :]
    last = _conv_input(x_ptr, state, (end - (KERNEL - 1) + past)[:, None], cols[None, :], start, end, stride_x,
                       stride_state_channel, mask, KERNEL)  # [BLOCK_PAST, BLOCK_C]
    tl.debug_barrier()  # every read of the old state is done before it is overwritten
    tl.store(state + cols.to(tl.int64)[None, :] * stride_state_channel + past[:, None], last, mask=mask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                  bounds: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [T, C] with unit last stride, got {tuple(x.shape)}"
    channels = x.shape[1]
    assert weight.dim() == 2 and weight.shape[0] == channels and weight.is_contiguous(), \
        f"weight must be [{channels}, K] contiguous, got {tuple(weight.shape)}"
    kernel = weight.shape[1]
    assert conv_states.dim() == 3 and conv_states.shape[1:] == (channels, kernel - 1) and conv_states.stride(2) == 1, \
        f"conv_states must be [slots, {channels}, {kernel - 1}], got {tuple(conv_states.shape)}"
    num_seqs = _check_rows(slots, bounds)
    assert out.shape == x.shape and out.stride(1) == 1, f"out must be [T, C] like x, got {tuple(out.shape)}"
    assert x.device == weight.device == conv_states.device == slots.device == bounds.device == out.device
    if num_seqs == 0:
        return out
    block_c = min(128, triton.next_power_of_2(channels))
    _conv_prefill_kernel[(num_seqs, triton.cdiv(channels, block_c))](
        x, weight, conv_states, slots, bounds, out,
        channels, x.stride(0), out.stride(0), conv_states.stride(0), conv_states.stride(1),
        KERNEL=kernel, BLOCK_T=16, BLOCK_C=block_c, BLOCK_PAST=max(2, triton.next_power_of_2(kernel - 1)),
    )
    return out


@triton.jit
def _chunk_prefill_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, bounds_ptr, out_ptr,
    # sizes and strides (head dims are unit-stride; each slot of the pool is a contiguous [Hv, dk, dv])
    num_v_heads, group, k_dim, v_dim, scale,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head, stride_g_row,
    stride_beta_row, stride_state_slot, stride_out_row, stride_out_head,
    # meta-parameters
    CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    seq_head = tl.program_id(0)
    seq, head = seq_head // num_v_heads, seq_head % num_v_heads
    key_head = head // group
    dims = tl.arange(0, BLOCK_K)  # [BLOCK_K] key dims
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] value dims
    dim_mask, col_mask = dims < k_dim, cols < v_dim
    start, end = tl.load(bounds_ptr + 2 * seq), tl.load(bounds_ptr + 2 * seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    t = tl.arange(0, CHUNK)  # [C] a token's place in its chunk
    causal, earlier = t[:, None] >= t[None, :], t[:, None] > t[None, :]  # [C, C]: j <= i, j < i

    # ---- the state tile [BLOCK_K, BLOCK_V], from the slot; carried in registers from chunk to chunk
    state = states_ptr + slot * stride_state_slot + head * k_dim * v_dim + dims[:, None] * v_dim + cols[None, :]
    state_mask = dim_mask[:, None] & col_mask[None, :]
    s = tl.load(state, mask=state_mask, other=0.0)

    for chunk in range(start, end, CHUNK):
        rows = chunk + t  # [C]
        row_mask = rows < end  # past the end: zeros, g = 0 (no decay), beta = 0 (no write)
        rows64 = rows.to(tl.int64)
        qk_mask = row_mask[:, None] & dim_mask[None, :]
        g = tl.load(g_ptr + rows64 * stride_g_row + head, mask=row_mask, other=0.0).to(tl.float32)  # [C]
        beta = tl.load(beta_ptr + rows64 * stride_beta_row + head, mask=row_mask, other=0.0).to(tl.float32)  # [C]

        # ---- decays within the chunk: G_i = g_1 + ... + g_i; exp(G_i - G_j) for j <= i (masked before the exp)
        G = tl.cumsum(g, axis=0)  # [C]
        decay = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)  # [C, C]
        G_end = tl.sum(g, axis=0)

        # ---- everything that needs k, then q, before the solve; k is reloaded after it (fewer live registers)
        k = tl.load(k_ptr + rows64[:, None] * stride_k_row + key_head * stride_k_head + dims[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)  # [C, BLOCK_K]
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
        # A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i)
        A = tl.where(earlier, tl.dot(k, tl.trans(k), input_precision=PRECISION) * decay * beta[:, None], 0.0)
        # what each token writes, before the solve: beta V - beta exp(G) K S0
        v = tl.load(v_ptr + rows64[:, None] * stride_v_row + head * stride_v_head + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)  # [C, BLOCK_V]
        rhs = v * beta[:, None] - tl.dot(k * (beta * tl.exp(G))[:, None], s, input_precision=PRECISION)
        q = tl.load(q_ptr + rows64[:, None] * stride_q_row + key_head * stride_q_head + dims[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)  # [C, BLOCK_K]
        q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * scale)[:, None]
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay  # [C, C]: exp(G_i - G_j) q_i.k_j, j <= i
        o = tl.dot(q * tl.exp(G)[:, None], s, input_precision=PRECISION)  # [C, BLOCK_V]: what S0 gives o_i

        # ---- U = (I + A)^-1 rhs by forward substitution, row by row: u_i = rhs_i - sum_{j<i} A_ij u_j (rows j < i
        # are final); stable where I + A is close to singular (a repeated token), unlike a product of powers of A
        u = rhs  # [C, BLOCK_V]
        for i in range(1, CHUNK):
            a = tl.sum(tl.where(t[:, None] == i, A, 0.0), axis=0)  # [C]: row i of A
            u = tl.where(t[:, None] == i, u - tl.sum(a[:, None] * u, axis=0)[None, :], u)

        # ---- outputs: o_i = exp(G_i) q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j
        o += tl.dot(scores, u, input_precision=PRECISION)
        tl.store(out_ptr + rows64[:, None] * stride_out_row + head * stride_out_head + cols[None, :], o,
                 mask=row_mask[:, None] & col_mask[None, :])

        # ---- the state at the chunk's end: S = exp(G_end) S0 + sum_j exp(G_end - G_j) k_j u_j^T
        k = tl.load(k_ptr + rows64[:, None] * stride_k_row + key_head * stride_k_head + dims[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)  # [C, BLOCK_K]
        k = k * (tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6) * tl.exp(G_end - G))[:, None]  # decayed to the chunk's end
        s = s * tl.exp(G_end) + tl.dot(tl.trans(k), u, input_precision=PRECISION)

    tl.store(state, s, mask=state_mask)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           states: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor, out: torch.Tensor,
                           chunk_size: int = 64) -> torch.Tensor:
    assert q.dim() == 3 and q.shape == k.shape and q.stride(2) == 1 and k.stride(2) == 1, \
        f"q, k must be [T, Hk, dk] with unit last stride, got {tuple(q.shape)}, {tuple(k.shape)}"
    num_rows, num_k_heads, k_dim = q.shape
    assert v.dim() == 3 and v.shape[0] == num_rows and v.stride(2) == 1, f"v must be [T, Hv, dv], got {tuple(v.shape)}"
    num_v_heads, v_dim = v.shape[1:]
    assert num_v_heads % num_k_heads == 0, f"{num_v_heads} value heads for {num_k_heads} key heads"
    assert g.shape == beta.shape == (num_rows, num_v_heads) and g.stride(1) == 1 and beta.stride(1) == 1, \
        f"g, beta must be [{num_rows}, {num_v_heads}]"
    _check_states(states, num_v_heads, k_dim, v_dim)
    num_seqs = _check_rows(slots, bounds)
    assert out.shape == v.shape and out.dtype == torch.float32 and out.stride(2) == 1, \
        f"out must be float32 [T, Hv, dv], got {tuple(out.shape)} {out.dtype}"
    assert chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0, f"chunk_size {chunk_size}: a power of 2, >= 16"
    assert q.device == k.device == v.device == g.device == beta.device == states.device == slots.device == out.device
    if num_seqs == 0:
        return out
    block_k = max(16, triton.next_power_of_2(k_dim))
    block_v = max(16, min(triton.next_power_of_2(v_dim), 4096 // block_k))  # a [dk, BLOCK_V] state tile
    _chunk_prefill_kernel[(num_seqs * num_v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, states, slots, bounds, out,
        num_v_heads, num_v_heads // num_k_heads, k_dim, v_dim, k_dim ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        states.stride(0), out.stride(0), out.stride(1),
        CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=DOT_PRECISION, num_warps=8,
    )
    return out


def _check_rows(slots: torch.Tensor, bounds: torch.Tensor) -> int:
    num_seqs = slots.shape[0]
    assert slots.shape == (num_seqs,) and not slots.is_floating_point(), "slots must be [N] integers"
    assert bounds.shape == (num_seqs, 2) and bounds.is_contiguous() and not bounds.is_floating_point(), \
        f"bounds must be [{num_seqs}, 2] contiguous integers (each sequence's rows), got {tuple(bounds.shape)}"
    return num_seqs

"""Float64 oracles of what each of tsterm's ops computes, written from the maths, for the tests only.

The production ops come in three implementations: `tsterm_kernels.torch_ops` (the CPU path: torch, and tsterm's C
kernels for float32 CPU work), the C kernels themselves (csrc/) and the Triton kernels. All three are checked against
these functions, never against one another's code: an oracle is plain torch in float64, one sequence / token / pair
at a time where that is the plainer form, with no fast path, no in-place pool update and no import of tsterm_kernels
or tsterm (tests/kernels/test_oracles.py checks that, and that nothing in production imports this module).

Conventions: inputs are the ops' own (shapes in each docstring); results are new float64 tensors (a caller casts
them to the dtype it compares in); an op that updates a pool in place in production returns the updated pool here
instead, as a float64 copy, and leaves its arguments alone. Everything runs on the inputs' device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

F64 = torch.float64
QUANT_BLOCK = 32  # int8 / int4: inputs per block (GGUF Q8_0 / Q4_1)
FP8_BLOCK = 128  # fp8: a scale per 128 x 128 block


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, I] @ weight [O, I].T (+ bias [O]) -> [M, O]."""
    y = x.to(F64) @ weight.to(F64).t()
    return y if bias is None else y + bias.to(F64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed [T, H] float64, new residual [T, H] in x's dtype or None).

    With a residual, the sum x + residual is what the layer passes on, rounded once to x's dtype (float64 holds the
    exact sum of two values of any narrower float type, so this is the correctly rounded sum); the norm is of that
    rounded sum, as the next layer sees it."""
    new_residual = None
    if residual is not None:
        new_residual = (x.to(F64) + residual.to(F64)).to(x.dtype)
        x = new_residual
    xd = x.to(F64)
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.to(F64), new_residual


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pools [num_blocks, B, Hkv, D] after token t's k[t], v[t] [Hkv, D] went to slot slot_mapping[t] (block
    slot // B, row slot % B); a negative slot writes nothing. Returns new (k_cache, v_cache) in the pools' dtype."""
    k_out, v_out = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_out[slot // block_size, slot % block_size] = k[t]
            v_out[slot // block_size, slot % block_size] = v[t]
    return k_out, v_out


def gather_context(cache: torch.Tensor, table: list[int], seq_len: int) -> torch.Tensor:
    """A sequence's first seq_len positions of a pool [num_blocks, B, Hkv, D], through its block table: [n, Hkv, D]."""
    blocks = torch.tensor(table[:-(-seq_len // cache.shape[1])], device=cache.device)
    return cache[blocks].flatten(0, 1)[:seq_len]  # [n, Hkv, D]: the blocks in table order, a copy


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence: q [nq, Hq, D], its last nq positions, over k, v [n, Hkv, D] (its whole
    context; query head h reads KV head h // (Hq / Hkv)). Query j sits at position n - nq + j and sees positions
    0..n - nq + j. -> [nq, Hq, D]."""
    num_q, num_heads, _ = q.shape
    n, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.to(F64).repeat_interleave(group, 1)
    v = v.to(F64).repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.to(F64), k) * scale  # [Hq, nq, n]
    q_pos = torch.arange(n - num_q, n, device=q.device)
    scores = scores.masked_fill(torch.arange(n, device=q.device)[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """`paged_attention`'s contract: q [T, Hq, D] holds each sequence's new tokens (meta.query_start_loc), whose
    contexts of meta.seq_lens positions lie in the pools [num_blocks, B, Hkv, D] through meta.block_tables. Each
    sequence's context is gathered densely and attended causally. -> [T, Hq, D]."""
    out = torch.empty(q.shape, dtype=F64, device=q.device)
    tables = meta.block_tables.tolist()
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        k = gather_context(k_cache, tables[i], seq_len)
        v = gather_context(v_cache, tables[i], seq_len)
        out[start:end] = attention(q[start:end], k, v, scale)
    return out


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, the top_k largest probabilities in descending order, renormalised to sum to 1 when
    asked. router_logits [T, E] -> (weights [T, k] float64, expert ids [T, k] int64). Ties are the caller's to avoid."""
    probs = torch.softmax(router_logits.to(F64), dim=-1)
    order = torch.argsort(probs, dim=-1, descending=True, stable=True)[:, :top_k]
    weights = probs.gather(1, order)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, order


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: x [n, H], w13 [2I, H] (gate rows then up rows), w2 [H, I] -> [n, H]."""
    h = x.to(F64) @ w13.to(F64).t()
    inter = w2.shape[1]
    return (F.silu(h[:, :inter]) * h[:, inter:]) @ w2.to(F64).t()


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              expert_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out + sum_k weights[:, k] * expert_{ids[:, k]}(x): x [T, H]; w13 [E, 2I, H]; w2 [E, H, I] (float stacks:
    dequantize first); weights, expert_ids [T, k]; out [T, H]. An id >= E names another rank's expert: it adds
    nothing. -> [T, H] (out is not modified)."""
    result = out.to(F64).clone()
    for expert in range(w13.shape[0]):
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        if tokens.numel():
            y = expert_mlp(x[tokens], w13[expert], w2[expert])
            result.index_add_(0, tokens, y * weights[tokens, slots].to(F64)[:, None])
    return result


def dequantize(weight) -> torch.Tensor:
    """The float64 matrix (or stack) a `QuantizedWeight` of kind int8, int4 or fp8 stands for, from the stored bytes
    as tsterm_kernels.quant documents them:
    - int8: W = code * d, d one fp16 scale per block of 32 inputs;
    - int4: W = code * d + m, code in [0, 15]: byte j of a block's 16 holds input j (low nibble) and j + 16 (high);
    - fp8: W = value * the float32 scale of its 128 x 128 block (partial blocks at the edges)."""
    *lead, out_f, in_f = weight.dims
    if weight.kind == "int8":
        codes = weight.data.to(F64).reshape(*lead, out_f, in_f // QUANT_BLOCK, QUANT_BLOCK)
        return (codes * weight.scale.to(F64)[..., None]).reshape(weight.dims)
    if weight.kind == "int4":
        packed = weight.data.reshape(*lead, out_f, in_f // QUANT_BLOCK, QUANT_BLOCK // 2).to(torch.int64)
        codes = torch.cat((packed % 16, packed // 16), dim=-1).to(F64)  # inputs 0..15, then 16..31 of each block
        scale = weight.scale.to(F64)
        return (codes * scale[..., 0, None] + scale[..., 1, None]).reshape(weight.dims)
    if weight.kind == "fp8":
        scale = weight.scale.to(F64)
        rows = torch.arange(out_f, device=scale.device) // FP8_BLOCK
        cols = torch.arange(in_f, device=scale.device) // FP8_BLOCK
        return weight.data.to(F64) * scale[..., rows, :][..., cols]
    raise ValueError(f"no oracle for {weight.kind} weights")


def int8_rows_matmul(x: torch.Tensor, weight) -> torch.Tensor:
    """The C kernels' arithmetic for an int8 / int4 weight (csrc/gemv.c), with exact sums: each row of x [M, I] is
    rounded to int8 per block of 32 inputs (dx = max|x| / 127 in float32, codes round-half-even(x * (1 / dx)) in
    float32), each block's integer products are summed, and the sum is scaled by d * dx rounded to float32 (int4:
    plus m * dx * sum(codes of x)). -> [M, O] float64."""
    out_f, in_f = weight.dims
    xb = x.float().reshape(x.shape[0], in_f // QUANT_BLOCK, QUANT_BLOCK)
    dx = xb.abs().amax(-1) / 127.0  # [M, I/32] float32
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros((), device=x.device))
    qx = torch.round(xb * inv[..., None]).to(F64)  # [M, I/32, 32]
    if weight.kind == "int8":
        codes = weight.data.reshape(out_f, in_f // QUANT_BLOCK, QUANT_BLOCK).to(F64)
        d, m = weight.scale.float(), None
    else:
        packed = weight.data.reshape(out_f, in_f // QUANT_BLOCK, QUANT_BLOCK // 2).to(torch.int64)
        codes = torch.cat((packed % 16, packed // 16), dim=-1).to(F64)
        d, m = weight.scale.float().unbind(-1)
    scaled = (d[None] * dx[:, None]).to(F64)  # [M, O, I/32]: d * dx rounded to float32, as in C
    y = torch.einsum("mbk,obk,mob->mo", qx, codes, scaled)
    if m is not None:
        y = y + torch.einsum("mb,ob,mb->mo", qx.sum(-1), m.to(F64), dx.to(F64))
    return y


# Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention). One state S [dk, dv] per value head; for each token t, with
# q_t, k_t L2-normalised (eps inside the root, as the checkpoints were trained) and key head h // (Hv / Hk) read by
# value head h:   S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t / sqrt(dk)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x = x.to(F64)
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule as written, token by token, for one sequence: q, k [n, Hk, dk]; v [n, Hv, dv]; g, beta [n, Hv];
    state [Hv, dk, dv] before the first token (None: zeros). -> (o [n, Hv, dv], state after the last token)."""
    num_v_heads, dk, dv = v.shape[1], q.shape[-1], v.shape[-1]
    group = num_v_heads // k.shape[1]
    q = l2_normalize(q).repeat_interleave(group, 1)
    k = l2_normalize(k).repeat_interleave(group, 1)
    s = (torch.zeros(num_v_heads, dk, dv, dtype=F64, device=v.device) if state is None else state.to(F64).clone())
    out = []
    for t in range(v.shape[0]):
        s = s * g[t].to(F64).exp()[:, None, None]
        delta = beta[t].to(F64)[:, None] * (v[t].to(F64) - torch.einsum("hkv,hk->hv", s, k[t]))  # [Hv, dv]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[t]) / dk ** 0.5)
    empty = torch.empty(0, num_v_heads, dv, dtype=F64, device=v.device)
    return (torch.stack(out) if out else empty), s


def recurrent_gated_delta_rule(q, k, v, g, beta, states: torch.Tensor,
                               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences, sequence i's state in slot slots[i] of states [num_slots, Hv, dk, dv].
    -> (o [S, Hv, dv], the pool after the step: float64, the other slots as they were)."""
    pool = states.to(F64).clone()
    out = []
    for i, slot in enumerate(slots.tolist()):
        o, pool[slot] = gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], pool[slot])
        out.append(o[0])
    return torch.stack(out), pool


def chunk_gated_delta_rule(q, k, v, g, beta, states: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor,
                           out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt rows [bounds[i, 0], bounds[i, 1]) of each of N sequences, each from its slot's state, token by
    token (the chunked form is the production ops' business). -> (out [T, Hv, dv] float64: out's values with those
    rows replaced, the pool after the prompts, float64)."""
    pool, result = states.to(F64).clone(), out.to(F64).clone()
    for (start, end), slot in zip(bounds.tolist(), slots.tolist()):
        if end > start:
            result[start:end], pool[slot] = gated_delta_rule(q[start:end], k[start:end], v[start:end], g[start:end],
                                                             beta[start:end], pool[slot])
    return result, pool


def causal_conv(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the depthwise causal conv of one sequence's rows x [n, C] with weight [C, K], continuing after the
    K-1 earlier inputs in past [C, K-1]: output t is SiLU(sum_j weight[:, j] * input[t - (K-1) + j]).
    -> (out [n, C], the last K-1 inputs [C, K-1] in past's dtype)."""
    kernel = weight.shape[1]
    window = torch.cat((past.to(F64), x.to(F64).t()), dim=1)  # [C, K-1+n]
    w = weight.to(F64)
    out = torch.stack([F.silu((window[:, t:t + kernel] * w).sum(-1)) for t in range(x.shape[0])]) if len(x) else \
        torch.empty(0, x.shape[1], dtype=F64, device=x.device)
    return out, window[:, window.shape[1] - (kernel - 1):].to(past.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                  bounds: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt rows of each of N sequences (bounds [N, 2]), each continuing from its slot of conv_states
    [num_slots, C, K-1]. -> (out [T, C] float64: out's values with those rows replaced, the pool after them)."""
    pool, result = conv_states.clone(), out.to(F64).clone()
    for (start, end), slot in zip(bounds.tolist(), slots.tolist()):
        if end > start:
            result[start:end], pool[slot] = causal_conv(x[start:end], weight, pool[slot])
    return result, pool


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token x[i] [C] of each of S sequences, sequence i's K-1 previous inputs in slot slots[i].
    -> (out [S, C] float64, the pool after the step)."""
    pool, rows = conv_states.clone(), []
    for i, slot in enumerate(slots.tolist()):
        o, pool[slot] = causal_conv(x[i:i + 1], weight, pool[slot])
        rows.append(o[0])
    return torch.stack(rows), pool

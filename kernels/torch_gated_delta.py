"""The torch implementation of the Gated DeltaNet ops (the linear-attention layers of the Qwen3-Next / Qwen3.5
hybrids): the CPU production path, in float32, with the signatures the Triton kernels (`triton_gated_delta.py`) keep.
Not a test oracle: both are checked against the float64 token-by-token rule in tests/kernels/oracles.py.

The gated delta rule keeps one state per head, S [dk, dv], and for each token t (decay g_t <= 0 in log space,
beta_t in (0, 1), q_t and k_t L2-normalised):

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        o_t = S_t^T q_t / sqrt(dk)

Every sequence's state lives in its slot of a pool, `states [num_slots, Hv, dk, dv]` float32, and the ops update
the slots they are given in place (no gather of the states into a batch and scatter back: the state is the
largest thing a decode step touches). `recurrent_gated_delta_rule` runs one token of each of a batch of sequences
(decode); `chunk_gated_delta_rule` runs the prompt rows of each of a batch of sequences chunk by chunk (prefill):
within a chunk the corrections u_t that each token writes into the state solve one unit lower-triangular system,
so a chunk costs a few matmuls instead of one state update per token. `gated_delta_step` and `gated_delta_chunked`
are the same two forms for states given as tensors (views), updated in place.

The causal depthwise conv that feeds q/k/v keeps the last K-1 inputs of each channel as its state, in a pool
`conv_states [num_slots, C, K-1]`: `causal_conv1d` runs the prompt rows of each of a batch of sequences,
`causal_conv1d_update` one token of each; both rewrite the slots in place.

Prompt ops take `bounds [N, 2]` (int): sequence i's rows [bounds[i, 0], bounds[i, 1]) of the step's flattened
tokens, its state in slot `slots[i]`; they write only those rows of `out`. These ops read slots and bounds on the
host (free on the CPU, their device).

The decode ops may also write each new state into another slot than the one they read (`out_slots`): a speculative
verify step runs its positions one decode at a time, each position's state kept in a slot of its own, so that the
engine keeps the one at the last accepted position by taking its slot (nothing copied). The arithmetic is the
in-place step's, operation for operation: a position verified this way computes what decoding it would have.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def elementwise(op, x: torch.Tensor) -> torch.Tensor:
    """op(x) for an element-wise torch op (softplus, silu), with bits that do not depend on how many elements
    x has: torch's CPU loops run their vector routine on whole vectors and the scalar one on the tail, which round
    differently, so a row's result would depend on the rows beside it. On the CPU x is first copied into a strided
    view (stride 2), which takes the scalar routine for every element."""
    if not x.is_cpu:
        return op(x)
    spaced = torch.empty((x.numel(), 2), dtype=x.dtype)[:, 0]
    spaced.copy_(x.reshape(-1))
    return op(spaced).reshape(x.shape)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the eps inside the root, as the checkpoints were trained)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """L2-normalised float32 q, k with each key head repeated over its group of value heads; and the q scale."""
    group = num_v_heads // k.shape[-2]
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    if group > 1:  # value head h reads key head h // group
        q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
    return q, k, q.shape[-1] ** -0.5


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) of each run of consecutive slots in `ids`."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((row, slot, 1))
    return runs


def _in_slot_order(ids: list[int], rows: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor],
                                                                       torch.Tensor | None]:
    """The slots sorted, and the step's per-sequence rows in that order (one token's inputs each: small), so that a
    batch holding a range of slots in any order (the engine's slot stack hands them out descending after an
    ascending batch is freed) is one run; and the order, to put the outputs back (None: already sorted)."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order == list(range(len(ids))):
        return ids, rows, None
    perm = torch.tensor(order, device=rows[0].device)
    return [ids[i] for i in order], [x.index_select(0, perm) for x in rows], perm


def _unsort(out: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    return out if perm is None else torch.empty_like(out).index_copy_(0, perm, out)


def _out_of_place(src: list[int], dst: list[int], rows: list[torch.Tensor], step, pool: torch.Tensor) -> torch.Tensor:
    """A decode op whose row i reads slot src[i] of `pool` and writes slot dst[i]: `step(inputs, source view, target
    view)` over each run of rows whose source and target slots both go up one by one (the rows taken in target-slot
    order; a run with source == target is updated in place: source None). Returns the outputs in row order."""
    writer = {d: row for row, d in enumerate(dst)}
    assert len(writer) == len(dst) == len(set(src)) and all(writer.get(s, row) == row for row, s in enumerate(src)), \
        f"state slots read {src} and written {dst}: a slot read by one row is written by another"
    order = sorted(range(len(dst)), key=dst.__getitem__)
    perm = None if order == list(range(len(dst))) else torch.tensor(order, device=rows[0].device)
    if perm is not None:
        rows, src, dst = [x.index_select(0, perm) for x in rows], [src[i] for i in order], [dst[i] for i in order]
    runs: list[tuple[int, int, int, int]] = []  # (first row, first source, first target, length)
    for row, (s, d) in enumerate(zip(src, dst)):
        r0, s0, d0, n = runs[-1] if runs else (0, 0, 0, 0)
        if runs and s == s0 + n and d == d0 + n and (s == d) == (s0 == d0):
            runs[-1] = (r0, s0, d0, n + 1)
        else:
            runs.append((row, s, d, 1))
    outs = [step([x[r:r + n] for x in rows], None if s == d else pool.narrow(0, s, n), pool.narrow(0, d, n))
            for r, s, d, n in runs]
    return _unsort(outs[0] if len(outs) == 1 else torch.cat(outs), perm)


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
          state: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
    """Prepared q, k [S, Hv, dk]; v [S, Hv, dv]; g, beta [S, Hv] float32; state [S, Hv, dk, dv] float32 updated in
    place (a view of consecutive slots of a contiguous pool), or, with `source` (a view of as many other slots),
    written with the state that follows `source`'s, which is left as it is. Returns o [S, Hv, dv]."""
    num_seqs, num_v_heads, dk, dv = state.shape
    if source is None:
        state.mul_(g.exp()[..., None, None])  # decayed
    else:
        torch.mul(source, g.exp()[..., None, None], out=state)  # decayed, into the other slots (the same product)
    flat = state.view(num_seqs * num_v_heads, dk, dv)  # one [dk, dv] matrix per (sequence, head)
    predicted = torch.bmm(k.reshape(-1, 1, dk), flat).view(num_seqs, num_v_heads, dv)  # what the state recalls for k
    delta = (v.float() - predicted) * beta[..., None]  # [S, Hv, dv]
    flat.baddbmm_(k.reshape(-1, dk, 1), delta.view(-1, 1, dv))  # the rank-1 write, in place
    return torch.bmm(q.reshape(-1, 1, dk), flat).view(num_seqs, num_v_heads, dv) * scale  # [S, Hv, dv]


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """One token of each of S sequences. q, k: [S, Hk, dk]; v: [S, Hv, dv]; g, beta: [S, Hv]; state [S, Hv, dk, dv]
    float32, updated in place. Returns o [S, Hv, dv] float32."""
    q, k, scale = _prepare(q, k, v.shape[-2])
    return _step(q, k, v, g.float(), beta.float(), scale, state)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               states: torch.Tensor, slots: torch.Tensor,
                               out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """One token of each of S sequences, sequence i's state in slot `slots[i]` of the pool.

    q, k: [S, Hk, dk]; v: [S, Hv, dv]; g, beta: [S, Hv]; states: [num_slots, Hv, dk, dv] float32, the rows `slots`
    [S] (int, distinct) updated in place; or, with `out_slots` [S] (int, distinct), each new state written into slot
    `out_slots[i]` and slot `slots[i]` left as it is where the two differ (no slot read by one row is written by
    another). Returns o [S, Hv, dv] float32.

    Each run of consecutive slots (the rows taken in slot order) is one view of the pool, updated in one batched
    step (the engine hands slots out from a stack, so a batch is usually one run). Measured at 32 value heads of 128 x 128 (2 MB of
    state per sequence), 1 thread on the shared 2-core machine: 1 sequence 0.8 ms against 2.8 ms for a gather of
    the states, the step and a scatter back; 8 sequences 6-15 ms against 46 ms (per-slot views: within the noise of
    per-run views).
    """
    q, k, scale = _prepare(q, k, v.shape[-2])
    if out_slots is not None:
        return _out_of_place(slots.tolist(), out_slots.tolist(), [q, k, v, g.float(), beta.float()],
                             lambda x, src, dst: _step(*x, scale, dst, src), states)
    ids, (q, k, v, g, beta), perm = _in_slot_order(slots.tolist(), [q, k, v, g.float(), beta.float()])
    runs = _runs(ids)
    if len(runs) == 1:
        return _unsort(_step(q, k, v, g, beta, scale, states.narrow(0, runs[0][1], runs[0][2])), perm)
    return _unsort(torch.cat([_step(q[r:r + n], k[r:r + n], v[r:r + n], g[r:r + n], beta[r:r + n], scale,
                                    states.narrow(0, slot, n)) for r, slot, n in runs]), perm)


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """n tokens of one sequence, chunk by chunk.

    q, k: [n, Hk, dk]; v: [n, Hv, dv]; g, beta: [n, Hv]; state: [Hv, dk, dv] float32 (a view is fine), the state
    before the first token, updated in place to the state after the last. Returns o [n, Hv, dv] float32.

    In a chunk starting from state S0, with G_i the decay summed over the chunk's tokens up to i, every state is
    S_i = exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) k_j u_j^T, where u_j is what token j writes. Substituting into the
    rule gives (I + A) U = beta V - beta exp(G) K S0 with A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i): U splits in
    a part independent of S0 (solved for all chunks at once) and a part linear in it (applied chunk by chunk).
    """
    n, num_v_heads, dv = v.shape
    q, k, scale = _prepare(q, k, num_v_heads)
    pad = -n % chunk_size
    num_chunks, C = (n + pad) // chunk_size, chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [n, Hv, ...] -> [Hv, N, C, ...], zero-padded at the end
        x = F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.view(num_chunks, C, *x.shape[1:]).movedim(2, 0)

    qc, kc, vc = chunks(q) * scale, chunks(k), chunks(v)  # [Hv, N, C, dk], [Hv, N, C, dk], [Hv, N, C, dv]
    # padding tokens: g = 0 (no decay), beta = 0 (no write): they leave the state as it is
    gc, bc = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]  # [Hv, N, C]
    G = gc.cumsum(-1)  # [Hv, N, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    # exp(G_i - G_j) for j <= i; masked before the exp (G_i - G_j > 0 above the diagonal could overflow)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv, N, C, C]
    A = (kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]  # [Hv, N, C, C]
    system = A.tril(-1) + torch.eye(C, device=q.device)  # I + strictly lower A
    u_free = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    u_state = torch.linalg.solve_triangular(system, kc * (bc * G.exp())[..., None], upper=False, unitriangular=True)
    scores = (qc @ kc.transpose(-1, -2)) * decay  # [Hv, N, C, C]: q_i.k_j exp(G_i - G_j), j <= i
    q_decayed = qc * G.exp()[..., None]  # [Hv, N, C, dk]: what S0 contributes to o_i
    k_to_end = (kc * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2)  # [Hv, N, dk, C]: decayed to the end
    chunk_decay = G[..., -1].exp()[..., None, None]  # [Hv, N, 1, 1]
    out = torch.empty_like(vc)  # [Hv, N, C, dv]
    for c in range(num_chunks):
        u = u_free[:, c] - u_state[:, c] @ state  # [Hv, C, dv]
        out[:, c] = q_decayed[:, c] @ state + scores[:, c] @ u
        state.mul_(chunk_decay[:, c]).baddbmm_(k_to_end[:, c], u)  # [Hv, dk, dv], in place
    return out.movedim(0, 2).reshape(num_chunks * C, num_v_heads, dv)[:n]  # [n, Hv, dv]


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           states: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor, out: torch.Tensor,
                           chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """The prompt rows of each of N sequences (prefill), chunk by chunk.

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g, beta: [T, Hv]: the step's rows; states: [num_slots, Hv, dk, dv] float32,
    the rows `slots` [N] (int, distinct) updated in place; bounds: [N, 2] (int), each sequence's rows; out:
    [T, Hv, dv] float32, written at those rows. Returns out.
    """
    for (start, end), slot in zip(bounds.tolist(), slots.tolist()):
        if end > start:
            out[start:end] = gated_delta_chunked(q[start:end], k[start:end], v[start:end], g[start:end],
                                                 beta[start:end], states[slot], chunk_size)
    return out


def _conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """x [n, C] after the K-1 inputs in conv_state [C, K-1] (rewritten in place with the last K-1): SiLU(conv)."""
    n, channels = x.shape
    full = torch.cat((conv_state.to(x.dtype), x.t()), dim=1)  # [C, K-1+n]: the window each output needs
    result = F.conv1d(full[None].to(weight.dtype), weight[:, None], groups=channels)[0]  # [C, n]
    conv_state.copy_(full[:, n:])  # [C, K-1]: the last K-1 inputs (old state included when n < K-1)
    return F.silu(result).t().to(x.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slots: torch.Tensor,
                  bounds: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over the prompt rows of each of N sequences, each continuing from its state.

    x: [T, C]; weight: [C, K]; conv_states: [num_slots, C, K-1], slot i holding its sequence's K-1 previous inputs
    (zeros at its start), the rows `slots` [N] overwritten in place with their last K-1 inputs; bounds: [N, 2]
    (int), each sequence's rows; out: [T, C] in x's dtype, written at those rows. Returns out.
    """
    for (start, end), slot in zip(bounds.tolist(), slots.tolist()):
        if end > start:
            out[start:end] = _conv(x[start:end], weight, conv_states[slot])
    return out


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor, out_slots: torch.Tensor | None = None) -> torch.Tensor:
    """One new token of each of S sequences: the decode step of `causal_conv1d`.

    x: [S, C]; weight: [C, K]; conv_states: [num_slots, C, K-1], the rows `slots` [S] (int, distinct) read and
    rewritten in place; or, with `out_slots` [S], the new window written into slot `out_slots[i]` and slot `slots[i]`
    left as it is (as `recurrent_gated_delta_rule`). Returns [S, C] in x's dtype.
    """
    if out_slots is not None:
        return _out_of_place(slots.tolist(), out_slots.tolist(), [x],
                             lambda rows, src, dst: _conv_step(rows[0], weight, dst, src), conv_states)
    ids, (x,), perm = _in_slot_order(slots.tolist(), [x])
    runs = _runs(ids)
    if len(runs) == 1:
        return _unsort(_conv_step(x, weight, conv_states.narrow(0, runs[0][1], runs[0][2])), perm)
    return _unsort(torch.cat([_conv_step(x[r:r + n], weight, conv_states.narrow(0, slot, n)) for r, slot, n in runs]),
                   perm)


def _conv_step(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
               source: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, C], one token after the K-1 inputs in conv_state [S, C, K-1] (shifted in place): SiLU(conv). With
    `source` (other slots' [S, C, K-1]): after the inputs there, shifted into conv_state; source left as it is."""
    past = weight.shape[1] - 1
    source = conv_state if source is None else source
    result = (source.to(weight.dtype) * weight[:, :past]).sum(-1) + x.to(weight.dtype) * weight[:, past]  # [S, C]
    for j in range(past - 1):  # shift left by one, column by column (an overlapping copy_ is refused)
        conv_state[:, :, j].copy_(source[:, :, j + 1])
    if past:
        conv_state[:, :, past - 1].copy_(x)
    return elementwise(F.silu, result).to(x.dtype)  # [S, C] contiguous: the same bits in any batch (C % 32 or not)

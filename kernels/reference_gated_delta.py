"""Torch reference twins of the Gated DeltaNet ops (the linear-attention layers of the Qwen3-Next / Qwen3.5 hybrids):
the CPU path, in float32, and the oracle future Triton kernels (`triton_gated_delta.py`) will be tested against.

The gated delta rule keeps one state per head, S [dk, dv], and for each token t (decay g_t <= 0 in log space,
beta_t in (0, 1), q_t and k_t L2-normalised):

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        o_t = S_t^T q_t / sqrt(dk)

`recurrent_gated_delta_rule` runs that step for a batch of sequences at once (decode: one token each);
`chunk_gated_delta_rule` runs a whole prompt chunk by chunk (prefill): within a chunk the corrections u_t that
each token writes into the state solve one unit lower-triangular system, so a chunk costs a few matmuls instead of
one state update per token. Both read the initial state and return the final state; neither mutates its inputs.

The causal depthwise conv that feeds q/k/v keeps the last K-1 inputs of each channel as its state:
`causal_conv1d` runs a prompt chunk of one sequence (state read and rewritten in place), `causal_conv1d_update`
one token of each of a batch of sequences (states gathered and scattered by slot).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


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


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences.

    q, k: [S, Hk, dk]; v: [S, Hv, dv]; g, beta: [S, Hv]; state: [S, Hv, dk, dv] (not mutated).
    Returns (o [S, Hv, dv] float32, new state [S, Hv, dk, dv] float32).
    """
    q, k, scale = _prepare(q, k, v.shape[-2])
    s = state.float() * g.float().exp()[..., None, None]  # [S, Hv, dk, dv]: decayed
    predicted = torch.einsum("shkv,shk->shv", s, k)  # [S, Hv, dv]: what the state recalls for k
    delta = (v.float() - predicted) * beta.float()[..., None]  # [S, Hv, dv]
    s = s + k[..., :, None] * delta[..., None, :]  # rank-1 write
    o = torch.einsum("shkv,shk->shv", s, q) * scale  # [S, Hv, dv]
    return o, s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens of one sequence, chunk by chunk.

    q, k: [n, Hk, dk]; v: [n, Hv, dv]; g, beta: [n, Hv]; state: [Hv, dk, dv] or None (zeros); not mutated.
    Returns (o [n, Hv, dv] float32, final state [Hv, dk, dv] float32).

    In a chunk starting from state S0, with G_i the decay summed over the chunk's tokens up to i, every state is
    S_i = exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) k_j u_j^T, where u_j is what token j writes. Substituting into the
    rule gives (I + A) U = beta V - beta exp(G) K S0 with A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i): U splits in
    a part independent of S0 (solved for all chunks at once) and a part linear in it (applied chunk by chunk).
    """
    n, num_v_heads, dv = v.shape
    q, k, scale = _prepare(q, k, num_v_heads)
    dk = k.shape[-1]
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
    k_to_end = kc * (G[..., -1:] - G).exp()[..., None]  # [Hv, N, C, dk]: k_j decayed to the chunk's end
    s = (torch.zeros(num_v_heads, dk, dv, device=q.device) if state is None else state.float())  # [Hv, dk, dv]
    out = torch.empty_like(vc)  # [Hv, N, C, dv]
    for c in range(num_chunks):
        u = u_free[:, c] - u_state[:, c] @ s  # [Hv, C, dv]
        out[:, c] = q_decayed[:, c] @ s + scores[:, c] @ u
        s = s * G[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    o = out.movedim(0, 2).reshape(num_chunks * C, num_v_heads, dv)[:n]  # [n, Hv, dv]
    return o, s


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over n new tokens of one sequence, continuing from its state.

    x: [n, C]; weight: [C, K]; conv_state: [C, K-1], the sequence's K-1 previous inputs (zeros at its start),
    overwritten in place with the last K-1 inputs. Returns [n, C] in x's dtype.
    """
    n, channels = x.shape
    full = torch.cat((conv_state.to(x.dtype), x.t()), dim=1)  # [C, K-1+n]: the window each output needs
    out = F.conv1d(full[None].to(weight.dtype), weight[:, None], groups=channels)[0]  # [C, n]
    conv_state.copy_(full[:, n:])  # [C, K-1]: the last K-1 inputs (old state included when n < K-1)
    return F.silu(out).t().to(x.dtype)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """One new token of each of S sequences: the decode step of `causal_conv1d`.

    x: [S, C]; weight: [C, K]; conv_states: [num_slots, C, K-1], the rows `slots` [S] (int) read and rewritten in
    place. Returns [S, C] in x's dtype.
    """
    window = torch.cat((conv_states.index_select(0, slots).to(x.dtype), x[:, :, None]), dim=2)  # [S, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)  # [S, C]
    conv_states.index_copy_(0, slots, window[:, :, 1:].to(conv_states.dtype))
    return F.silu(out).to(x.dtype)

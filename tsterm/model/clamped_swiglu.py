"""gpt-oss's experts (`tsterm.model.arch.gpt_oss`): biases on both projections and the clamped SwiGLU

    gate, up = x W_gate + b_gate, x W_up + b_up
    y        = ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)) W_down + b_down,  g = min(gate, limit)

over the decoder's packed expert stacks (w13 [E, 2I, H]: gate rows, then up rows; float, or MXFP4 `QuantizedWeight`s).
On a CUDA device the Triton fused MoE runs them (`tsterm_kernels.triton_fused_moe`: both biases and this activation,
one launch of each of its two kernels per layer, the expert grouping on the device); elsewhere, and as that kernel's
twin, each expert runs once in torch over the tokens that chose it (its counts read on the host). The CPU's C
kernels (csrc/moe.c, the one-call decode stack) have neither the biases nor this activation yet."""
from __future__ import annotations

import torch
from tsterm_kernels.torch_ops import linear


def clamped_swiglu_experts(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
                           b2: torch.Tensor | None, weights: torch.Tensor, expert_ids: torch.Tensor, alpha: float,
                           limit: float, out: torch.Tensor) -> None:
    """out [T, H] += each token's chosen experts' outputs, weighted (gpt-oss's experts, see the module doc).

    x [T, H]; w13 [E, 2I, H] (gate rows then up rows), b13 [E, 2I]; w2 [E, H, I], b2 [E, H] or None (another
    tensor-parallel rank adds it); weights, expert_ids [T, k] (an id of E or more: another rank's expert, skipped).
    Each expert runs once over the tokens that chose it.
    """
    if x.is_cuda:  # (imported here: triton only where a CUDA device runs the model)
        from tsterm_kernels.triton_fused_moe import fused_moe
        fused_moe(x, w13, w2, weights, expert_ids, out, w13_bias=b13, w2_bias=b2, clamped_swiglu=(alpha, limit))
        return
    experts_loop(x, w13, b13, w2, b2, weights, expert_ids, alpha, limit, out)


def experts_loop(x: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor | None,
                 weights: torch.Tensor, expert_ids: torch.Tensor, alpha: float, limit: float,
                 out: torch.Tensor) -> None:
    """`clamped_swiglu_experts` in torch on any device, expert by expert (the fused kernel's twin)."""
    num_experts, top_k = w13.shape[0], expert_ids.shape[1]
    inter = w13.shape[1] // 2
    flat = expert_ids.reshape(-1).clamp(max=num_experts)  # [T k]: E for every expert this rank does not hold
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    pair_weights = weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // top_k
        h = linear(x[tokens], w13[e], b13[e])  # [n, 2I]
        # In place on views of h and of a buffer as wide, whose rows (stride 2I) do not coalesce: sigmoid runs row
        # by row, its vector body and scalar tail splitting every row alike, so a token's bits do not depend on how
        # many tokens chose the expert (a verify step's rows are the decode's)
        gate, up = h[:, :inter].clamp_(max=limit), h[:, inter:].clamp_(-limit, limit).add_(1)
        act = torch.mul(gate, alpha, out=torch.empty_like(h)[:, :inter]).sigmoid_().mul_(gate).mul_(up)
        y = linear(act, w2[e], None if b2 is None else b2[e])  # [n, H]
        out.index_add_(0, tokens, (y * pair_weights[pairs, None].to(y.dtype)).to(out.dtype))

"""MoE routing on the device: softmax -> top-k -> renormalise, fused, one program per block of tokens.

Twin: `tsterm_kernels.torch_ops.moe_route`. Top-k is k rounds of arg-max over the row held in registers; equal
probabilities go to the lower expert id.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_route_kernel(
    # pointers
    logits_ptr, weights_ptr, expert_ids_ptr,
    # sizes and strides
    num_tokens, num_experts, stride_logits_token, stride_weights_token, stride_ids_token,
    # meta-parameters
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    token_valid = tokens < num_tokens
    expert_valid = experts < num_experts
    tokens = tokens.to(tl.int64)

    # ---- softmax over the experts, in float32
    logits = tl.load(logits_ptr + tokens[:, None] * stride_logits_token + experts[None, :],
                     mask=token_valid[:, None] & expert_valid[None, :], other=float("-inf")).to(tl.float32)
    logits = tl.where(token_valid[:, None], logits, 0.0)  # padding rows: finite, never stored
    shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])  # [BLOCK_T, BLOCK_E]
    probs = shifted / tl.sum(shifted, axis=1)[:, None]
    probs = tl.where(expert_valid[None, :], probs, -1.0)  # padding experts never win

    # ---- top-k: k rounds of arg-max, each winner knocked out
    slots = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    top_weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)  # [BLOCK_T]
        best_id = tl.min(tl.where(probs == best[:, None], experts[None, :], BLOCK_E), axis=1)  # [BLOCK_T]
        top_weights = tl.where(slots[None, :] == i, best[:, None], top_weights)
        top_ids = tl.where(slots[None, :] == i, best_id[:, None], top_ids)
        probs = tl.where(experts[None, :] == best_id[:, None], -1.0, probs)

    # ---- renormalise the chosen weights, store
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]
    mask = token_valid[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + tokens[:, None] * stride_weights_token + slots[None, :], top_weights, mask=mask)
    tl.store(expert_ids_ptr + tokens[:, None] * stride_ids_token + slots[None, :], top_ids.to(tl.int64), mask=mask)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    assert router_logits.dim() == 2 and router_logits.stride(1) == 1, \
        f"router_logits must be [T, E] with unit last stride, got {tuple(router_logits.shape)} {router_logits.stride()}"
    assert router_logits.dtype in (torch.float32, torch.float16, torch.bfloat16), f"bad dtype {router_logits.dtype}"
    num_tokens, num_experts = router_logits.shape
    assert 1 <= top_k <= num_experts, f"top_k {top_k} must be in [1, {num_experts}]"
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    expert_ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, expert_ids
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // block_e))
    _moe_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, expert_ids,
        num_tokens, num_experts, router_logits.stride(0), weights.stride(0), expert_ids.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
    )
    return weights, expert_ids

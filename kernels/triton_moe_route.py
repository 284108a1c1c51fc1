"""MoE routing on the device, fused, one program per block of tokens: every kind of the one router
(`tsterm_kernels.routing`): softmax -> top-k -> renormalise, or sigmoid scores with a selection bias, group-limited
choice and a scale.

Twin: `tsterm_kernels.torch_ops.moe_route`. Top-k is k rounds of arg-max over the row held in registers; equal
choices go to the lower expert id (and equal group scores to the lower group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tsterm_kernels.routing import Routing, routing_or_default


@triton.jit
def _moe_route_kernel(
    # pointers
    logits_ptr, bias_ptr, weights_ptr, expert_ids_ptr,
    # sizes and strides
    num_tokens, num_experts, stride_logits_token, stride_weights_token, stride_ids_token, scale,
    # meta-parameters
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, SCALED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    token_valid = tokens < num_tokens
    expert_valid = experts < num_experts
    tokens = tokens.to(tl.int64)

    logits = tl.load(logits_ptr + tokens[:, None] * stride_logits_token + experts[None, :],
                     mask=token_valid[:, None] & expert_valid[None, :], other=float("-inf")).to(tl.float32)
    logits = tl.where(token_valid[:, None], logits, 0.0)  # padding rows: finite, never stored
    if SIGMOID:
        # ---- sigmoid scores; the bias (if any) only chooses
        scores = 1.0 / (1.0 + tl.exp(-logits))  # [BLOCK_T, BLOCK_E]
        choice = scores
        if HAS_BIAS:
            bias = tl.load(bias_ptr + experts, mask=expert_valid, other=0.0)  # [BLOCK_E]
            choice = scores + bias[None, :]
        choice = tl.where(expert_valid[None, :], choice, float("-inf"))  # padding experts never win
    else:
        # ---- softmax over the experts, in float32
        shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])  # [BLOCK_T, BLOCK_E]
        scores = shifted / tl.sum(shifted, axis=1)[:, None]
        choice = tl.where(expert_valid[None, :], scores, -1.0)  # padding experts never win
        if HAS_BIAS:
            bias = tl.load(bias_ptr + experts, mask=expert_valid, other=0.0)
            choice = tl.where(expert_valid[None, :], scores + bias[None, :], float("-inf"))

    if NUM_GROUPS > 1:
        # ---- group-limited: each group's score is its two best choices summed; only the best groups' experts stay
        group_of = experts // GROUP_SIZE  # [BLOCK_E] (padding experts fall past the last group)
        groups = tl.arange(0, BLOCK_G)  # [BLOCK_G]
        group_scores = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            member = group_of[None, :] == g
            in_group = tl.where(member, choice, float("-inf"))  # [BLOCK_T, BLOCK_E]
            first = tl.max(in_group, axis=1)  # [BLOCK_T]
            first_id = tl.min(tl.where(in_group == first[:, None], experts[None, :], BLOCK_E), axis=1)
            second = tl.max(tl.where(experts[None, :] == first_id[:, None], float("-inf"), in_group), axis=1)
            group_scores = tl.where(groups[None, :] == g, (first + second)[:, None], group_scores)
        kept = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
        for i in tl.static_range(TOPK_GROUPS):
            best = tl.max(group_scores, axis=1)  # [BLOCK_T]
            best_group = tl.min(tl.where(group_scores == best[:, None], groups[None, :], BLOCK_G), axis=1)
            kept = tl.where(group_of[None, :] == best_group[:, None], 1, kept)
            group_scores = tl.where(groups[None, :] == best_group[:, None], float("-inf"), group_scores)
        choice = tl.where(kept != 0, choice, float("-inf"))

    # ---- top-k: k rounds of arg-max over the choices, each winner knocked out; its weight is its unbiased score
    slots = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    top_weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    top_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)  # [BLOCK_T]
        best_id = tl.min(tl.where(choice == best[:, None], experts[None, :], BLOCK_E), axis=1)  # [BLOCK_T]
        chosen = experts[None, :] == best_id[:, None]  # [BLOCK_T, BLOCK_E]
        weight = tl.sum(tl.where(chosen, scores, 0.0), axis=1)  # [BLOCK_T]
        top_weights = tl.where(slots[None, :] == i, weight[:, None], top_weights)
        top_ids = tl.where(slots[None, :] == i, best_id[:, None], top_ids)
        choice = tl.where(chosen, float("-inf"), choice)

    # ---- renormalise the chosen weights, scale, store
    if RENORMALIZE:
        if SIGMOID or HAS_BIAS or NUM_GROUPS > 1:
            top_weights = top_weights / (tl.sum(top_weights, axis=1)[:, None] + 1e-20)
        else:
            top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]
    if SCALED:
        top_weights = top_weights * scale
    mask = token_valid[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + tokens[:, None] * stride_weights_token + slots[None, :], top_weights, mask=mask)
    tl.store(expert_ids_ptr + tokens[:, None] * stride_ids_token + slots[None, :], top_ids.to(tl.int64), mask=mask)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
              routing: Routing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    assert router_logits.dim() == 2 and router_logits.stride(1) == 1, \
        f"router_logits must be [T, E] with unit last stride, got {tuple(router_logits.shape)} {router_logits.stride()}"
    assert router_logits.dtype in (torch.float32, torch.float16, torch.bfloat16), f"bad dtype {router_logits.dtype}"
    num_tokens, num_experts = router_logits.shape
    assert 1 <= top_k <= num_experts, f"top_k {top_k} must be in [1, {num_experts}]"
    routing = routing_or_default(routing)
    if routing is not None:
        routing.check(num_experts, top_k)
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    expert_ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, expert_ids
    kind = routing if routing is not None else Routing()
    bias = kind.bias.to(router_logits.device) if kind.bias is not None else weights  # (never read without a bias)
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // block_e))
    _moe_route_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, bias, weights, expert_ids,
        num_tokens, num_experts, router_logits.stride(0), weights.stride(0), expert_ids.stride(0), float(kind.scale),
        TOP_K=top_k, RENORMALIZE=renormalize, SIGMOID=kind.scoring == "sigmoid", HAS_BIAS=kind.bias is not None,
        NUM_GROUPS=kind.num_groups, TOPK_GROUPS=kind.topk_groups, GROUP_SIZE=num_experts // kind.num_groups,
        SCALED=kind.scale != 1.0, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_G=triton.next_power_of_2(kind.num_groups), num_warps=4,
    )
    return weights, expert_ids

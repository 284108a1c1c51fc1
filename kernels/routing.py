"""The kinds of the one MoE router: how a token's router logits choose its experts and weigh them.

The default kind (`Routing()`, or None where an op takes one) is the softmax router of Qwen-MoE, Mixtral and OLMoE:
the top k of softmax(logits), renormalised over the k or not. The sigmoid kinds are those of GLM-4.5 / 4.6,
MiniMax-M2 and DeepSeek-V3 / Kimi-K2:

    scores  = sigmoid(logits)                                   [E]
    choice  = scores + bias                                      (the bias chooses; it never weighs)
    groups:   the experts split into `num_groups` equal groups in id order; each group's score is the sum of its two
              largest choices; only the experts of the `topk_groups` best groups stay candidates
    ids     = the top k of the candidates' choices (descending; equal choices go to the lower id)
    weights = scores[ids], divided by their sum when renormalised, times `scale` (`routed_scaling_factor`)

Every implementation (`torch_ops.moe_route`, its C path `csrc/stack.c`, the Triton kernel `triton_moe_route`) takes
the kind as it is; the float64 oracle is in tests/kernels/test_moe_routing.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True, eq=False)
class Routing:
    """scoring: "softmax" or "sigmoid"; bias: [E] float32 added to the scores for the choice only (None: none);
    num_groups / topk_groups: group-limited choice (1 / 1: none); scale: multiplies the final weights."""

    scoring: str = "softmax"
    bias: torch.Tensor | None = None
    num_groups: int = 1
    topk_groups: int = 1
    scale: float = 1.0

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"Routing.scoring must be one of {', '.join(SCORINGS)}, got {self.scoring!r}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"Routing.topk_groups ({self.topk_groups}) must be in [1, num_groups={self.num_groups}]")
        if self.bias is not None and (self.bias.dim() != 1 or self.bias.dtype != torch.float32):
            raise ValueError(f"Routing.bias must be a [E] float32 tensor, got {self.bias.dtype} "
                             f"{list(self.bias.shape)}")
        if not self.scale > 0:
            raise ValueError(f"Routing.scale (routed_scaling_factor) must be positive, got {self.scale}")

    @property
    def plain(self) -> bool:
        """The default softmax router (no bias, no groups, no scale): the ops' original path."""
        return self.scoring == "softmax" and self.bias is None and self.num_groups == 1 and self.scale == 1.0

    def check(self, num_experts: int, top_k: int) -> None:
        """Raises ValueError naming the field when this kind cannot route `num_experts` experts top_k at a time."""
        if self.bias is not None and self.bias.shape[0] != num_experts:
            raise ValueError(f"Routing.bias has {self.bias.shape[0]} entries for {num_experts} experts")
        if self.num_groups > 1:
            if num_experts % self.num_groups:
                raise ValueError(f"Routing.num_groups (n_group={self.num_groups}) must divide the {num_experts} "
                                 "experts")
            size = num_experts // self.num_groups
            if size < 2:
                raise ValueError(f"Routing.num_groups (n_group={self.num_groups}) leaves groups of {size} expert; a "
                                 "group's score is the sum of its two best, so groups need at least 2")
            if top_k > self.topk_groups * size:
                raise ValueError(f"top_k ({top_k}) is more than the {self.topk_groups * size} experts of the "
                                 f"topk_group={self.topk_groups} groups kept")


def routing_or_default(routing: Routing | None) -> Routing | None:
    """None for the plain softmax router (the ops' original path), else the kind."""
    return None if routing is None or routing.plain else routing

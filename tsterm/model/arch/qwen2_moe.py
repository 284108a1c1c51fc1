"""Qwen2-MoE: q/k/v biases, and a dense shared expert scaled by sigmoid(shared_expert_gate(x))."""
from tsterm.model.arch.spec import ArchSpec

SPEC = ArchSpec("qwen2_moe", qkv_bias=True, shared_expert=True, norm_topk_prob_default=False)

"""Every family the engine runs on the CPU, as a tiny random float32 checkpoint for the bfloat16 tests
(tests/model/test_bf16_families.py: against transformers; tests/engine/test_bf16_invariance.py: the invariance
promise). Each case keeps its family's distinctive parts (the shapes the families' own parity tests use)."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint

# name -> (model_type, config overrides, hybrid?)
FAMILIES: dict[str, tuple[str, dict, bool]] = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True), False),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=5, num_experts_per_tok=2, shared_expert_intermediate_size=40,
                                    norm_topk_prob=False), False),
    "mixtral": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=2, num_key_value_heads=1), False),
    "olmoe": ("olmoe", dict(num_experts=5, num_experts_per_tok=2, clip_qkv=4.0, head_dim=8), False),
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                  first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, attention_bias=True, use_qk_norm=True, num_attention_heads=5,
                                  num_key_value_heads=1, partial_rotary_factor=0.5), False),
    "minimax_m2": ("minimax_m2", dict(num_local_experts=6, num_experts_per_tok=2, num_attention_heads=3,
                                      num_key_value_heads=1, rotary_dim=8), False),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5,
                                num_key_value_heads=1, sliding_window=4, num_hidden_layers=3), False),
    "deepseek_v3": ("deepseek_v3", dict(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                                        q_lora_rank=20, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                        topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                                        routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                                        num_attention_heads=5, num_key_value_heads=5), False),
    "qwen3_next": ("qwen3_next", {}, True),
    "qwen3_5_moe": ("qwen3_5_moe", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]), True),
}


def make_family(root: Path, name: str, overrides: dict | None = None):
    """(checkpoint dir, the transformers model saved there) for FAMILIES[name], `overrides` on top of its own."""
    model_type, own, hybrid = FAMILIES[name]
    make = make_hybrid_checkpoint if hybrid else make_checkpoint
    return make(Path(root) / name, model_type, {**own, **(overrides or {})})

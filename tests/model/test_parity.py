"""tsterm's model core against transformers on tiny random checkpoints of every supported architecture."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import assert_greedy_matches, assert_last_logits_close, random_prompts

# (name, model_type, config overrides, save kwargs)
CASES = [
    ("qwen3_moe-gqa-topk2-norm", "qwen3_moe", dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True), {}),
    ("qwen3_moe-top1-sparse-step", "qwen3_moe",
     dict(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[2],
          num_hidden_layers=4), {}),
    ("qwen3_moe-sharded-yarn", "qwen3_moe",
     dict(num_experts=7, num_experts_per_tok=3, num_key_value_heads=1,
          rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                           "original_max_position_embeddings": 64}),
     dict(max_shard_size="40KB")),
    ("qwen2_moe-shared-expert", "qwen2_moe",
     dict(num_experts=5, num_experts_per_tok=2, shared_expert_intermediate_size=40, norm_topk_prob=False), {}),
    ("qwen2_moe-norm-topk", "qwen2_moe",
     dict(num_experts=3, num_experts_per_tok=2, shared_expert_intermediate_size=24, norm_topk_prob=True,
          num_key_value_heads=4), {}),
    ("mixtral", "mixtral", dict(num_local_experts=3, num_experts_per_tok=2, num_key_value_heads=1), {}),
    ("olmoe-clip", "olmoe", dict(num_experts=5, num_experts_per_tok=2, clip_qkv=4.0, head_dim=8), {}),
    ("qwen3-dense-tied", "qwen3", dict(tie_word_embeddings=True), {}),
    ("llama-bias-llama3-rope", "llama",
     dict(attention_bias=True, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32}), {}),
    ("llama-linear-rope", "llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), {}),
]

NEW_TOKENS = 32


@pytest.mark.parametrize("name,model_type,overrides,save_kwargs", CASES, ids=[c[0] for c in CASES])
def test_greedy_and_logits_match_transformers(tmp_path, name, model_type, overrides, save_kwargs):
    model_dir, hf_model = make_checkpoint(tmp_path / name, model_type, overrides, **save_kwargs)
    if save_kwargs.get("max_shard_size"):
        assert (model_dir / "model.safetensors.index.json").is_file()
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    assert_greedy_matches(llm, hf_model, random_prompts(hf_model.config.vocab_size), NEW_TOKENS)


@pytest.mark.parametrize("model_type,overrides", [("qwen3_moe", dict(num_experts=5, num_experts_per_tok=2)),
                                                  ("qwen2_moe", dict(num_experts=3, num_experts_per_tok=2, shared_expert_intermediate_size=24))])
def test_last_position_logits_relative_error(tmp_path, model_type, overrides):
    model_dir, hf_model = make_checkpoint(tmp_path / model_type, model_type, overrides)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=32)
    prompt = torch.randint(0, hf_model.config.vocab_size, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_last_logits_close(llm, hf_model, prompt)

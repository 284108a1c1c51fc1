"""`tsterm plan --dtype int4` counts what the engine's `quantization: int4` allocates: tiny checkpoints loaded by the
engine's own loader with that quantization, the bytes their weights hold against the plan's weight bytes for the same
config (one rank). The int4 form is tsterm_kernels.quant's (GGUF Q4_1: 4-bit codes and an fp16 scale and minimum per
32 inputs), a matrix whose inputs are not whole blocks of 32 stays in the float dtype, the LM head is int4 (a tied
one as a copy beside the float embedding), and MLA's projections keep the checkpoint's form (fp8 blocks)."""
from __future__ import annotations

import json

import torch

from tsterm.plan import GPU_PRESETS, Tensor, load_config, parse_model, plan_layouts, rank_tensors


def _loaded_and_planned(path, keep_fp8: bool = False) -> tuple[int, int, dict]:
    from tsterm_kernels.quant import QuantizedWeight

    from tsterm.config import ModelConfig
    from tsterm.model.loader import load_weights
    from tsterm.model.quant import weight_bytes

    cfg = ModelConfig.from_dir(path)
    weights = load_weights(path, cfg, torch.bfloat16, torch.device("cpu"), keep_fp8=keep_fp8, quantization="int4")
    assert all(w.dtype is torch.bfloat16 or isinstance(w, QuantizedWeight) or w.dtype is torch.float32
               for w in weights.values())
    m = parse_model(*load_config(path))
    lay, = plan_layouts(m, 1, GPU_PRESETS["h100"], dtype="int4")
    # MLA's absorbed form adds float32 copies of kv_b (W_UK / W_UV) in its attention module, outside the weights dict:
    # the plan counts them (derived, shipped float32), the comparison leaves them out of both sides
    copies = sum(t.bytes("int4") * t.count for t in rank_tensors(m, 1, 1) if t.shipped == "float32")
    return weight_bytes(weights), lay.weight_bytes - copies, weights


def test_plan_int4_is_what_a_moe_model_loads(tmp_path):
    """Qwen3-MoE with o_proj's inputs (3 heads x 16 = 48) and a dense MLP's down inputs (48) not whole blocks of 32
    (they stay bfloat16), everything else int4, an untied LM head int4."""
    from tests.helpers.checkpoints import make_checkpoint

    path, _ = make_checkpoint(tmp_path / "moe", "qwen3_moe", dict(
        hidden_size=64, num_attention_heads=3, num_key_value_heads=1, head_dim=16, moe_intermediate_size=32,
        intermediate_size=48, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], num_hidden_layers=2,
        tie_word_embeddings=False), with_tokenizer=False)
    loaded, planned, weights = _loaded_and_planned(path)
    assert weights["layers.0.o_proj"].dtype is torch.bfloat16 and weights["layers.0.w2"].dtype is torch.bfloat16
    assert weights["layers.1.w2"].kind == weights["layers.0.qkv"].kind == weights["lm_head"].kind == "int4"
    assert loaded == planned


def test_plan_int4_counts_a_tied_heads_int4_copy(tmp_path):
    """A tied LM head: the embedding stays bfloat16 for its lookup and the head is its own int4 copy."""
    from tests.helpers.checkpoints import make_checkpoint

    path, _ = make_checkpoint(tmp_path / "tied", "qwen3", dict(hidden_size=64, intermediate_size=96,
                                                                 num_hidden_layers=2, tie_word_embeddings=True),
                              with_tokenizer=False)
    loaded, planned, weights = _loaded_and_planned(path)
    assert weights["embed"].dtype is torch.bfloat16 and weights["lm_head"].kind == "int4"
    assert loaded == planned
    bf16, = plan_layouts(parse_model(*load_config(path)), 1, GPU_PRESETS["h100"], dtype="bf16")
    int4, = plan_layouts(parse_model(*load_config(path)), 1, GPU_PRESETS["h100"], dtype="int4")
    # batch-1 decode reads the int4 copy as the LM head, not the bfloat16 embedding (384 x 64 both)
    head_int4, head_bf16 = 384 * 64 // 2 + 4 * 384 * 2, 2 * 384 * 64
    assert bf16.weight_read_bytes - head_bf16 > int4.weight_read_bytes - head_int4


def test_plan_int4_keeps_an_fp8_checkpoints_mla_projections(tmp_path):
    """Kimi-K2's FP8 release as the kimi-k2 profile loads it (`quantization: int4` on a GPU, which keeps fp8 blocks):
    q_a / q_b / kv_a / kv_b stay fp8, o_proj, experts, shared expert, dense MLP and LM head become int4."""
    from tests.helpers.checkpoints import make_checkpoint, store_as_fp8
    from tsterm.plan import SHIPPED_CONFIGS

    path, _ = make_checkpoint(tmp_path / "kimi", "kimi_k2", dict(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16), with_tokenizer=False)
    store_as_fp8(path, json.loads((SHIPPED_CONFIGS / "kimi-k2.json").read_text())["quantization_config"])
    loaded, planned, weights = _loaded_and_planned(path, keep_fp8=True)
    assert weights["layers.0.kv_b"].kind == "fp8" and weights["layers.0.o_proj"].kind == "int4"
    assert loaded == planned


def test_int4_matrix_bytes_are_the_kernels_format():
    from tsterm_kernels.quant import quantize_int4

    assert Tensor("experts", 96, 64, 1, 1).bytes("int4") == quantize_int4(torch.randn(96, 64)).nbytes == 3840
    assert Tensor("attention", 96, 48, 1, 1).bytes("int4") == 2 * 96 * 48  # inputs not whole blocks: bfloat16
    assert Tensor("lm_head", 96, 64, 1, 1, quantized=False, int4="q4_1").bytes("int4") == 3840
    assert Tensor("lm_head", 96, 64, 1, 1, quantized=False, int4="q4_1", int4_only=True).bytes("bf16") == 0

"""config.json of the hybrid families: the layer mix from `layer_types` or `full_attention_interval`, the Gated
DeltaNet geometry, a partial rotary factor (refused for the other families), and a multimodal release's
`text_config`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tsterm.config import ModelConfig
from tsterm.errors import ModelLoadError

QWEN35_397B = Path(__file__).parents[2] / "tsterm" / "models" / "configs" / "qwen3.5-397b-a17b.json"

NEXT = dict(model_type="qwen3_next", vocab_size=100, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, partial_rotary_factor=0.25)


def test_the_layer_mix_defaults_to_every_fourth_layer_full_attention():
    cfg = ModelConfig.from_dict(NEXT)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 2
    assert ModelConfig.from_dict(dict(NEXT, full_attention_interval=2)).layer_types == \
        ("linear_attention", "full_attention") * 3
    assert cfg.rotary_dim == 4 and cfg.linear_num_value_heads == 4 and cfg.linear_conv_kernel_dim == 4


def test_the_multimodal_release_runs_its_text_config():
    cfg = ModelConfig.from_dict(json.loads(QWEN35_397B.read_text()), source="config.json")
    assert cfg.model_type == "qwen3_5_moe" and cfg.source == "config.json (text_config)"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (60, 4096, 512, 10)
    assert cfg.layer_types.count("full_attention") == 15 and cfg.layer_types[3] == "full_attention"
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 64, 128)
    assert cfg.rotary_dim == 64  # 0.25 of head_dim 256
    with pytest.raises(ModelLoadError, match="needs a `text_config` object"):
        ModelConfig.from_dict({"model_type": "qwen3_5_moe"})


def test_bad_hybrid_fields_name_the_field():
    with pytest.raises(ModelLoadError, match="linear-attention layers need a positive linear_conv_kernel_dim, got 0"):
        ModelConfig.from_dict(dict(NEXT, linear_conv_kernel_dim=0))
    with pytest.raises(ModelLoadError, match=r"linear_num_value_heads \(3\) is not a multiple of linear_num_key_heads"):
        ModelConfig.from_dict(dict(NEXT, linear_num_value_heads=3))
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 1.5 is not supported \(in \(0, 1\]\)"):
        ModelConfig.from_dict(dict(NEXT, partial_rotary_factor=1.5))


def test_other_families_still_refuse_a_partial_rotary_factor():
    qwen3 = dict(model_type="qwen3_moe", vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 partial_rotary_factor=0.5)
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0.5 is not supported \(only 1.0\)"):
        ModelConfig.from_dict(qwen3)

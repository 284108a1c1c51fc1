"""Layer types: the spec says what each layer is, the cache is one pool per mixer kind behind one interface."""
from __future__ import annotations

import json

import pytest
import torch

from tsterm import LLM
from tsterm.config import ModelConfig
from tsterm.errors import ModelLoadError
from tsterm.model.arch import ARCHITECTURES, LayerType
from tsterm.model.cache import ModelCache, PagedKVPool

from tests.helpers.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def sparse_step(tmp_path_factory):
    """Qwen3-MoE with a dense layer from `decoder_sparse_step` (layer 0) and one from `mlp_only_layers` (layer 3)."""
    path, _ = make_checkpoint(tmp_path_factory.mktemp("layer_types") / "m", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3],
                                   num_hidden_layers=4))
    return path


def test_the_spec_names_each_layers_mixer_and_feed_forward(sparse_step):
    cfg = ModelConfig.from_dir(sparse_step)
    assert ARCHITECTURES["qwen3_moe"].layer_types(cfg) == (
        LayerType("full_attention", "dense"), LayerType("full_attention", "moe"),
        LayerType("full_attention", "dense"), LayerType("full_attention", "dense"))
    model = LLM(str(sparse_step), dtype="float32", device="cpu", num_kv_blocks=8).engine.executor.model
    assert [mlp.router is not None for *_, mlp in model.layers] == [False, True, False, False]


def rewrite_config(path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def test_layer_types_from_config_json_are_checked_before_any_weight_is_read(tmp_path):
    path, _ = make_checkpoint(tmp_path / "m", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                                 num_hidden_layers=2), with_tokenizer=False)
    rewrite_config(path, layer_types=["full_attention", "full_attention"])
    assert ModelConfig.from_dir(path).layer_types == ("full_attention", "full_attention")

    rewrite_config(path, layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ModelLoadError, match=r"config.json: layer 1 is 'linear_attention', which qwen3_moe does not "
                                             r"support \(supported layer types: full_attention\)"):
        ModelConfig.from_dir(path)

    rewrite_config(path, layer_types=["full_attention"])
    with pytest.raises(ModelLoadError, match="'layer_types' must be a list of 2 strings"):
        ModelConfig.from_dir(path)


def test_the_cache_routes_each_layer_to_views_of_its_pool(sparse_step):
    cfg = ModelConfig.from_dir(sparse_step)
    layer_types = ARCHITECTURES[cfg.model_type].layer_types(cfg)
    cache = ModelCache(cfg, layer_types, num_blocks=6, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    pool = cache.pools["full_attention"]
    assert isinstance(pool, PagedKVPool) and list(cache.pools) == ["full_attention"]
    assert pool.kv.shape == (4, 2, 6, 4, cfg.num_key_value_heads, cfg.head_dim)
    for layer in range(4):
        k, v = cache.layer(layer)
        assert k.untyped_storage().data_ptr() == pool.kv.untyped_storage().data_ptr()  # a view, never a copy
        k.fill_(layer + 1)
        v.fill_(-(layer + 1))
    assert [pool.kv[i, 0].unique().tolist() for i in range(4)] == [[1.0], [2.0], [3.0], [4.0]]
    per_block = ModelCache.bytes_per_block(cfg, layer_types, 4, torch.float32)
    assert per_block * 6 == pool.kv.numel() * pool.kv.element_size()

    pool.kv[:, :, 2] = 7.0
    assert cache.copy_blocks([(2, 5)]) == per_block  # bytes copied: one block over every layer, K and V
    assert (pool.kv[:, :, 5] == 7.0).all() and cache.copy_blocks([]) == 0

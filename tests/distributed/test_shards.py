"""Each rank's weights are exactly its slice of the one-rank weights (in one process, no workers), and the layout
maps query heads to the KV heads they read, replicating KV heads when there are fewer than tensor-parallel ranks."""
from __future__ import annotations

import pytest
import torch

from tsterm.config import ModelConfig
from tsterm.errors import ConfigError
from tsterm.model.loader import load_weights
from tsterm.model.parallel import ParallelLayout

from tests.helpers.checkpoints import make_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("shards") / "qwen2_moe", "qwen2_moe",
                              dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                                   num_hidden_layers=1, vocab_size=387), with_tokenizer=False)
    return path, ModelConfig.from_dir(path)


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2)])
def test_every_rank_holds_its_slice_of_the_weights(checkpoint, tp, ep):
    path, cfg = checkpoint
    full = load_weights(path, cfg, torch.float32, CPU)
    H, D, I, E = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size, cfg.num_experts
    q_total, kv_total = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    for rank in range(tp * ep):
        layout = ParallelLayout(tp, ep, rank)
        w = load_weights(path, cfg, torch.float32, CPU, layout=layout)
        v0, nv, _ = layout.vocab(cfg.vocab_size)
        assert torch.equal(w["embed"], full["embed"][v0:v0 + nv])
        assert torch.equal(w["lm_head"], full["lm_head"][v0:v0 + nv])
        (q0, nq), (k0, nk) = layout.q_heads(cfg), layout.kv_heads(cfg)
        qkv = full["layers.0.qkv"]
        want = torch.cat([qkv[q0 * D:(q0 + nq) * D], qkv[q_total + k0 * D:q_total + (k0 + nk) * D],
                          qkv[q_total + kv_total + k0 * D:q_total + kv_total + (k0 + nk) * D]])
        assert torch.equal(w["layers.0.qkv"], want)
        assert torch.equal(w["layers.0.o_proj"], full["layers.0.o_proj"][:, q0 * D:(q0 + nq) * D])
        e0, ne = layout.experts(E)
        i0, ni = layout.tp_rank * I // tp, I // tp
        w13 = full["layers.0.w13"][e0:e0 + ne]
        assert torch.equal(w["layers.0.w13"], torch.cat([w13[:, i0:i0 + ni], w13[:, I + i0:I + i0 + ni]], dim=1))
        assert torch.equal(w["layers.0.w2"], full["layers.0.w2"][e0:e0 + ne, :, i0:i0 + ni])
        s = cfg.shared_expert_intermediate_size // (tp * ep)  # the shared expert: split over every rank
        shared = full["layers.0.shared_w13"][0]
        assert torch.equal(w["layers.0.shared_w13"][0],
                           torch.cat([shared[rank * s:(rank + 1) * s], shared[24 + rank * s:24 + (rank + 1) * s]]))
        assert torch.equal(w["layers.0.shared_w2"][0], full["layers.0.shared_w2"][0][:, rank * s:(rank + 1) * s])
        assert torch.equal(w["layers.0.router"], full["layers.0.router"])  # every rank routes every token


def config(heads: int, kv_heads: int) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 64,
                                  "num_hidden_layers": 1, "num_attention_heads": heads,
                                  "num_key_value_heads": kv_heads, "head_dim": 16, "intermediate_size": 32,
                                  "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 16})


def test_kv_heads_split_or_replicate_with_the_query_heads_that_read_them():
    cfg = config(8, 4)
    assert [ParallelLayout(2, 1, r).kv_heads(cfg) for r in range(2)] == [(0, 2), (2, 2)]
    cfg = config(8, 2)  # 4 ranks, 2 KV heads: ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    assert [ParallelLayout(4, 1, r).q_heads(cfg) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [ParallelLayout(4, 1, r).kv_heads(cfg) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ConfigError, match="3 KV heads; the KV heads split only when"):  # 2 ranks, 3 KV heads
        ParallelLayout(2, 1, 0).check(config(12, 3))
    with pytest.raises(ConfigError, match="6 attention heads, not a multiple of 4"):
        ParallelLayout(4, 1, 0).check(config(6, 2))


def test_the_fused_expert_layout_shards_alike(checkpoint, tmp_path):
    """transformers 5 saves experts stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]): the
    shards come out the same as from per-expert tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, cfg = checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    fused = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            fused[name] = tensor
    prefix = "model.layers.0.mlp.experts."
    E = cfg.num_experts
    fused[prefix + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{prefix}{x}.gate_proj.weight"],
                                                             tensors[f"{prefix}{x}.up_proj.weight"]]) for x in range(E)])
    fused[prefix + "down_proj"] = torch.stack([tensors[f"{prefix}{x}.down_proj.weight"] for x in range(E)])
    shutil.copy(path / "config.json", tmp_path / "config.json")
    save_file(fused, str(tmp_path / "model.safetensors"))
    for layout in (ParallelLayout(2, 1, 1), ParallelLayout(1, 2, 1), ParallelLayout(2, 2, 2)):
        want = load_weights(path, cfg, torch.float32, CPU, layout=layout)
        got = load_weights(tmp_path, cfg, torch.float32, CPU, layout=layout)
        for name in ("layers.0.w13", "layers.0.w2"):
            assert torch.equal(got[name], want[name]), (layout, name)


def test_what_tensor_or_expert_parallelism_cannot_split_yet_is_refused_by_name():
    olmoe = ModelConfig.from_dict({"model_type": "olmoe", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 1,
                                   "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 32,
                                   "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(ConfigError, match="olmoe normalises q and k over all heads.*use expert_parallel_size"):
        ParallelLayout(2, 1, 0).check(olmoe)
    ParallelLayout(1, 2, 0).check(olmoe)  # its experts split
    dense = ModelConfig.from_dict({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 1,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                   "intermediate_size": 32, "max_position_embeddings": 64})
    with pytest.raises(ConfigError, match="is dense \\(no experts\\); use tensor_parallel_size"):
        ParallelLayout(1, 2, 0).check(dense)
    ParallelLayout(2, 1, 0).check(dense)

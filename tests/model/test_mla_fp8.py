"""A block-scaled FP8 DeepSeek-V3 checkpoint (every projection e4m3 with a 128 x 128 `weight_scale_inv`, as DeepSeek
ships V3 / R1 and Moonshot Kimi-K2) loaded as on a CUDA device (`keep_fp8`): the MLA matrices stay fp8 too (q_a,
q_b, kv_a with its interleaved RoPE rows reordered inside their block, kv_b, o_proj), each exactly the dequantized
load's values; a reordering that would move a row across a 128-row block dequantizes that matrix instead. The kept
model, run by the Triton kernels (interpreted: the fp8 linear and the MLA kernel), gives the dequantized load's greedy
tokens on the torch kernels."""
from __future__ import annotations

import functools

import pytest
import torch
from tsterm_kernels import quant
from tsterm_kernels.quant import QuantizedWeight

from tsterm import LLM, SamplingParams
from tsterm.config import ModelConfig
from tsterm.engine import model_runner
from tsterm.model.loader import load_weights

from tests.helpers.checkpoints import make_checkpoint, store_as_fp8

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MLA_MATRICES = ("q_a", "q_b", "kv_a", "kv_b", "o_proj")
BASE = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            n_shared_experts=1, q_lora_rank=20, kv_lora_rank=24, qk_rope_head_dim=8, v_head_dim=10,
            num_hidden_layers=2)


def fp8_checkpoint(path, overrides: dict):
    """A random deepseek_v3 checkpoint rewritten as DeepSeek's FP8 releases store it. Returns (path, config, the
    stored tensors)."""
    path, _ = make_checkpoint(path, "deepseek_v3", dict(BASE, **overrides))
    tensors = store_as_fp8(path)
    return path, ModelConfig.from_dir(path), tensors


@pytest.fixture(scope="module")
def in_blocks(tmp_path_factory):
    """5 heads of 12 + 8 query dims: q_b's 100 rows in one block, every RoPE row reordered inside it."""
    return fp8_checkpoint(tmp_path_factory.mktemp("mla_fp8") / "m", dict(num_attention_heads=5,
                                                                        num_key_value_heads=5, qk_nope_head_dim=12))


def _assert_stands_for(kept: dict, dequantized: dict) -> None:
    assert kept.keys() == dequantized.keys()
    for name, weight in kept.items():
        got = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
        assert torch.equal(got, dequantized[name]), name


def test_the_mla_matrices_stay_fp8_with_their_rope_rows_reordered(in_blocks):
    path, cfg, stored = in_blocks
    assert cfg.rope_interleave  # DeepSeek's layout: the loader reorders q_b's and kv_a's RoPE rows
    dequantized = load_weights(path, cfg, torch.float32, torch.device("cpu"))  # the CPU's load: floats
    kept = load_weights(path, cfg, torch.float32, torch.device("cpu"), keep_fp8=True)  # as on a CUDA device
    for i in range(cfg.num_hidden_layers):
        for name in MLA_MATRICES:
            weight = kept[f"layers.{i}.{name}"]
            assert isinstance(weight, QuantizedWeight) and weight.kind == "fp8", (i, name)
            assert not isinstance(dequantized[f"layers.{i}.{name}"], QuantizedWeight)
    kv_a = kept["layers.1.kv_a"]  # [24 latent + 8 RoPE rows, 32]: the RoPE rows' bytes in rotate-half order
    raw = stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].view(torch.uint8)
    order = torch.cat((torch.arange(24), 24 + torch.arange(0, 8, 2), 24 + torch.arange(1, 8, 2)))
    assert torch.equal(kv_a.data.view(torch.uint8), raw[order])
    assert not torch.equal(kv_a.data.view(torch.uint8), raw)  # (the reordering is not the identity)
    assert torch.equal(kv_a.scale, stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"])
    _assert_stands_for(kept, dequantized)


def test_a_reordering_across_a_128_row_block_dequantizes_that_matrix(tmp_path):
    """6 heads of 14 + 8 query dims: head 5's RoPE rows are q_b's rows 124..131, across the first block's edge."""
    path, cfg, _ = fp8_checkpoint(tmp_path / "m", dict(num_attention_heads=6, num_key_value_heads=6,
                                                       qk_nope_head_dim=14))
    dequantized = load_weights(path, cfg, torch.float32, torch.device("cpu"))
    kept = load_weights(path, cfg, torch.float32, torch.device("cpu"), keep_fp8=True)
    assert isinstance(kept["layers.0.q_b"], torch.Tensor)  # dequantized, as without keep_fp8
    assert all(kept[f"layers.0.{name}"].kind == "fp8" for name in ("q_a", "kv_a", "kv_b", "o_proj"))
    _assert_stands_for(kept, dequantized)


def test_the_kept_model_through_the_triton_kernels_gives_the_dequantized_tokens(in_blocks, monkeypatch):
    path, cfg, _ = in_blocks
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (9, 4, 70)]  # 70: expanded (kv_b)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    options = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, deterministic=False)
    want = LLM(str(path), **options).generate(prompts, params)

    weights = []
    monkeypatch.setattr(model_runner, "load_weights", functools.partial(load_weights, keep_fp8=True))
    monkeypatch.setattr(quant, "runs_on_triton", lambda x, weight: weights.append(weight) or True)
    got = LLM(str(path), kernels="triton", **options).generate(prompts, params)
    assert weights and {w.kind for w in weights} == {"fp8"}
    H = cfg.hidden_size
    mla_shapes = {(20, H), (5 * 20, 20), (24 + 8, H), (5 * 22, 24), (H, 5 * 10)}  # q_a, q_b, kv_a, kv_b, o_proj
    assert mla_shapes <= {tuple(w.shape) for w in weights}  # the MLA projections through the fp8 linear
    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor([s["logprob"] for s in ours.outputs[0].logprobs]),
                                   torch.tensor([s["logprob"] for s in theirs.outputs[0].logprobs]),
                                   atol=1e-5, rtol=1e-4)

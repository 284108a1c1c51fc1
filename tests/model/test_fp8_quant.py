"""The "fp8" QuantizedWeight (float8_e4m3fn values, a float32 scale per 128 x 128 block) and `quantization: fp8`.

fp8 is a GPU format here: the Triton kernel reads it (tests/kernels/test_triton_quant_linear.py); on the CPU it is
refused as a quantization mode (no kernel), though an fp8 weight still computes there, dequantized per call. The
GPU side of `quantize_weights` runs here on the "meta" device (any device but the CPU takes that branch).
"""
from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tsterm_kernels import quant
from tsterm_kernels import triton_quant_linear as tql
from tsterm_kernels.quant import FP8_BLOCK, QuantizedWeight, quantize_fp8

from tsterm import LLM, SamplingParams
from tsterm.config import EngineConfig, ModelConfig
from tsterm.engine import model_runner
from tsterm.errors import ConfigError
from tsterm.model.loader import WeightSource, load_weights
from tsterm.model.quant import quantize, quantize_weights
from tsterm.profiles import load_profile

from tests.helpers.checkpoints import make_checkpoint


def _block_scale_per_weight(scale: torch.Tensor, out_f: int, in_f: int) -> torch.Tensor:
    """[O/128, I/128] -> [O, I] by explicit block indices (not the implementation's repeat_interleave)."""
    rows = torch.arange(out_f) // FP8_BLOCK
    cols = torch.arange(in_f) // FP8_BLOCK
    return scale[rows[:, None], cols[None, :]]


def test_quantize_fp8_rounds_each_weight_to_its_block_grid():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 300, generator=gen) * torch.rand(200, 1, generator=gen) * 3
    weight[128:, 256:] = 0  # an all-zero (partial) block
    q = quantize_fp8(weight)
    assert q.kind == "fp8" and q.shape == (200, 300) and q.data.dtype == torch.float8_e4m3fn
    assert q.scale.dtype == torch.float32 and q.scale.shape == (2, 3)  # partial blocks at the right and bottom
    for i in range(2):
        for j in range(3):
            block = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            assert q.scale[i, j] == weight[block].abs().max() / 448  # amax / 448, the checkpoint convention
            if q.scale[i, j] > 0:
                assert q.data[block].float().abs().max() == 448  # each block's largest weight uses the range
    assert q.scale[1, 2] == 0 and not q.dequantize()[128:, 256:].any()
    per_weight = _block_scale_per_weight(q.scale, 200, 300)
    err = (q.dequantize() - weight).abs()
    # e4m3: 3 mantissa bits (half a step: 1/16 of the value), subnormal steps of 2^-9 below 2^-6
    bound = per_weight * torch.maximum(weight.abs() / per_weight.clamp_min(1e-30) / 16, torch.tensor(2.0 ** -10))
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()
    assert err.max() > 0  # lossy: the bound above is not vacuous


def test_dequantize_is_each_value_times_its_block_scale():
    gen = torch.Generator().manual_seed(1)
    values = (torch.randn(3, 130, 257, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, 3, generator=gen) + 0.01
    q = QuantizedWeight.fp8(values, scale)
    for e in range(3):
        want = values[e].float() * _block_scale_per_weight(scale[e], 130, 257)
        assert torch.equal(q.dequantize()[e], want)
        assert torch.equal(q[e].dequantize(), want)


def test_fp8_constructor_checks_the_layout():
    values = torch.zeros(130, 200).to(torch.float8_e4m3fn)
    assert QuantizedWeight.fp8(values, torch.ones(2, 2)).shape == (130, 200)
    with pytest.raises(ValueError, match="float8_e4m3fn values"):
        QuantizedWeight.fp8(torch.zeros(130, 200, dtype=torch.float16), torch.ones(2, 2))
    with pytest.raises(ValueError, match="float8_e4m3fn values"):
        QuantizedWeight.fp8(torch.zeros(200).to(torch.float8_e4m3fn), torch.ones(2))
    with pytest.raises(ValueError, match=r"float32 scales of shape \(2, 2\)"):
        QuantizedWeight.fp8(values, torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"float32 scales of shape \(2, 2\)"):
        QuantizedWeight.fp8(values, torch.ones(2, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp8: QuantizedWeight.fp8"):
        QuantizedWeight.blocks("fp8", values, torch.ones(2, 2))


def test_a_stack_is_indexed_in_place_cloned_and_counted():
    gen = torch.Generator().manual_seed(2)
    stack = quantize_fp8(torch.randn(3, 130, 70, generator=gen))
    assert stack.scale.shape == (3, 2, 1) and stack.nbytes == 3 * 130 * 70 * 1 + 3 * 2 * 1 * 4
    expert = stack[1]
    assert expert.shape == (130, 70) and expert.scale.shape == (2, 1)
    assert expert.data.data_ptr() == stack.data[1].data_ptr() and expert.scale.data_ptr() == stack.scale[1].data_ptr()
    copy = stack.clone()
    assert torch.equal(copy.dequantize(), stack.dequantize()) and copy.data.data_ptr() != stack.data.data_ptr()
    copy.scale.mul_(2)
    assert not torch.equal(copy.dequantize(), stack.dequantize())  # independent storage


def test_fp8_weights_compute_on_the_cpu_dequantized():
    gen = torch.Generator().manual_seed(3)
    q = quantize_fp8(torch.randn(40, 200, generator=gen))
    x, bias = torch.randn(3, 200, generator=gen), torch.randn(40, generator=gen)
    assert not quant.runs_on_triton(x, q)
    torch.testing.assert_close(quant.quantized_linear(x, q, bias), F.linear(x, q.dequantize(), bias))
    # the C kernels' dequantize is for int8 / int4 codes: an fp8 weight never reaches it
    assert torch.equal(quant.dequantize(q, object()), q.dequantize())


def test_quantize_mode_fp8_takes_any_shape():
    weight = torch.randn(5, 48)  # inputs not a multiple of 32: int8 leaves it float, fp8 does not
    assert isinstance(quantize(weight, "int8"), torch.Tensor)
    q = quantize(weight, "fp8")
    assert isinstance(q, QuantizedWeight) and q.kind == "fp8" and q.scale.shape == (1, 1)


def test_the_option_accepts_fp8_for_a_gpu_only(tmp_path):
    assert EngineConfig(model="m", quantization="fp8").quantization == "fp8"
    assert EngineConfig(model="m", quantization="fp8", device="cuda:1").quantization == "fp8"
    with pytest.raises(ConfigError, match="fp8 runs on a GPU only.*on the CPU use int8 or int4"):
        EngineConfig(model="m", quantization="fp8", device="cpu")
    with pytest.raises(ConfigError, match="fp16 runs on the CPU only.*on a GPU use int8, int4 or fp8"):
        EngineConfig(model="m", quantization="fp16", device="cuda")
    with pytest.raises(ConfigError, match="or int8, int4 or fp8 \\(GPU\\), got 'fp4'"):
        EngineConfig(model="m", quantization="fp4")
    profile = tmp_path / "q.yaml"
    profile.write_text("model: some/dir\nquantization: fp8\n")
    assert load_profile(str(profile)).engine_options()["quantization"] == "fp8"


@pytest.fixture(scope="module")
def moe_weights(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("fp8q") / "m", "qwen2_moe",
                              dict(num_experts=3, num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                   num_hidden_layers=2, hidden_size=64, head_dim=16, moe_intermediate_size=32),
                              with_tokenizer=False)
    return path, ModelConfig.from_dir(path)


def test_fp8_is_refused_on_the_cpu(moe_weights):
    path, cfg = moe_weights
    weights = load_weights(path, cfg, torch.float32, torch.device("cpu"))
    with pytest.raises(ConfigError, match="fp8 has no CPU kernel.*use quantization: int8 or int4"):
        quantize_weights(weights, "fp8")
    assert not any(isinstance(w, QuantizedWeight) for w in weights.values())  # refused before touching any
    with pytest.raises(ConfigError, match="fp8 runs on a GPU only"):  # before the load, when the device is known
        LLM(str(path), device="cpu", quantization="fp8")


def _on_meta(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    moved = {}
    for name, w in weights.items():
        same = next((moved[n] for n in moved if weights[n] is w), None)  # a tied head stays tied
        if same is None:
            same = (QuantizedWeight.fp8(w.data.to("meta"), w.scale.to("meta")) if isinstance(w, QuantizedWeight)
                    else w.to("meta"))
        moved[name] = same
    return moved


@pytest.mark.parametrize("mode", ["fp8", "int8", "int4"])
def test_on_a_gpu_every_linear_matrix_is_quantized(moe_weights, mode):
    path, cfg = moe_weights
    weights = quantize_weights(_on_meta(load_weights(path, cfg, torch.float32, torch.device("cpu"))), mode)
    quantized = {n for n, w in weights.items() if isinstance(w, QuantizedWeight)}
    assert {weights[n].kind for n in quantized} == {mode}
    for i in range(cfg.num_hidden_layers):
        # the routed and shared experts too: the Triton fused MoE reads quantized stacks
        assert {f"layers.{i}.{n}" for n in ("qkv", "o_proj", "w13", "w2", "shared_w13", "shared_w2")} <= quantized
        assert weights[f"layers.{i}.w13"].shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert "lm_head" in quantized and isinstance(weights["embed"], torch.Tensor)
    with pytest.raises(ConfigError, match="fp16 runs on the CPU only.*use quantization: int8, int4 or fp8"):
        quantize_weights(_on_meta(load_weights(path, cfg, torch.float32, torch.device("cpu"))), "fp16")


# ---- an FP8 block-scaled checkpoint kept as fp8 weights (what a CUDA device loads)

@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A dense model whose projections are stored as Qwen's FP8 releases store them (e4m3 + 128 x 128 scale_inv):
    q/k/v of 128 rows each (they fuse as blocks), gate/up of 200 rows (they cannot), down_proj with a partial block
    of inputs; embedding, LM head and norms stay float32."""
    path, _ = make_checkpoint(tmp_path_factory.mktemp("fp8ckpt") / "m", "llama", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=200,
        num_hidden_layers=2))
    return _store_as_fp8(path)


def _store_as_fp8(path):
    """Rewrite a saved checkpoint as Qwen's FP8 releases store it: every projection e4m3 + its 128 x 128
    `weight_scale_inv`, and the quantization_config that says so. Returns (path, its ModelConfig)."""
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        q = quantize_fp8(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = q.data, q.scale
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    return path, ModelConfig.from_dir(path)


def _assert_stands_for(kept: dict, dequantized: dict) -> None:
    """Every kept weight (fp8 blocks or float) is exactly the dequantized load's."""
    for name, weight in kept.items():
        got = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
        assert torch.equal(got, dequantized[name]), name


def _kept_through_the_kernels_matches_the_dequantized_load(path, monkeypatch, seed: int, max_tokens: int) -> None:
    """The checkpoint loaded as on a CUDA device (fp8 kept) and run by the Triton kernels, interpreted, against the
    CPU's dequantized load through the torch kernels: same greedy tokens, logprobs within float32 summation order."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (9, 4)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    options = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=32)
    want = LLM(str(path), **options).generate(prompts, params)

    monkeypatch.setattr(model_runner, "load_weights", functools.partial(load_weights, keep_fp8=True))
    monkeypatch.setattr(quant, "runs_on_triton", lambda x, weight: True)  # the Triton kernels, interpreted
    got = LLM(str(path), kernels="triton", **options).generate(prompts, params)

    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor([s["logprob"] for s in ours.outputs[0].logprobs]),
                                   torch.tensor([s["logprob"] for s in theirs.outputs[0].logprobs]),
                                   atol=1e-5, rtol=1e-4)


def test_a_kept_fp8_checkpoint_is_its_stored_blocks(fp8_checkpoint):
    path, cfg = fp8_checkpoint
    dequantized = load_weights(path, cfg, torch.float32, torch.device("cpu"))  # on the CPU: float, as before
    kept = load_weights(path, cfg, torch.float32, torch.device("cpu"), keep_fp8=True)  # as on a CUDA device
    assert not any(isinstance(w, QuantizedWeight) for w in dequantized.values())
    assert kept.keys() == dequantized.keys()
    qkv, o_proj, w13, w2 = (kept[f"layers.1.{n}"] for n in ("qkv", "o_proj", "w13", "w2"))
    assert qkv.kind == "fp8" and qkv.shape == (384, 128) and qkv.scale.shape == (3, 1)  # fused as blocks
    assert o_proj.kind == "fp8" and w2.kind == "fp8" and w2.shape == (1, 128, 200) and w2.scale.shape == (1, 1, 2)
    assert isinstance(w13, torch.Tensor)  # gate's 200 rows end mid-block: this fused matrix is dequantized
    stored = load_file(path / "model.safetensors")
    assert torch.equal(o_proj.data.view(torch.uint8),
                       stored["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8))  # the bytes as stored
    _assert_stands_for(kept, dequantized)


def test_a_kept_fp8_model_through_the_kernel_matches_the_dequantized_load(fp8_checkpoint, monkeypatch):
    launches = []
    kernel = tql.quant_linear
    monkeypatch.setattr(tql, "quant_linear", lambda *args: launches.append(args[1].kind) or kernel(*args))
    _kept_through_the_kernels_matches_the_dequantized_load(fp8_checkpoint[0], monkeypatch, seed=6, max_tokens=4)
    assert set(launches) == {"fp8"}


def test_quantizing_a_kept_fp8_model_starts_from_its_values(fp8_checkpoint):
    path, cfg = fp8_checkpoint
    kept = _on_meta(load_weights(path, cfg, torch.float32, torch.device("cpu"), keep_fp8=True))
    weights = quantize_weights(dict(kept), "int8")  # a GPU's branch
    assert weights["layers.0.qkv"].kind == "int8" and weights["layers.0.o_proj"].kind == "int8"
    assert weights["layers.0.w13"].kind == "int8"  # the float one too
    again = quantize_weights(dict(kept), "fp8")
    assert again["layers.0.qkv"] is kept["layers.0.qkv"]  # fp8 already: its stored blocks, not re-rounded
    assert again["layers.0.w13"].kind == "fp8" and again["layers.0.w13"] is not kept["layers.0.w13"]


def test_a_shard_keeps_fp8_only_on_whole_blocks(fp8_checkpoint):
    path, cfg = fp8_checkpoint
    files = [path / "model.safetensors"]
    kept = WeightSource(files, torch.float32, torch.device("cpu"), None, cfg.fp8_block_size, keep_fp8=True)
    floats = WeightSource(files, torch.float32, torch.device("cpu"), None, cfg.fp8_block_size)
    gate, down = "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"  # [200, 128], [128, 200]
    for name, shape, rows, cols in ((gate, (200, 128), (128, 72), None), (down, (128, 200), None, (128, 72)),
                                    (down, (128, 200), None, (0, 128))):
        weight = kept.weight(name, shape, rows=rows, cols=cols)
        assert isinstance(weight, QuantizedWeight) and weight.scale.shape == (1, 1)
        assert torch.equal(weight.dequantize(), floats.weight(name, shape, rows=rows, cols=cols))
    cut = kept.weight(gate, (200, 128), rows=(100, 100))  # cuts a block: dequantized, as without keep_fp8
    assert isinstance(cut, torch.Tensor) and torch.equal(cut, floats.weight(gate, (200, 128), rows=(100, 100)))


# ---- an FP8 MoE checkpoint: routed and shared experts kept as fp8 stacks, run by the Triton fused MoE

@pytest.fixture(scope="module")
def fp8_moe_checkpoint(tmp_path_factory):
    """A Qwen2-MoE (routed experts + a gated shared expert) stored as Qwen's FP8 releases store it, every projection
    e4m3 + 128 x 128 scale_inv: expert gate/up of 128 rows each (whole blocks: they fuse and stack as blocks)."""
    path, _ = make_checkpoint(tmp_path_factory.mktemp("fp8moe") / "m", "qwen2_moe", dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_experts=3,
        num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_hidden_layers=2))
    return _store_as_fp8(path)


def test_kept_fp8_experts_are_stacks_of_their_stored_blocks(fp8_moe_checkpoint):
    path, cfg = fp8_moe_checkpoint
    dequantized = load_weights(path, cfg, torch.float32, torch.device("cpu"))
    kept = load_weights(path, cfg, torch.float32, torch.device("cpu"), keep_fp8=True)  # as on a CUDA device
    stored = load_file(path / "model.safetensors")
    for i in range(cfg.num_hidden_layers):
        w13, w2 = kept[f"layers.{i}.w13"], kept[f"layers.{i}.w2"]
        assert w13.kind == w2.kind == "fp8" and w13.shape == (3, 256, 128) and w13.scale.shape == (3, 2, 1)
        assert w2.shape == (3, 128, 128) and w2.scale.shape == (3, 1, 1)
        shared = kept[f"layers.{i}.shared_w13"]
        assert shared.kind == "fp8" and shared.shape == (1, 256, 128)
        expert = f"model.layers.{i}.mlp.experts.2."
        assert torch.equal(w13.data[2, 128:].view(torch.uint8), stored[expert + "up_proj.weight"].view(torch.uint8))
        assert torch.equal(w13.scale[2, 1], stored[expert + "up_proj.weight_scale_inv"][0])
    _assert_stands_for(kept, dequantized)


def test_a_kept_fp8_moe_through_the_kernels_matches_the_dequantized_load(fp8_moe_checkpoint, monkeypatch):
    from tsterm_kernels import triton_fused_moe

    kinds = []
    weight_args = triton_fused_moe._weight_args
    monkeypatch.setattr(triton_fused_moe, "_weight_args", lambda w, name: kinds.append(w.kind) or weight_args(w, name))
    _kept_through_the_kernels_matches_the_dequantized_load(fp8_moe_checkpoint[0], monkeypatch, seed=7, max_tokens=3)
    assert kinds and set(kinds) == {"fp8"}  # routed and shared experts, read as fp8 stacks

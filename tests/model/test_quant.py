"""Weight-only int8 / int4 models (`quantization`) against float models whose weights are the dequantized weights.

The reference checkpoint holds, for every matrix tsterm quantizes, `quantize(w).dequantize()` in float32, so both
models compute with the same effective weights. With the C kernels turned off, every quantized matmul is the float
matmul of the dequantized weight: the quantized model must pick the same greedy tokens and give the same
log-probabilities up to float32 reassociation; the float model of the original weights is the control (quantization
error is far larger than the tolerance, so the test sees which model it ran). With the C kernels (the default), every
int8 / int4 matmul also rounds each activation to int8 per block of 32, as llama.cpp does: that model must equal the
same model run with the oracle `int8_rows_matmul` (the kernels' arithmetic in float64) in place of the C kernels.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tsterm_kernels import cpu_native, torch_ops
from tsterm_kernels.quant import QuantizedWeight, quantized_linear

from tsterm import LLM, SamplingParams, launch
from tsterm import cli
from tsterm.cli import build_parser
from tsterm.config import EngineConfig, ModelConfig
from tsterm.errors import ConfigError
from tsterm.model.hybrid_loader import load_hybrid_weights
from tsterm.model.loader import load_weights
from tsterm.model.quant import quantize, quantize_weights, weight_bytes
from tsterm.profiles import load_profile

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint
from tests.kernels.oracles import int8_rows_matmul

# Shapes int4 takes everywhere (inputs multiples of 32, outputs of 16), so every matrix really is int4.
SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, head_dim=16)
CASES = {"qwen3_moe": dict(SIZES, num_experts=4, num_experts_per_tok=2), "llama": SIZES,
         "qwen3_next": {}}  # a hybrid (Gated DeltaNet + gated attention + shared expert) at the helpers' sizes
OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
NEW_TOKENS = 12
# Max |difference| of log-probabilities (and of the last logits, relative to their largest) allowed between a
# quantized model and its dequantized float twin. Both run the same weights in float32; only the summation order
# differs (the quantized kernels vs MKL), a few float32 ulps per dot product that three layers grow to ~1e-6 on these
# O(1) values (measured: <= 3.1e-6 for log-probs, <= 1e-6 relative for logits). Quantization itself moves them by
# more than 10x this (fp16, the smallest: 4e-4 relative on the logits; int8 / int4: 1e-2 to 1), the controls below.
TOLERANCE = 2e-5


def _is_quantized_in_tsterm(name: str, tensor: torch.Tensor) -> bool:
    """The HF tensors that become the matrices tsterm.model.quant quantizes (not the router, norms, conv, gates)."""
    return tensor.dim() >= 2 and not name.endswith(("embed_tokens.weight", "mlp.gate.weight", "conv1d.weight",
                                                    "shared_expert_gate.weight"))


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    model_type = request.param
    make = make_hybrid_checkpoint if model_type == "qwen3_next" else make_checkpoint
    path, _ = make(tmp_path_factory.mktemp(model_type) / "float", model_type, CASES[model_type])
    return model_type, path


def _dequantized_twin(src: Path, dst: Path, mode: str) -> Path:
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({name: quantize(t, mode).dequantize() if _is_quantized_in_tsterm(name, t) else t
                   for name, t in tensors.items()}, file)
    return dst


def _c_kernels_twin(x, weight, bias=None):
    """quantized_linear with the oracle `int8_rows_matmul` where the C kernels would run (int8 / int4: every number of rows)."""
    if weight.kind == "fp16":
        return quantized_linear(x, weight, bias)
    y = int8_rows_matmul(x, weight).to(x.dtype)
    return y if bias is None else y + bias


def _generate(model_dir: Path, prompts: list[list[int]], **options) -> list:
    llm = LLM(str(model_dir), **OPTIONS, **options)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate(prompts, params)


def _logprobs(out) -> torch.Tensor:
    """The chosen token's log-probability at each step: [new]."""
    return torch.cat([torch.tensor(step["logprob"]).reshape(1) for step in out.outputs[0].logprobs])


def _last_logits(model_dir: Path, prompt: list[int], **options) -> torch.Tensor:
    """The whole [V] float32 logits row after a prompt (one prefill step)."""
    engine = LLM(str(model_dir), **OPTIONS, **options).engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    return engine.executor.execute(engine.scheduler.schedule())[0]


@pytest.mark.parametrize("mode", ["fp16", "int8", "int4"])
def test_quantized_model_generates_like_its_dequantized_float_twin(checkpoint, tmp_path, mode, monkeypatch):
    model_type, float_dir = checkpoint
    twin_dir = _dequantized_twin(float_dir, tmp_path / "twin", mode)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (9, 17)]
    with_c_kernels = _generate(float_dir, prompts, quantization=mode)
    monkeypatch.setattr(cpu_native, "load", lambda: None)  # every quantized matmul: dequantized weight, float GEMM
    quantized = _generate(float_dir, prompts, quantization=mode)
    logits = [_last_logits(d, prompts[1], **o) for d, o in ((float_dir, dict(quantization=mode)), (twin_dir, {}),
                                                              (float_dir, {}))]
    monkeypatch.setattr(torch_ops, "quantized_linear", _c_kernels_twin)
    monkeypatch.setattr(torch_ops, "decode_stack", lambda *args: None)  # its matmuls are the C kernels' own
    c_twin = _generate(float_dir, prompts, quantization=mode)
    twin = _generate(twin_dir, prompts)
    original = _generate(float_dir, prompts)
    for q_out, t_out, f_out, c_out, c_twin_out in zip(quantized, twin, original, with_c_kernels, c_twin):
        assert q_out.token_ids == t_out.token_ids
        gap = (_logprobs(q_out) - _logprobs(t_out)).abs().max()
        assert gap < TOLERANCE, f"{model_type} {mode}: log-probabilities differ by {gap:.2e}"
        # the control: the float model of the unquantized weights is measurably another model
        assert q_out.token_ids != f_out.token_ids or (_logprobs(q_out) - _logprobs(f_out)).abs().max() > 10 * TOLERANCE
        # the C kernels compute their torch twin's arithmetic (float32 vs float64 sums). An ulp of difference in an
        # activation can flip its int8 rounding, and a flip moves everything after it: with only decode's few rows
        # rounded, one step of 24 moved 6e-4; with every prefill row rounded too (the invariance promise), the steps
        # after a flip moved up to 3.0e-2 (2026-12-07, int4; the others <= 1e-6). The tokens must agree exactly;
        # the kernels' exact tests are in tests/kernels/test_quant_kernels.py
        assert c_out.token_ids == c_twin_out.token_ids
        assert (_logprobs(c_out) - _logprobs(c_twin_out)).abs().max() < 5e-2
    assert (logits[0] - logits[1]).abs().max() < TOLERANCE * logits[1].abs().max()
    assert (logits[0] - logits[2]).abs().max() > 10 * TOLERANCE * logits[2].abs().max()


@pytest.mark.parametrize("mode,bits", [("fp16", 16), ("int8", 8), ("int4", 4)])
def test_weights_are_stored_quantized(checkpoint, mode, bits):
    model_type, float_dir = checkpoint
    cfg = ModelConfig.from_dir(float_dir)
    load = load_hybrid_weights if model_type == "qwen3_next" else load_weights
    weights = load(float_dir, cfg, torch.float32, torch.device("cpu"))
    float_bytes = weight_bytes(weights)
    matrices = ("qkv", "qkvg", "o_proj", "in_proj", "out_proj", "w13", "w2", "shared_w13", "shared_w2")
    linear_params = sum(w.numel() for name, w in weights.items() if name.rsplit(".", 1)[-1] in matrices
                        or name == "lm_head")
    mapped = weights["embed"]  # a view of the checkpoint file's mapping, held so that its address stays taken
    mapping = mapped.untyped_storage().data_ptr()
    quantize_weights(weights, mode)
    # no float tensor left is a view of the mapping, so it can be unmapped (its pages counted in RSS no more)
    assert all(w.untyped_storage().data_ptr() != mapping for w in weights.values() if isinstance(w, torch.Tensor))
    kinds = {w.kind for w in weights.values() if isinstance(w, QuantizedWeight)}
    assert kinds == {mode}
    # every matrix is quantized but those whose inputs are not whole blocks of 32 (the helpers' hybrid has some of
    # 24 and 40 inputs): those stay float for int8 / int4
    names = [n for n, w in weights.items() if n.rsplit(".", 1)[-1] in matrices]
    float_left = [n for n in names if not isinstance(weights[n], QuantizedWeight)]
    assert names and all(mode != "fp16" and weights[n].shape[-1] % 32 for n in float_left)
    assert len(float_left) < len(names) and (model_type == "qwen3_next" or not float_left)
    assert isinstance(weights["lm_head"], QuantizedWeight) and not isinstance(weights["embed"], QuantizedWeight)
    w13 = weights["layers.0.w13"]
    assert isinstance(w13, QuantizedWeight) and (w13.data.dtype in (torch.int8, torch.uint8) or len(w13.packed) >= 1)
    # each quantized linear parameter went from 4 bytes to bits/8 (+ its share of the scales)
    quantized_params = linear_params - sum(weights[n].numel() for n in float_left)
    saved = float_bytes - weight_bytes(weights)
    assert saved > quantized_params * (4 - bits / 8) * 0.85, (saved, quantized_params)


def test_quantization_option_is_checked():
    assert EngineConfig(model="m", quantization="int4").quantization == "int4"
    with pytest.raises(ConfigError, match="quantization must be none, fp16, int8 or int4"):
        EngineConfig(model="m", quantization="fp4")


@pytest.mark.parametrize("command", ["run", "chat"])
def test_the_flag_and_the_profile_key_reach_the_engine_options(monkeypatch, tmp_path, command):
    seen = {}
    monkeypatch.setattr(launch, "load_llm", lambda profile, model, **overrides: seen.update(overrides))
    extra = ["--prompt", "hi"] if command == "run" else []
    launch.llm_from_args(build_parser().parse_args([command, "--model", "m", "--quantization", "int4", *extra]))
    assert seen["quantization"] == "int4"
    launch.llm_from_args(build_parser().parse_args([command, "--model", "m", *extra]))
    assert seen["quantization"] is None  # not given: the profile's value (or none) stands
    # the TUI's engine (`tsterm --quantization ...`) takes it too
    assert cli._parallel_options(build_parser().parse_args(["--quantization", "fp16"]))["quantization"] == "fp16"
    profile = tmp_path / "q.yaml"
    profile.write_text("model: some/dir\nquantization: int8\n")
    assert load_profile(str(profile)).engine_options()["quantization"] == "int8"
    profile.write_text("model: some/dir\nquantization: q4\n")
    with pytest.raises(ConfigError, match=r"q\.yaml:2"):
        load_profile(str(profile))

"""FP8 checkpoints: F8_E4M3 / F8_E5M2 tensors load, each equal to torch's own conversion to the engine's dtype.

The fixture is a tiny transformers checkpoint whose 2-D weights were rewritten by `safetensors.torch.save_file`
as float8_e4m3fn and float8_e5m2 (norms stay F32, so one file mixes dtypes); its reference twin holds the same
FP8 values converted to float32 by torch.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tsterm import LLM, SamplingParams
from tsterm.config import ModelConfig
from tsterm.model.loader import load_weights

from tests.helpers.checkpoints import make_checkpoint

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the FP8 checkpoint, the same values dequantized to float32 by torch)."""
    root = tmp_path_factory.mktemp("fp8")
    fp8_dir, _ = make_checkpoint(root / "fp8", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2))
    tensors = load_file(fp8_dir / WEIGHTS)
    # attention projections in E5M2, every other matrix (embedding, router, experts, lm_head) in E4M3
    fp8 = {name: t.to(torch.float8_e5m2 if ".self_attn." in name else torch.float8_e4m3fn)
           for name, t in tensors.items() if t.dim() == 2}
    save_file({**tensors, **fp8}, fp8_dir / WEIGHTS)
    ref_dir = root / "dequantized"
    shutil.copytree(fp8_dir, ref_dir)
    save_file({**tensors, **{name: t.to(torch.float32) for name, t in fp8.items()}}, ref_dir / WEIGHTS)
    return fp8_dir, ref_dir


def test_the_fixture_really_holds_fp8(checkpoints):
    with safe_open(checkpoints[0] / WEIGHTS, framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"F8_E4M3", "F8_E5M2", "F32"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weights_equal_the_torch_conversion(checkpoints, dtype):
    fp8_dir, ref_dir = checkpoints
    cfg = ModelConfig.from_dir(fp8_dir)
    got = load_weights(fp8_dir, cfg, dtype, torch.device("cpu"))
    want = load_weights(ref_dir, cfg, dtype, torch.device("cpu"))
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].dtype == dtype, name
        assert torch.equal(got[name], want[name]), name
    # both FP8 formats, through each load path: a plain tensor, fused q/k/v rows and stacked experts
    file = load_file(fp8_dir / WEIGHTS)
    embed, q = file["model.embed_tokens.weight"], file["model.layers.0.self_attn.q_proj.weight"]
    gate = file["model.layers.1.mlp.experts.2.gate_proj.weight"]
    assert (embed.dtype, q.dtype, gate.dtype) == (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fn)
    assert torch.equal(got["embed"], embed.to(dtype)) and got["embed"].abs().sum() > 0
    assert torch.equal(got["layers.0.qkv"][:q.shape[0]], q.to(dtype))
    assert torch.equal(got["layers.1.w13"][2, :gate.shape[0]], gate.to(dtype))


def test_an_fp8_checkpoint_generates_like_its_dequantized_twin(checkpoints):
    options = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(30, 45))
    outs = [LLM(str(d), **options).generate(prompt, params)[0].token_ids for d in checkpoints]
    assert outs[0] == outs[1] and len(outs[0]) == 8

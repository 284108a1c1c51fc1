"""A torchrun worker rank resolves `dtype: auto` as rank 0's engine does: it weighs whether the model's linears are
quantized, so on an AMX machine a quantized model's ranks all run float32 (one rank in bfloat16 and another in float32
would disagree on every all-reduce's bytes)."""
from __future__ import annotations

import pytest
import torch

from tsterm.cpu import CpuFeatures
from tsterm.distributed.torchrun import worker_args

from tests.helpers.checkpoints import make_checkpoint

AMX = CpuFeatures("x86_64", "a Sapphire Rapids", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}),
                  amx_granted=True)


@pytest.mark.parametrize("quantization, want", [(None, torch.bfloat16), ("int8", torch.float32)])
def test_worker_auto_dtype_follows_quantization(tmp_path, monkeypatch, quantization, want):
    path, _ = make_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2))
    monkeypatch.setattr(CpuFeatures, "detect", classmethod(lambda cls: AMX))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    argv = ["run", "--model", str(path), "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "auto",
            "--prompt", "hi"] + (["--quantization", quantization] if quantization else [])
    assert worker_args(argv, rank=1, local_rank=1).spec.dtype == want

"""benchmarks/gpu_decode.py is only useful on a GPU; its CLI, arithmetic and code paths are checked here on the CPU
(the engine on tiny shapes, Triton kernels under the interpreter; CUDA graphs do not apply on the CPU)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_decode.py"
TINY = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_experts": 6, "num_experts_per_tok": 2, "max_position_embeddings": 128}


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_decode", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_a_gpu():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--layers" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_fails_fast_with_a_clear_message_without_cuda():
    result = subprocess.run([sys.executable, str(SCRIPT)], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "no CUDA device" in result.stderr


def test_bytes_read_per_token_of_the_real_shape(bench):
    cfg = bench.QWEN3_30B_A3B
    # per layer: q/k/v/o projections, router, 2 norms + q/k norms, 8 experts of gate/up/down; then one embedding
    # row, the final norm and the LM head
    per_layer = (32 + 2 * 4) * 128 * 2048 + 2048 * 32 * 128 + 128 * 2048 + 2 * 2048 + 2 * 128 + 8 * 3 * 2048 * 768
    weights = 48 * per_layer + 2048 + 2048 + 151936 * 2048
    assert bench.bytes_read_per_token(cfg, 0) == 2 * weights  # bf16
    assert weights == 3_041_869_824  # ~3.0B active parameters (Qwen3-30B-A3B: 3.3B with the whole embedding)
    kv_per_token = 48 * 2 * 4 * 128 * 2
    assert bench.bytes_read_per_token(cfg, 1000) - bench.bytes_read_per_token(cfg, 0) == 1000 * kv_per_token


def test_layers_that_fit_the_free_memory(bench):
    cfg = bench.QWEN3_30B_A3B
    model, layer = bench.weight_shapes(cfg)
    per_layer, fixed = bench.numel(layer) * 2, bench.numel(model) * 2
    assert bench.layers_that_fit(cfg, 48, 140 << 30, 1 << 30) == 48  # an H200
    free = fixed + (1 << 30) + bench.MEMORY_SLACK + 20 * per_layer + per_layer // 2
    assert bench.layers_that_fit(cfg, 48, free, 1 << 30) == 20
    assert bench.layers_that_fit(cfg, 8, 140 << 30, 1 << 30) == 8


def test_args_are_validated(bench):
    assert bench.parse_args([]).layers == 48
    with pytest.raises(SystemExit):
        bench.parse_args(["--warmup", "0"])


def test_measure_runs_the_engine_end_to_end_on_tiny_shapes(bench, monkeypatch):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    cfg = dict(bench.QWEN3_30B_A3B, **TINY)

    results = bench.measure(cfg, context=7, tokens=2, warmup=1, bandwidth=1e9)

    assert [r.mode for r in results] == ["eager", "cuda graphs"]
    assert all(r.tokens_per_s > 0 and r.bytes_per_token == bench.bytes_read_per_token(cfg, 7 + 1 + 1 + 1)
               for r in results)
    assert "0 graph steps" in results[1].note  # the CPU has no CUDA graphs: the runner decoded eagerly
    summary = bench.table(results, "title", 1e9)
    assert summary.splitlines()[-1].startswith("roofline") and "cuda graphs" in summary

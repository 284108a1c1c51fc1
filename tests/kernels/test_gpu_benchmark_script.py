"""benchmarks/gpu_kernels.py is only useful on a GPU, but its CLI and code paths are checked here on the CPU."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_kernels.py"


def test_help_runs_without_a_gpu():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--moe-tokens" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_fails_fast_with_a_clear_message_without_cuda():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "no CUDA device" in result.stderr


def test_benchmark_code_paths_on_tiny_shapes(monkeypatch):
    """Every measurement function end to end, on the CPU under the interpreter, with tiny sizes and one call."""
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_kernels", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    for name, value in dict(DEVICE="cpu", BF16=torch.float32, HIDDEN=32, INTER=32, EXPERTS=6, TOP_K=2,
                            HEADS=4, KV_HEADS=2, HEAD_DIM=16, BLOCK=4).items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "bench", lambda fn, rep_ms: (fn(), 10.0)[1])

    rows = (bench.moe_rows([1, 5], 1, True, 1000.0) + bench.quant_moe_rows([3], 1, 1000.0)
            + bench.attention_rows([9], [2], 1, 1000.0))

    assert [r.kernel for r in rows] == (["moe_route + fused_moe", "  of which moe_align"] * 2
                                        + [f"fused_moe, {kind} experts" for kind in ("fp8", "int8", "int4")]
                                        + ["paged decode attention"])
    assert all(r.gbytes_per_s is None or r.gbytes_per_s > 0 for r in rows)
    assert "ctx=9 S=2" in bench.table(rows, "title")

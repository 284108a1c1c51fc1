"""scripts/gpu_check.sh runs on the GPU machine only; here: it runs every GPU-only test file, and its control flow
(deadline, phases, summary, exit status) holds on a machine without CUDA, where every phase fails or skips fast."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_every_gpu_only_test_file_is_in_the_script():
    listed = re.search(r"GPU_TESTS=\(([^)]*)\)", SCRIPT.read_text()).group(1).split()
    gpu_only = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                      if re.search(r"skipif\(not torch\.cuda\.is_available\(\)", p.read_text()))
    assert "tests/kernels/test_triton_gpu.py" in gpu_only and "tests/engine/test_decode_graphs_gpu.py" in gpu_only
    assert sorted(listed) == gpu_only


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the script's behaviour without a GPU")
def test_runs_every_phase_and_reports_failure_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, GPU_CHECK_SECONDS="200", OUT=str(tmp_path))
    result = subprocess.run(["bash", str(SCRIPT)], check=False, capture_output=True, text=True, timeout=300, env=env)
    out = result.stdout
    assert result.returncode != 0, out  # the benchmarks need CUDA
    summary = out.split(" summary ")[-1]
    assert re.search(r"GPU tests\s+rc=0\s+.*skipped", summary), summary
    assert re.search(r"kernel microbenchmarks\s+rc=1\s+FAILED", summary), summary
    assert re.search(r"decode benchmark\s+rc=1\s+FAILED", summary), summary
    assert "no CUDA device" in result.stderr
    assert (tmp_path / "gpu_tests.log").is_file()

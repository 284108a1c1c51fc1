"""Every Triton kernel compiles for sm_90 (H200) at the real model sizes, without register spills.

No GPU needed: sm90_compile.py runs the launchers on meta tensors in a process without TRITON_INTERPRET and
compiles each launch with the ptxas bundled in the triton wheel. On a CUDA machine the GPU tests compile the
kernels for real instead.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

SCRIPT = Path(__file__).with_name("sm90_compile.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile the kernels on the real device")
@pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the NVIDIA backend's ptxas")
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 failures" in result.stdout

"""The Triton MLA kernels (kernels/triton_mla.py) compile for sm_90 at DeepSeek-V3's attention shape (128 heads, a
512 + 64 latent row) with the tiles a CUDA device gets, for a bfloat16 and a float32 pool, without register spills
and within one block's shared memory: through tests/kernels/sm90_compile.py's launch interception, in a process
without TRITON_INTERPRET. No GPU needed (on a CUDA machine the GPU tests compile the kernels for real)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile the kernels on the real device"),
    pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the NVIDIA backend's ptxas"),
]

SCRIPT = """
import sys
import torch
from tests.kernels import sm90_compile
from tsterm_kernels import triton_mla
from tsterm_kernels.metadata import AttentionMetadata

sm90_compile._intercept_launches()
tiles = triton_mla._tiles
triton_mla._tiles = lambda on_gpu, dtype: tiles(True, dtype)  # the CUDA device's tiles
meta_device = torch.device("meta")
for dtype in (torch.bfloat16, torch.float32):
    sm90_compile.context["device"] = f"sm_90, {dtype} pool"
    seq_lens = [4096, 300, 4100]  # split programs and the merge
    q_lat = torch.empty((128, 3, 512), device=meta_device).transpose(0, 1)  # [T, Hq, R], head-major
    q_rope = torch.empty((3, 128, 64), device=meta_device)
    cache = torch.empty((800, 16, 1, 576), dtype=dtype, device=meta_device)
    meta = AttentionMetadata([0, 1, 2, 3], seq_lens, [], torch.empty(3, dtype=torch.int64, device=meta_device),
                             torch.empty((3, 260), dtype=torch.int32, device=meta_device), 16)
    triton_mla.mla_attention(q_lat, q_rope, cache, meta, 192 ** -0.5)
print(f"{len(sm90_compile.seen)} kernel variants compiled for sm_90, {len(sm90_compile.failures)} failures")
for failure in sm90_compile.failures:
    print("FAILED:", failure)
sys.exit(1 if sm90_compile.failures else 0)
"""


def test_the_mla_kernels_compile_for_sm90_without_spills():
    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                            cwd=root)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert sum("_mla_attention_kernel" in line for line in compiled) == 2  # the bf16 and the float32 pool
    assert any("_merge_splits_kernel" in line for line in compiled)

"""Every Triton kernel compiles for sm_90 at the real model sizes, with the tile choices of an H200 and of an H100
(the fused MoE's `default` tile row), without register spills and within the shared memory one block may use.

No GPU needed: sm90_compile.py runs the launchers on meta tensors in a process without TRITON_INTERPRET and
compiles each launch with the ptxas bundled in the triton wheel. On a CUDA machine the GPU tests compile the
kernels for real instead.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

SCRIPT = Path(__file__).with_name("sm90_compile.py")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile the kernels on the real device"),
    pytest.mark.skipif(not PTXAS.exists(), reason="triton wheel without the NVIDIA backend's ptxas"),
]


def compile_for_sm90(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[2])


def test_kernels_compile_for_sm90_without_spills():
    result = compile_for_sm90()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 failures" in result.stdout
    table = json.loads((Path(__file__).parents[2] / "kernels" / "moe_tiles.json").read_text())
    for row, device in (("default", "H100"), ("NVIDIA H200", "H200")):  # every bucket of the rows Hoppers use
        for bucket, tiles in table[row].items():
            config = (f"'BLOCK_M': {tiles['BLOCK_M']}, 'BLOCK_N': {tiles['BLOCK_N']}, 'BLOCK_K': {tiles['BLOCK_K']}}} "
                      f"warps={tiles['num_warps']} stages={tiles['num_stages']}")
            compiled = [line for line in result.stdout.splitlines()
                        if line.startswith("ok    _gate_up_kernel {'KIND': -1") and config in line]
            assert compiled, f"{row} bucket {bucket} ({device}): its fused MoE tiles were not compiled"


def test_a_tile_config_over_the_shared_memory_limit_fails_by_name(tmp_path):
    """A candidate tile table whose H100 (`default`) row asks more shared memory than a block gets on sm_90 fails,
    naming the kernel, the device and the table row and bucket; the rows that fit compile."""
    fits = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    too_big = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 5}  # 5 stages of 40 KB+
    table = tmp_path / "candidate.json"
    table.write_text(json.dumps({"default": {"16": too_big, "128": fits}, "NVIDIA H200": {"16": fits}}))
    result = compile_for_sm90("--moe-tiles", str(table))
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-4000:]
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAILED:")]
    assert failed and all("candidate.json['default']['16']" in line and "H100" in line
                          and "exceeds the 232448 bytes (227 KB) one block may use on sm_90" in line for line in failed)
    assert any("_gate_up_kernel" in line and "'BLOCK_K': 128" in line and "stages=5" in line for line in failed)
    assert "spill_bytes=0" in result.stdout and "ok    _gate_up_kernel" in result.stdout  # the fitting rows compiled

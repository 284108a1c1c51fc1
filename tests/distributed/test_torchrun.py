"""`torchrun ... -m tsterm.distributed.torchrun run ...`: torchrun starts the ranks, global rank 0 runs the command and its
engine attaches to the others (no worker of its own); the greedy answer equals one process's, and every rank exits 0
when the command ends (the engine's exit stops the workers)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint


def test_torchrun_ranks_serve_one_command(tmp_path):
    path, _ = make_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2))
    want = LLM(str(path), dtype="float32", device="cpu").generate(
        "hello world", SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "tsterm.distributed.torchrun", "run", "--model", str(path),
         "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32", "--prompt", "hello world", "--raw",
         "--max-tokens", "6", "--temperature", "0", "--json"],
        capture_output=True, text=True, timeout=240, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["token_ids"] == want

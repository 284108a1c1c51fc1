"""The engine core process on a real device: it owns CUDA (the front never initialises it), its dashboard reports
the device's memory, and its greedy replies equal the same engine's in this process.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run with
`pytest --noconftest`, as scripts/gpu_check.sh does. The CPU version: tests/engine/test_core_process.py.
"""
from __future__ import annotations

import asyncio
import functools
import os

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from tsterm import LLM, SamplingParams
from tsterm.engine.async_engine import AsyncEngine
from tsterm.engine.core_process import EngineCoreProcess
from tsterm.launch import build_engine

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see scripts/gpu_check.sh)"),
]

OPTIONS = {"device": "cuda", "dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 256, "max_num_seqs": 8}
PROMPTS = [[10 + i for i in range(40)], [300 + i for i in range(23)]]


async def replies(front) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:  # one at a time: the same shapes in both engines
        async for last in front.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)):
            pass
        out.append(list(last.token_ids))
    return out


def test_the_core_owns_the_device_and_answers_as_the_engine_here(tmp_path):
    path, _ = make_checkpoint(tmp_path / "m", "qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 2,
                                                            "num_hidden_layers": 2, "max_position_embeddings": 512})
    core = EngineCoreProcess(functools.partial(build_engine, str(path), OPTIONS))
    try:
        there = asyncio.run(replies(core))
        stats, _, _, memory = core.dashboard()
        assert core.info.device.startswith("cuda") and memory["kind"] == "cuda" and memory["allocated"] > 0
        assert stats["generated_tokens"] == 32
        assert not torch.cuda.is_initialized(), "the front initialised CUDA: the core process is to own the device"
    finally:
        core.shutdown()
    inline = AsyncEngine(LLM(str(path), **OPTIONS).engine, owns_engine=True)
    try:
        assert asyncio.run(replies(inline)) == there
    finally:
        inline.shutdown()

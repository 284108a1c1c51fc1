"""gpt-oss with its experts kept MXFP4 on a CUDA device: the blocks copied to the device as they are and read by the
Triton quantized linear layer (kind mxfp4), token-exact with the CPU engine (csrc/mxfp4.c) on the same directory and
its log-probabilities close in float32; a bfloat16 engine decodes through the same kernel (finite log-probabilities).

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run with
`pytest --noconftest tests/model/test_gpt_oss_mxfp4_gpu.py` (to be listed in scripts/gpu_check.sh's GPU_TESTS).
Self-contained: no fixtures from conftest files.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see the module docstring)"),
]


def test_mxfp4_experts_decode_on_the_device_as_on_the_cpu(tmp_path):
    from tsterm import LLM, SamplingParams

    from tests.model.test_gpt_oss_mxfp4 import write_mxfp4_checkpoint

    model_dir = write_mxfp4_checkpoint(tmp_path / "gpt_oss")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 384, (n,), generator=gen).tolist() for n in (11, 17)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    options = dict(block_size=4, num_kv_blocks=64)
    gpu = LLM(str(model_dir), dtype="float32", device="cuda", kernels="triton", cuda_graphs=False, **options)
    w13 = gpu.engine.executor.model.layers[0][3].w13
    assert w13.kind == "mxfp4" and w13.data.is_cuda and w13.scale.is_cuda
    cpu = LLM(str(model_dir), dtype="float32", device="cpu", **options)
    for out, ref in zip(gpu.generate(prompts, greedy), cpu.generate(prompts, greedy)):
        assert out.token_ids == ref.token_ids
        ours = torch.tensor([p["logprob"] for p in out.outputs[0].logprobs])
        want = torch.tensor([p["logprob"] for p in ref.outputs[0].logprobs])
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)
    bf16 = LLM(str(model_dir), dtype="bfloat16", device="cuda", kernels="triton", cuda_graphs=False, **options)
    for out in bf16.generate(prompts, greedy):  # the bfloat16 launch of the kernel (no reference to match bits)
        logprobs = torch.tensor([p["logprob"] for p in out.outputs[0].logprobs])
        assert len(out.token_ids) == 16 and torch.isfinite(logprobs).all()

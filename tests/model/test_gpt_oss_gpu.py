"""A tiny gpt-oss checkpoint (sinks, a window shorter than the prompt, biases, clamped SwiGLU) decoded on a CUDA
device with the Triton kernels (the paged attention with its sinks and window), token-exact with transformers and with
the CPU engine's log-probabilities; decode steps eager (cuda_graphs false, as the gpt-oss-20b profile runs: its experts
read their per-expert token counts on the host).

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run with
`pytest --noconftest tests/model/test_gpt_oss_gpu.py` (to be listed in scripts/gpu_check.sh's GPU_TESTS).
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


def test_a_gpt_oss_checkpoint_decodes_token_exact_on_the_device(tmp_path):
    from tsterm import LLM, SamplingParams

    from tests.helpers.checkpoints import make_checkpoint

    model_dir, hf_model = make_checkpoint(tmp_path / "gpt_oss", "gpt_oss", dict(
        num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5, num_key_value_heads=1, sliding_window=4,
        num_hidden_layers=3))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (11, 17)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    llm = LLM(str(model_dir), dtype="float32", device="cuda", block_size=4, num_kv_blocks=64, kernels="triton",
              cuda_graphs=False)
    cpu = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    for prompt, out, ref in zip(prompts, llm.generate(prompts, greedy), cpu.generate(prompts, greedy)):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.token_ids == ids[len(prompt):] == ref.token_ids
        ours = torch.tensor([p["logprob"] for p in out.outputs[0].logprobs])
        want = torch.tensor([p["logprob"] for p in ref.outputs[0].logprobs])
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)

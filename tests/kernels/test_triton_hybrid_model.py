"""A hybrid model (Gated DeltaNet + gated attention) through the Triton ops (interpreted, on CPU) against the same
model through the torch twins: the decode steps run the Triton conv update and delta-rule step over state slots."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_hybrid_checkpoint


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound


def test_hybrid_generation_matches_torch_ops(tmp_path):
    model_dir, hf_model = make_hybrid_checkpoint(tmp_path / "m", "qwen3_5_moe_text",
                                                 dict(num_hidden_layers=2, layer_types=["linear_attention",
                                                                                        "full_attention"]))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (9, 1)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)

    def generate(implementation: str):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=32,
                  kernels=implementation)
        assert llm.engine.executor.kernels == implementation
        return llm.generate(prompts, params)

    want, got = generate("torch"), generate("triton")
    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor([lp["logprob"] for lp in ours.outputs[0].logprobs]),
                                   torch.tensor([lp["logprob"] for lp in theirs.outputs[0].logprobs]),
                                   atol=1e-5, rtol=1e-4)

"""The whole model through the Triton ops (interpreted, on CPU) against the same model through the torch twins:
per-head and full q/k norms, GQA, top-k routing, a gated shared expert, batched prefill then decode."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint

CASES = [
    ("qwen3_moe", dict(num_experts=5, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2)),
    ("qwen2_moe", dict(num_experts=3, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                       norm_topk_prob=False, num_hidden_layers=2)),
    ("olmoe", dict(num_experts=5, num_experts_per_tok=2, head_dim=8, num_hidden_layers=2)),
]


@pytest.mark.parametrize("model_type,overrides", CASES, ids=[c[0] for c in CASES])
def test_generation_matches_torch_ops(tmp_path, model_type, overrides):
    model_dir, hf_model = make_checkpoint(tmp_path / model_type, model_type, overrides)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (11, 6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)

    def generate(implementation: str):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=32,
                  kernels=implementation)
        assert llm.engine.executor.kernels == implementation
        return llm.generate(prompts, params)

    want = generate("torch")
    got = generate("triton")

    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor(ours.outputs[0].logprobs[0]["logprob"]),
                                   torch.tensor(theirs.outputs[0].logprobs[0]["logprob"]), atol=1e-5, rtol=1e-4)

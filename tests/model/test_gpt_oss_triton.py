"""gpt-oss through the Triton ops (interpreted on the CPU): its sliding / full layers' attention with sinks runs the
Triton paged-attention kernel (`triton_paged_attention`, sinks and window passed), never the torch twin, and gives
transformers' greedy tokens."""
from __future__ import annotations

import pytest

from tsterm import LLM, SamplingParams
from tsterm_kernels import torch_ops, triton_paged_attention

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import random_prompts, reference_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_gpt_oss_attention_runs_the_triton_kernel(tmp_path, monkeypatch):
    model_dir, hf_model = make_checkpoint(tmp_path / "m", "gpt_oss", dict(
        num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5, num_key_value_heads=1, sliding_window=4,
        num_hidden_layers=2))
    launches = []
    launch = triton_paged_attention.launch_paged_attention

    def counted(*args, **kwargs):
        launches.append((kwargs.get("sinks") is not None, kwargs.get("window")))
        return launch(*args, **kwargs)
    monkeypatch.setattr(triton_paged_attention, "launch_paged_attention", counted)

    def twin(*args, **kwargs):
        raise AssertionError("the torch twin ran instead of the Triton kernel")
    monkeypatch.setattr(torch_ops, "_sink_window_attention", twin)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, kernels="triton")
    prompts = random_prompts(hf_model.config.vocab_size, (11, 7), seed=3)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(hf_model, prompt, 4)[0]
    assert {window for _, window in launches} == {None, 4} and all(sinks for sinks, _ in launches)

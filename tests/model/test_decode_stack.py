"""The CPU decode stack (`tsterm_kernels.cpu_stack`: every layer of a decode step in one C call) computes what the
layer-by-layer path computes with the same kernels, bit for bit.

The layer-by-layer path is the one the parity tests hold against transformers; the stack must not be another
model. Both run the same C kernels per row (matmuls, norms, RoPE, attention, SwiGLU, the routing softmax, the
shared expert's gate) and add a token's experts in the same order (ascending id, the shared expert last), so the
test asks for equal tokens, equal log-probabilities and equal expert loads, not a tolerance: with int8 activation
rounding in the quantized matmuls, one ulp of difference anywhere would flip a code somewhere and show as ~1e-3.
"""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_stack, torch_ops

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint, perturb_biases_and_norms

SIZES = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=16, num_hidden_layers=3)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2)
OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=128)
CASES = {  # id -> (model_type, config overrides)
    "llama": ("llama", {}),
    "llama-biases": ("llama", dict(attention_bias=True)),  # q/k/v and o biases
    "qwen3": ("qwen3", {}),  # per-head q/k norms
    "qwen3_moe": ("qwen3_moe", dict(EXPERTS, norm_topk_prob=False)),
    "qwen3_moe-renormalized": ("qwen3_moe", dict(EXPERTS, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("qwen2_moe", dict(EXPERTS, shared_expert_intermediate_size=64)),  # + a gated shared expert
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    path, _ = make_checkpoint(tmp_path_factory.mktemp(request.param) / "float", model_type, dict(SIZES, **overrides))
    perturb_biases_and_norms(path)
    return request.param, path


def _run(model_dir, prompts, **options):
    llm = LLM(str(model_dir), **OPTIONS, **options)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    return ([o.outputs[0].token_ids for o in outs],
            [torch.tensor([step["logprob"] for step in o.outputs[0].logprobs]) for o in outs],
            llm.engine.expert_load())


def stack_prompts_and_steps(monkeypatch) -> tuple[list[list[int]], list[bool]]:
    """Three prompts that decode together (rows 1..3 as they finish prefill), one a prefix of another (shared
    blocks), and a list that records, per call of the decode stack, whether it ran the step (monkeypatched in)."""
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(0, 300, (13,), generator=gen).tolist()
    prompts = [first, first + torch.randint(0, 300, (6,), generator=gen).tolist(),
               torch.randint(0, 300, (30,), generator=gen).tolist()]
    steps: list[bool] = []
    call = cpu_stack.DecodeStack.__call__

    def counted(self, *args):
        out = call(self, *args)
        steps.append(out is not None)
        return out

    monkeypatch.setattr(cpu_stack.DecodeStack, "__call__", counted)
    return prompts, steps


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_stack_computes_what_the_layers_compute(checkpoint, quantization, monkeypatch):
    name, path = checkpoint
    prompts, steps = stack_prompts_and_steps(monkeypatch)
    tokens, logprobs, load = _run(path, prompts, quantization=quantization)
    assert sum(steps) >= 9, "the stack ran no decode step"
    monkeypatch.setattr(torch_ops, "decode_stack", lambda *args: None)
    layer_tokens, layer_logprobs, layer_load = _run(path, prompts, quantization=quantization)
    assert tokens == layer_tokens
    assert load == layer_load
    for ours, theirs in zip(logprobs, layer_logprobs):
        assert torch.equal(ours, theirs)


def test_layers_the_stack_does_not_take_run_one_by_one(tmp_path):
    """OLMoE's whole-projection q/k norm is not in the stack: the model has none and still decodes."""
    path, _ = make_checkpoint(tmp_path / "olmoe", "olmoe", dict(SIZES, num_experts=8, num_experts_per_tok=2))
    llm = LLM(str(path), **OPTIONS)
    assert llm.engine.executor.model.stack is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3

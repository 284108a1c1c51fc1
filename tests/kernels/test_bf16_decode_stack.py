"""The CPU decode stack on a bfloat16 model (csrc/stack.c with tsterm_stack.bf16, `tsterm_kernels.cpu_stack`): every
layer of a decode step in one C call, its linears through csrc/bf16.c in the arithmetic their shape class chose, must
give the bits of the layer-by-layer bfloat16 path (`tsterm_kernels.torch_ops`, "bfloat16 on the CPU"): equal tokens,
equal logits (every row the model computes, bit for bit), equal expert loads; for every family the stack takes
(dense, q/k/v and o biases, Qwen3's per-head q/k norms, routed experts renormalised or not, a gated shared expert)
and for every bf16.c instruction set this machine runs (AMX where the OS grants it, AVX512-BF16, plain C), forced
through TSTERM_CPU_KERNELS."""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_select, torch_ops

from tsterm import LLM, SamplingParams
from tsterm.model import decoder

from tests.helpers.checkpoints import make_checkpoint, perturb_biases_and_norms
from tests.model.test_decode_stack import stack_prompts_and_steps

SIZES = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=16, num_hidden_layers=3)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2)
OPTIONS = dict(dtype="bfloat16", device="cpu", block_size=4, num_kv_blocks=128)
CASES = {  # id -> (model_type, config overrides)
    "llama": ("llama", {}),
    "llama-biases": ("llama", dict(attention_bias=True)),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", dict(EXPERTS, norm_topk_prob=False)),
    "qwen3_moe-renormalized": ("qwen3_moe", dict(EXPERTS, norm_topk_prob=True)),
    "qwen2_moe": ("qwen2_moe", dict(EXPERTS, shared_expert_intermediate_size=64)),
}


def _arithmetics() -> list[str]:
    """bf16.c's instruction sets this machine runs: "amx", "avx512-bf16" (cpu_select's c-amx, c-bf16) and "plain"
    (c-bf16's code where the build lacks AVX512-BF16: an AMD Zen 3, an ARM machine), forced here for every layer."""
    have = cpu_select.bf16_available(cpu_select.CpuInfo.detect(), torch_ops._bf16_bits())
    bits = torch_ops._bf16_bits() or 0
    return ["plain"] + [name for name, c, bit in (("amx", "c-amx", 2), ("avx512-bf16", "c-bf16", 1))
                        if c in have and bits & bit]


@pytest.fixture(params=_arithmetics())
def arithmetic(request, monkeypatch) -> str:
    # AMX's linears with AMX's attention (where granted), the other two with the pool widened for attention: both
    # attention arithmetics inside the stack
    monkeypatch.setenv(cpu_select.ENV, "bf16=c-amx" if request.param == "amx" else "bf16=c-bf16,bf16-attention=c-bf16")
    if request.param == "plain":  # c-bf16's isa argument: the plain C code instead of AVX512-BF16
        monkeypatch.setattr(torch_ops, "_bf16_isa", lambda candidate: 0)
    return request.param


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    path, _ = make_checkpoint(tmp_path_factory.mktemp(request.param) / "float", model_type, dict(SIZES, **overrides))
    perturb_biases_and_norms(path)
    return request.param, path


def _run(model_dir, prompts, monkeypatch):
    """Tokens, every logits row the model computed (in order), the expert loads; and whether the stack was built."""
    rows = []
    logits = decoder.DecoderModel.logits

    def recorded(self, hidden):
        out = logits(self, hidden)
        rows.append(out.clone())
        return out

    monkeypatch.setattr(decoder.DecoderModel, "logits", recorded)
    llm = LLM(str(model_dir), **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    monkeypatch.setattr(decoder.DecoderModel, "logits", logits)
    return [o.outputs[0].token_ids for o in outs], rows, llm.engine.expert_load(), llm.engine.executor.model.stack


def test_the_bf16_stack_gives_the_layer_paths_bits(checkpoint, arithmetic, monkeypatch):
    name, path = checkpoint
    prompts, steps = stack_prompts_and_steps(monkeypatch)
    tokens, logits, load, stack = _run(path, prompts, monkeypatch)
    assert stack is not None and stack.dtype is torch.bfloat16
    assert sum(steps) >= 7, "the stack ran no decode step"
    monkeypatch.setattr(torch_ops, "decode_stack", lambda *args: None)
    layer_tokens, layer_logits, layer_load, none = _run(path, prompts, monkeypatch)
    assert none is None
    assert tokens == layer_tokens
    assert load == layer_load
    assert len(logits) == len(layer_logits)
    for step, (ours, theirs) in enumerate(zip(logits, layer_logits)):
        assert torch.equal(ours, theirs), f"logits of step {step}"


def test_a_class_that_runs_torch_keeps_the_model_layer_by_layer(tmp_path, monkeypatch):
    """torch's bf16 matmul gives a row other bits at other row counts: a model whose linears run it has no stack."""
    path, _ = make_checkpoint(tmp_path / "llama", "llama", SIZES)
    monkeypatch.setenv(cpu_select.ENV, "bf16=torch")
    llm = LLM(str(path), **OPTIONS)
    assert llm.engine.executor.model.stack is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3

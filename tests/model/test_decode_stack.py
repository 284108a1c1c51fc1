"""The CPU decode stack (`tsterm_kernels.cpu_stack`: every dense layer of a decode step in one C call) computes what
the layer-by-layer path computes with the same kernels, bit for bit.

The layer-by-layer path is the one the parity tests hold against transformers; the stack must not be another
model. Both run the same C kernels per row (matmuls, norms, RoPE, attention, SwiGLU), so the test asks for equal
tokens and equal log-probabilities, not a tolerance: with int8 activation rounding in the quantized matmuls, one
ulp of difference anywhere flips a code somewhere and shows as ~1e-3.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tsterm_kernels import cpu_stack, reference

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint

SIZES = dict(hidden_size=64, intermediate_size=96, head_dim=16, num_hidden_layers=3)
OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=128)


@pytest.fixture(scope="module", params=[False, True], ids=["llama", "llama-biases"])
def checkpoint(request, tmp_path_factory):
    """Llama, and Llama with q/k/v and o biases (`attention_bias`)."""
    overrides = dict(SIZES, attention_bias=request.param)
    path, _ = make_checkpoint(tmp_path_factory.mktemp("llama") / "float", "llama", overrides)
    gen = torch.Generator().manual_seed(7)
    for file in path.glob("*.safetensors"):  # transformers initialises biases to zero: make them count
        tensors = load_file(file)
        save_file({name: torch.randn(t.shape, generator=gen) * 0.1 if name.endswith(".bias") else t
                   for name, t in tensors.items()}, file)
    return path


def _run(model_dir, prompts, **options):
    llm = LLM(str(model_dir), **OPTIONS, **options)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [step["logprob"] for step in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_stack_equals_the_layer_by_layer_path(checkpoint, quantization, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    # three sequences decoding together (rows 1..3 as they finish prefill), one a prefix of another (shared blocks)
    first = torch.randint(0, 300, (13,), generator=gen).tolist()
    prompts = [first, first + torch.randint(0, 300, (6,), generator=gen).tolist(),
               torch.randint(0, 300, (30,), generator=gen).tolist()]
    steps = []
    call = cpu_stack.DecodeStack.__call__

    def counted(self, *args):
        out = call(self, *args)
        steps.append(out is not None)
        return out

    monkeypatch.setattr(cpu_stack.DecodeStack, "__call__", counted)
    stacked = _run(checkpoint, prompts, quantization=quantization)
    assert sum(steps) >= 9, "the stack ran no decode step"
    monkeypatch.setattr(reference, "decode_stack", lambda *args: None)
    layered = _run(checkpoint, prompts, quantization=quantization)
    assert stacked == layered

"""The Triton quantized linear layer (int8, int4, fp8 weights) against the float64 oracle (x times the weight
dequantized from its stored bytes), interpreted on the CPU on tiny shapes; and a tiny quantized model through it
against the torch path.

The kernel computes with the dequantized weights in float32: against the exact product it differs by float32
summation order (the kernel scales each block's partial sum), a few float32 ulps of the largest partial products,
so float32 results agree to ~1e-6 of the output's scale. float16 inputs round the output once.
"""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels import cpu_native, quant, torch_ops
from tsterm_kernels import triton_fused_moe
from tsterm_kernels import triton_quant_linear as tql
from tsterm_kernels.quant import QuantizedWeight, quantize_fp8, quantize_int4, quantize_int8

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint
from tests.kernels import oracles

QUANTIZE = {"int8": quantize_int8, "int4": quantize_int4, "fp8": quantize_fp8}
# (out features, in features): odd outputs everywhere; fp8 with inputs not a multiple of 128 (a partial block) and
# outputs across two 128-row blocks
SHAPES = {"int8": (37, 96), "int4": (37, 96), "fp8": (131, 160)}


def _weight(out_f: int, in_f: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=gen) * torch.rand(out_f, 1, generator=gen)  # rows of varied scale


def _exact(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle's x @ W.T (+ bias), rounded once to x's dtype."""
    return oracles.linear(x, oracles.dequantize(weight), bias).to(x.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * want.abs().max().item())
    else:  # one rounding to float16 on each side, of sums that may differ in their last bits
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3 * want.abs().max().item())


@pytest.mark.parametrize("kind", list(QUANTIZE))
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_oracle(poison, kind, rows, with_bias, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + len(kind))
    out_f, in_f = SHAPES[kind]
    weight = QUANTIZE[kind](_weight(out_f, in_f, gen))
    x = torch.randn(rows, in_f + 8, generator=gen).to(dtype)[:, 8:]  # a strided view, as after a split
    bias = torch.randn(out_f, generator=gen).to(dtype) if with_bias else None

    got = tql.quant_linear(x, weight, bias)

    _close(got, _exact(x, weight, bias))


@pytest.mark.parametrize("kind", list(QUANTIZE))
@pytest.mark.parametrize("tiles", [
    dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2),  # fp8: 4 K steps per 128-input block
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2),  # one N tile over 64 of 131 rows
], ids=["k32", "k64"])
def test_any_tiles_give_the_oracles_result(poison, kind, tiles):
    gen = torch.Generator().manual_seed(11)
    out_f, in_f = (131, 288) if kind == "fp8" else (67, 128)
    weight = QUANTIZE[kind](_weight(out_f, in_f, gen))
    x = torch.randn(20, in_f, generator=gen)  # two M tiles, the second mostly padding
    bias = torch.randn(out_f, generator=gen)
    _close(tql.quant_linear(x, weight, bias, tiles=tiles), _exact(x, weight, bias))


@pytest.mark.parametrize("kind", list(QUANTIZE))
def test_an_expert_of_a_stack_is_read_in_place(poison, kind):
    gen = torch.Generator().manual_seed(5)
    stack = QUANTIZE[kind](torch.randn(3, 40, 160 if kind == "fp8" else 64, generator=gen))
    expert = stack[2]
    assert expert.data.data_ptr() == stack.data[2].data_ptr()
    x = torch.randn(4, expert.dims[1], generator=gen)
    _close(tql.quant_linear(x, expert), oracles.linear(x, oracles.dequantize(stack)[2]).float())


def test_block_scales_are_used_per_block():
    """A weight whose blocks differ only in their scale: each output column sees its own blocks' scales."""
    values = torch.ones(130, 200).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])  # [O/128 rounded up, I/128 rounded up]
    weight = QuantizedWeight.fp8(values, scale)
    x = torch.ones(1, 200)
    y = tql.quant_linear(x, weight)  # row r: 128 inputs * scale[r // 128, 0] + 72 * scale[r // 128, 1]
    assert y[0, 0].item() == 128 * 1.0 + 72 * 10.0 and y[0, 129].item() == 128 * 100.0 + 72 * 1000.0
    d = torch.tensor([0.5, 2.0], dtype=torch.float16)
    int8 = QuantizedWeight.blocks("int8", torch.ones(3, 64, dtype=torch.int8), d.expand(3, 2))
    assert tql.quant_linear(torch.ones(1, 64), int8).tolist() == [[80.0, 80.0, 80.0]]
    dm = torch.tensor([[0.5, -1.0], [2.0, 3.0]], dtype=torch.float16)  # (d, m) of block 0, block 1
    int4 = QuantizedWeight.blocks("int4", torch.full((1, 32), 0x21, dtype=torch.uint8), dm[None])  # codes 1 and 2
    # block 0: 16 * (1 * 0.5 - 1) + 16 * (2 * 0.5 - 1) = -8; block 1: 16 * (1 * 2 + 3) + 16 * (2 * 2 + 3) = 192
    assert tql.quant_linear(torch.ones(1, 64), int4).tolist() == [[184.0]]


def test_no_rows_gives_an_empty_output():
    weight = quantize_int8(torch.randn(8, 32))
    assert tql.quant_linear(torch.empty(0, 32), weight).shape == (0, 8)


def test_tiles_are_chosen_by_rows_and_dtype():
    half = [tql.tile_config(rows, torch.bfloat16)["BLOCK_M"] for rows in (1, 16, 17, 64, 65, 5000)]
    assert half == [16, 16, 64, 64, 128, 128] and tql.tile_config(5000, torch.float16)["BLOCK_M"] == 128
    assert [tql.tile_config(rows, torch.float32)["BLOCK_M"] for rows in (1, 16, 17, 5000)] == [16, 16, 32, 32]
    for table in tql.TILES.values():  # every fp8 K step lies in one 128-input block
        assert all(128 % tiles["BLOCK_K"] == 0 for _, tiles in table) and table[-1][0] is None


def test_the_seam_sends_cuda_inputs_to_the_kernel(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    weight = quantize_fp8(_weight(24, 40, gen))
    x = torch.randn(2, 40, generator=gen)
    assert not quant.runs_on_triton(x, weight)  # a CPU tensor: the torch path
    calls = []
    monkeypatch.setattr(tql, "quant_linear", lambda *args: calls.append(args) or torch.zeros(2, 24))
    torch.testing.assert_close(torch_ops.linear(x, weight), quant.dequantized_linear(x, weight))
    assert not calls
    monkeypatch.setattr(quant, "runs_on_triton", lambda x, weight: True)  # as on a CUDA device
    torch_ops.linear(x, weight)
    assert len(calls) == 1 and calls[0][1] is weight


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe"])
def test_a_quantized_model_through_the_kernel_matches_the_torch_path(tmp_path, monkeypatch, mode, model_type):
    """Every quantized matmul of a tiny model through the Triton kernels (interpreted, as they run on a GPU: the
    linear layer, and for the MoE the fused experts, routed and shared) against the same model whose quantized
    matmuls are F.linear of the dequantized weights (C kernels off)."""
    sizes = dict(hidden_size=64, intermediate_size=64, head_dim=16, num_hidden_layers=2, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if model_type == "llama":
        sizes = {k: v for k, v in sizes.items() if "expert" not in k}
    model_dir, hf_model = make_checkpoint(tmp_path / model_type, model_type, sizes)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (11, 6)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    monkeypatch.setattr(cpu_native, "load", lambda: None)  # the torch path: dequantized weight, F.linear

    def generate(kernels: str):
        llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=32, kernels=kernels,
                  quantization=mode)
        return llm.generate(prompts, params)

    want = generate("torch")
    launches = []
    kernel = tql.quant_linear
    monkeypatch.setattr(tql, "quant_linear", lambda *args: launches.append(args[1].kind) or kernel(*args))
    monkeypatch.setattr(quant, "runs_on_triton", lambda x, weight: weight.kind in quant.TRITON_KINDS)
    stacks = []
    weight_args = triton_fused_moe._weight_args
    monkeypatch.setattr(triton_fused_moe, "_weight_args",
                        lambda w, name: stacks.append(getattr(w, "kind", "float")) or weight_args(w, name))
    got = generate("triton")

    assert launches and set(launches) == {mode}
    assert set(stacks) == (set() if model_type == "llama" else {mode})  # experts as stored: none left float
    for ours, theirs in zip(got, want):
        assert ours.token_ids == theirs.token_ids
        torch.testing.assert_close(torch.tensor(ours.outputs[0].logprobs[0]["logprob"]),
                                   torch.tensor(theirs.outputs[0].logprobs[0]["logprob"]), atol=1e-5, rtol=1e-4)


def test_the_kernel_blocks_are_the_formats_blocks():
    assert (tql.BLOCK, tql.FP8_BLOCK) == (quant.BLOCK, quant.FP8_BLOCK)

"""Triton MoE routing, token/expert alignment and fused experts against the float64 oracles."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels import torch_ops
from tsterm_kernels.quant import QuantizedWeight, quantize_fp8, quantize_int4, quantize_int8
from tsterm_kernels.triton_moe_align import moe_align, num_aligned_tiles

from tests.kernels import oracles


def distinct_logits(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Router logits without ties in any row (a tie makes top-k order implementation-defined); exact in fp16."""
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)])  # [T, E]
    return ranks.float() * (8.0 / num_experts) - 4.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [
    (1, 6, 1), (5, 6, 2), (3, 10, 3), (33, 7, 4), (4, 64, 8), (2, 8, 8),
])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_route_matches_the_oracle(triton_ops, poison, dtype, num_tokens, num_experts, top_k, renormalize):
    gen = torch.Generator().manual_seed(num_tokens * num_experts + top_k)
    logits = distinct_logits(num_tokens, num_experts, gen).to(dtype)

    weights, expert_ids = triton_ops.moe_route(logits, top_k, renormalize)
    want_weights, want_ids = oracles.moe_route(logits, top_k, renormalize)

    assert weights.dtype == torch.float32 and expert_ids.dtype == torch.int64
    torch.testing.assert_close(expert_ids, want_ids, atol=0, rtol=0)
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-5)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle's renormalised routing, its weights in float32 as the kernels receive them."""
    weights, expert_ids = oracles.moe_route(logits, top_k, True)
    return weights.float(), expert_ids


def expected_alignment(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """Pairs stably sorted by expert, each expert's segment padded with the sentinel to a multiple of block_m."""
    flat = expert_ids.reshape(-1).tolist()
    sorted_pairs, tile_experts = [], []
    for expert in range(num_experts):
        segment = [pair for pair, e in enumerate(flat) if e == expert]
        padded = -(-len(segment) // block_m) * block_m
        sorted_pairs += segment + [len(flat)] * (padded - len(segment))
        tile_experts += [expert] * (padded // block_m)
    return sorted_pairs, tile_experts


@pytest.mark.parametrize("num_tokens, top_k, num_experts, block_m", [
    (1, 1, 1, 16), (1, 8, 128, 16), (7, 2, 5, 4), (40, 3, 9, 16), (300, 8, 128, 16), (90, 4, 6, 32),
])
def test_moe_align_sorts_and_pads_segments(poison, num_tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    # some experts left empty on purpose: ids drawn from a subset
    used = torch.randperm(num_experts, generator=gen)[:max(1, (2 * num_experts) // 3)]
    expert_ids = used[torch.randint(0, len(used), (num_tokens, top_k), generator=gen)]

    sorted_pairs, tile_experts = moe_align(expert_ids, num_experts, block_m)

    want_pairs, want_tiles = expected_alignment(expert_ids, num_experts, block_m)
    num_tiles = num_aligned_tiles(expert_ids.numel(), num_experts, block_m)
    assert len(want_tiles) <= num_tiles == tile_experts.numel() and sorted_pairs.numel() == num_tiles * block_m
    assert sorted_pairs[:len(want_pairs)].tolist() == want_pairs
    assert tile_experts[:len(want_tiles)].tolist() == want_tiles
    assert (tile_experts[len(want_tiles):] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", [
    (1, 32, 16, 6, 2),  # decode: one token, M-tile mostly padding
    (5, 40, 24, 7, 3),  # hidden/inter not multiples of the tiles
    (19, 32, 40, 10, 8),  # top-8, several tiles for the busier experts
    (6, 48, 16, 1, 1),  # dense MLP / shared expert: one expert, weight = gate
])
def test_fused_moe_matches_the_oracle(triton_ops, poison, dtype, num_tokens, hidden, inter, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_tokens * 31 + num_experts)
    x = torch.randn(num_tokens, hidden + 8, generator=gen).to(dtype)[:, 8:]  # a strided view, as after a split
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    weights, expert_ids = route(distinct_logits(num_tokens, num_experts, gen), top_k)
    start = torch.randn(num_tokens, hidden, generator=gen).to(dtype)  # accumulation target: out += ...
    out = start.clone()

    result = triton_ops.fused_moe(x, w13, w2, weights, expert_ids, out)
    want = oracles.fused_moe(x, w13, w2, weights, expert_ids, start).to(dtype)

    assert result is out
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-3, rtol=6e-3)
    torch.testing.assert_close(out, want, **tol)



@pytest.mark.parametrize("num_tokens", [1, 3, 40])  # torch_ops' host-grouped decode path and its sorted path
def test_fused_moe_skips_other_ranks_experts(triton_ops, poison, num_tokens):
    """Expert parallel: a rank holds experts [4, 8) of 8 as local 0..3; id 4 (= E_local) marks the other rank's."""
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, inter, num_experts, top_k, first = 32, 16, 8, 2, 4
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    weights, expert_ids = route(distinct_logits(num_tokens, num_experts, gen), top_k)
    local_ids = (expert_ids - first).masked_fill(expert_ids < first, num_experts - first)
    assert (local_ids == num_experts - first).any() and (local_ids < num_experts - first).any()
    start = torch.randn(num_tokens, hidden, generator=gen)
    # every expert present, the other rank's pairs weighted 0
    want = oracles.fused_moe(x, w13, w2, weights.masked_fill(expert_ids < first, 0.0), expert_ids, start).float()

    torch_path = torch_ops.fused_moe(x, w13[first:], w2[first:], weights, local_ids, start.clone())
    kernel = triton_ops.fused_moe(x, w13[first:], w2[first:], weights, local_ids, start.clone())

    torch.testing.assert_close(torch_path, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel, want, atol=1e-4, rtol=1e-4)


QUANTIZE = {"int8": quantize_int8, "int4": quantize_int4, "fp8": quantize_fp8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind13, kind2, hidden, inter", [
    ("int8", "int8", 64, 32),
    ("int4", "int4", 96, 64),
    ("fp8", "fp8", 160, 72),  # partial 128-blocks; the up rows start inside w13's first block of scales
    ("int4", None, 64, 40),  # I = 40 is not whole int4 blocks: w2 stays float, as quantize-on-load leaves it
])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 6, 2), (19, 10, 4)])
def test_quantized_fused_moe_matches_the_oracle_on_the_dequantized_stacks(triton_ops, poison, dtype, kind13, kind2, hidden, inter,
                                                          num_tokens, num_experts, top_k):
    """Expert stacks read as stored (int8 codes, int4 nibbles, fp8 values with their block scales) against the oracle
    run on the same stacks dequantized (exactly, in float64): the kernel scales each block's partial dot; float32
    agrees to float32 summation order, float16 x to one rounding of each projection."""
    gen = torch.Generator().manual_seed(num_tokens * 31 + hidden + inter)
    x = torch.randn(num_tokens, hidden + 8, generator=gen).to(dtype)[:, 8:]  # a strided view, as after a split
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * torch.rand(num_experts, 2 * inter, 1, generator=gen)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5
    w13 = QUANTIZE[kind13](w13 * hidden ** -0.5)
    w2 = QUANTIZE[kind2](w2) if kind2 else w2.to(dtype)
    weights, expert_ids = route(distinct_logits(num_tokens, num_experts, gen), top_k)
    start = torch.randn(num_tokens, hidden, generator=gen).to(dtype)

    got = triton_ops.fused_moe(x, w13, w2, weights, expert_ids, start.clone())
    floats = [oracles.dequantize(w) if isinstance(w, QuantizedWeight) else w for w in (w13, w2)]
    want = oracles.fused_moe(x, *floats, weights, expert_ids, start).float()

    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=1e-4)
    else:
        torch.testing.assert_close(got.float(), want, atol=6e-3 * want.abs().max().item(), rtol=6e-3)


def test_quantized_fused_moe_reads_each_experts_own_scales(triton_ops):
    """A scale changed in one expert's block moves only the tokens routed to that expert (no shared scale rows)."""
    gen = torch.Generator().manual_seed(5)
    hidden, inter, num_experts = 64, 32, 4
    x = torch.randn(4, hidden, generator=gen)
    w13 = quantize_int8(torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.1)
    w2 = quantize_int8(torch.randn(num_experts, hidden, inter, generator=gen) * 0.1)
    expert_ids = torch.tensor([[0], [1], [2], [3]])
    weights = torch.ones(4, 1)
    before = triton_ops.fused_moe(x, w13, w2, weights, expert_ids, torch.zeros(4, hidden))
    w2.scale[2, :, 0] *= 2  # expert 2's first block of inputs, every output row
    after = triton_ops.fused_moe(x, w13, w2, weights, expert_ids, torch.zeros(4, hidden))
    assert torch.equal(after[[0, 1, 3]], before[[0, 1, 3]])
    assert not torch.allclose(after[2], before[2])

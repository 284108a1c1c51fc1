"""gpt-oss's experts in the Triton fused MoE (`triton_fused_moe.fused_moe(w13_bias=, w2_bias=, clamped_swiglu=)`),
interpreted on tiny shapes, against a float64 oracle written from the definition (transformers' GptOssExperts: HF's
layout, gate and up interleaved in `gate_up_proj` [E, H, 2I]; the bias on gate_up before the activation, the down
bias after, both weighted by the routing weight), on float and MXFP4 stacks (MXFP4 read by the spec's tables).

The kernel takes tsterm's layout (w13 [E, 2I, H]: gate rows, then up rows), which the loader makes from HF's;
`to_tsterm` here is that reordering. `oracle_experts` is also checked against transformers' own module once.
"""
from __future__ import annotations

import pytest
import torch
from tsterm_kernels.quant import QuantizedWeight
from tsterm_kernels.triton_fused_moe import fused_moe

from tests.kernels.test_mxfp4 import oracle_weight, random_mxfp4, spec_e2m1, spec_e8m0

F64 = torch.float64
ALPHA = 1.702


def oracle_experts(x: torch.Tensor, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                   down_bias: torch.Tensor | None, weights: torch.Tensor, expert_ids: torch.Tensor, alpha: float,
                   limit: float, out: torch.Tensor) -> torch.Tensor:
    """out + sum over each token's slots of weight * expert(x), in float64, HF's layout: gate_up [E, H, 2I] (column 2i
    gate i, 2i + 1 up i), gate_up_bias [E, 2I], down [E, I, H], down_bias [E, H] (None: zero). An id >= E adds
    nothing (another rank's expert). expert(x) = ((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)) down + b,
    g = min(gate, limit), [gate | up] = x gate_up + gate_up_bias."""
    result = out.to(F64).clone()
    for t in range(x.shape[0]):
        for slot in range(expert_ids.shape[1]):
            e = int(expert_ids[t, slot])
            if e >= gate_up.shape[0]:
                continue
            h = x[t].to(F64) @ gate_up[e].to(F64) + gate_up_bias[e].to(F64)  # [2I]
            gate, up = h[0::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
            y = ((up + 1) * gate * torch.sigmoid(alpha * gate)) @ down[e].to(F64)
            if down_bias is not None:
                y = y + down_bias[e].to(F64)
            result[t] += float(weights[t, slot]) * y
    return result


def to_tsterm(gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor) -> tuple:
    """HF's interleaved layout -> tsterm's: w13 [E, 2I, H] (gate rows, then up rows), w13_bias [E, 2I], w2 [E, H, I]."""
    w13 = torch.cat((gate_up[:, :, 0::2], gate_up[:, :, 1::2]), 2).transpose(1, 2).contiguous()
    b13 = torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), 1).contiguous()
    return w13, b13, down.transpose(1, 2).contiguous()


def spec_dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float64 stack [..., O, I] an mxfp4 stack stands for (test_mxfp4's spec tables, by indexing): byte j of a
    block holds input 2j (low nibble) and 2j + 1 (high)."""
    e2m1 = torch.tensor([spec_e2m1(c) for c in range(16)], dtype=F64)
    e8m0 = torch.tensor([spec_e8m0(s) for s in range(256)], dtype=F64)
    *lead, out_f, in_f = w.dims
    data = w.data.cpu().to(torch.int64).reshape(*lead, out_f, in_f // 32, 16)
    codes = torch.stack((data & 15, data >> 4), -1).flatten(-2)  # [..., O, I/32, 32]
    values = e2m1[codes] * e8m0[w.scale.cpu().to(torch.int64)][..., None]
    return values.flatten(-2)


def random_case(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, seed: int) -> dict:
    """HF-layout float64 experts with biases, routing (distinct experts per token), inputs large enough that the
    clamp cuts some gates and ups."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, dtype=F64)
    gate_up = torch.randn(num_experts, hidden, 2 * inter, generator=gen, dtype=F64) * 2.5 * hidden ** -0.5
    gate_up_bias = torch.randn(num_experts, 2 * inter, generator=gen, dtype=F64)
    down = torch.randn(num_experts, inter, hidden, generator=gen, dtype=F64) * inter ** -0.5
    down_bias = torch.randn(num_experts, hidden, generator=gen, dtype=F64)
    expert_ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(-1)[:, :top_k].contiguous()
    weights = torch.rand(num_tokens, top_k, generator=gen).softmax(-1)
    start = torch.randn(num_tokens, hidden, generator=gen, dtype=F64)
    return dict(x=x, gate_up=gate_up, gate_up_bias=gate_up_bias, down=down, down_bias=down_bias,
                expert_ids=expert_ids, weights=weights, start=start)


def clamp_bites(c: dict, limit: float) -> None:
    """The case reaches the clamp: some gate above limit, some up outside [-limit, limit]."""
    h = torch.einsum("th,ehi->tei", c["x"], c["gate_up"]) + c["gate_up_bias"][None]
    assert (h[..., 0::2] > limit).any() and (h[..., 1::2].abs() > limit).any()


def test_the_oracle_is_transformers_gpt_oss_experts():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    c = random_case(5, 16, 8, 4, 2, seed=1)
    limit = 1.5
    clamp_bites(c, limit)
    cfg = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, swiglu_limit=limit)
    hf = GptOssExperts(cfg).to(F64)
    assert hf.alpha == ALPHA
    with torch.no_grad():
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            getattr(hf, name).copy_(c[{"gate_up_proj": "gate_up", "gate_up_proj_bias": "gate_up_bias",
                                       "down_proj": "down", "down_proj_bias": "down_bias"}[name]])
        want = hf(c["x"], c["expert_ids"], c["weights"].to(F64))  # (its router's scores: [T, k])
    got = oracle_experts(c["x"], c["gate_up"], c["gate_up_bias"], c["down"], c["down_bias"], c["weights"],
                         c["expert_ids"], ALPHA, limit, torch.zeros(5, 16, dtype=F64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k", [
    (1, 32, 16, 6, 2),  # decode: one token
    (5, 40, 24, 7, 3),  # hidden / inter not multiples of the tiles
    (19, 32, 40, 10, 4),  # several tiles for the busier experts
])
def test_float_stacks_match_the_oracle(poison, dtype, num_tokens, hidden, inter, num_experts, top_k):
    limit = 1.5
    c = random_case(num_tokens, hidden, inter, num_experts, top_k, seed=num_tokens * 7 + hidden)
    clamp_bites(c, limit)
    w13, b13, w2 = (t.to(dtype) for t in to_tsterm(c["gate_up"], c["gate_up_bias"], c["down"]))
    x = torch.cat((torch.zeros(num_tokens, 8, dtype=F64), c["x"]), 1).to(dtype)[:, 8:]  # a strided view
    out = c["start"].to(dtype)
    got = fused_moe(x, w13, w2, c["weights"].float(), c["expert_ids"], out, w13_bias=b13,
                    w2_bias=c["down_bias"].to(dtype), clamped_swiglu=(ALPHA, limit))
    # the oracle on the stored (rounded) values
    back = lambda t: t.to(dtype).to(F64)  # noqa: E731
    want = oracle_experts(back(c["x"]), back(c["gate_up"]), back(c["gate_up_bias"]), back(c["down"]),
                          back(c["down_bias"]), c["weights"].float(), c["expert_ids"], ALPHA, limit, back(c["start"]))
    assert got is out and got.dtype == dtype
    rel = 2e-5 if dtype == torch.float32 else 6e-3
    torch.testing.assert_close(got.to(F64), want, rtol=rel, atol=rel * want.abs().max().item())


@pytest.mark.parametrize("num_tokens", [1, 6])
def test_without_the_down_bias_and_with_other_ranks_experts(poison, num_tokens):
    """A tensor-parallel rank > 0 has no down bias (rank 0 adds it); an expert-parallel rank's sentinel id E_local
    marks another rank's expert, which adds nothing (its bias neither)."""
    limit = 1.2
    c = random_case(num_tokens, 32, 16, 6, 3, seed=40 + num_tokens)
    held = 4  # this rank holds experts 0..3; ids 4, 5 become the sentinel 4
    ids = c["expert_ids"].masked_fill(c["expert_ids"] >= held, held)
    assert (ids == held).any() and (ids < held).any()
    w13, b13, w2 = to_tsterm(c["gate_up"][:held], c["gate_up_bias"][:held], c["down"][:held])
    got = fused_moe(c["x"].float(), w13.float(), w2.float(), c["weights"].float(), ids, c["start"].float(),
                    w13_bias=b13.float(), clamped_swiglu=(ALPHA, limit))
    want = oracle_experts(c["x"], c["gate_up"][:held], c["gate_up_bias"][:held], c["down"][:held], None,
                          c["weights"].float(), ids, ALPHA, limit, c["start"])
    torch.testing.assert_close(got.to(F64), want, rtol=2e-5, atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 6, 2), (13, 5, 3)])
def test_mxfp4_stacks_match_the_oracle(poison, num_tokens, num_experts, top_k):
    """gpt-oss's experts as shipped: MXFP4 w13 and w2 read as stored, float biases (the checkpoint's)."""
    hidden, inter, limit = 64, 32, 1.5
    c = random_case(num_tokens, hidden, inter, num_experts, top_k, seed=60 + num_tokens)
    w13 = random_mxfp4(2 * inter, hidden, 61, (num_experts,))
    w2 = random_mxfp4(hidden, inter, 62, (num_experts,))
    x = (c["x"] * 0.05).float()
    b13 = torch.cat((c["gate_up_bias"][:, 0::2], c["gate_up_bias"][:, 1::2]), 1).float()
    got = fused_moe(x, w13, w2, c["weights"].float(), c["expert_ids"], c["start"].float(), w13_bias=b13,
                    w2_bias=c["down_bias"].float(), clamped_swiglu=(ALPHA, limit))
    w13f, w2f = spec_dequantize(w13), spec_dequantize(w2)  # tsterm's layout -> HF's, interleaving gate and up
    assert torch.equal(w2f[1], oracle_weight(w2[1]))  # the indexed tables read the bytes as test_mxfp4's loop does
    gate_up = torch.stack((w13f[:, :inter], w13f[:, inter:]), 2).flatten(1, 2).transpose(1, 2)  # [E, H, 2I]
    want = oracle_experts(x, gate_up, c["gate_up_bias"].float(), w2f.transpose(1, 2), c["down_bias"].float(),
                          c["weights"].float(), c["expert_ids"], ALPHA, limit, c["start"].float())
    h = torch.einsum("th,ehi->tei", x.to(F64), gate_up) + c["gate_up_bias"].float().to(F64)[None]
    assert (h[..., 0::2] > limit).any() and (h[..., 1::2].abs() > limit).any()  # the clamp bites
    torch.testing.assert_close(got.to(F64), want, rtol=1e-4, atol=2e-5 * want.abs().max().item())


def test_bad_biases_are_refused():
    x, w13, w2 = torch.zeros(2, 32), torch.zeros(3, 16, 32), torch.zeros(3, 32, 8)
    ids, weights = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(AssertionError, match="w13_bias"):
        fused_moe(x, w13, w2, weights, ids, torch.zeros(2, 32), w13_bias=torch.zeros(3, 8))
    with pytest.raises(AssertionError, match="w2_bias"):
        fused_moe(x, w13, w2, weights, ids, torch.zeros(2, 32), w2_bias=torch.zeros(2, 32))

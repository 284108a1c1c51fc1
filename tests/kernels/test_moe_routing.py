"""The router's kinds (`tsterm_kernels.routing`: sigmoid scores, a selection-only bias, group-limited choice, a
scale) in the torch ops (the CPU path) and the Triton kernel (interpreted), against a float64 oracle written here
from the published routing (GLM-4.5 / DeepSeek-V3's grouped top-k, MiniMax-M2's biased sigmoid)."""
from __future__ import annotations

import pytest
import torch

from tsterm_kernels import torch_ops
from tsterm_kernels.routing import Routing

F64 = torch.float64


def oracle_route(logits: torch.Tensor, top_k: int, renormalize: bool, routing: Routing):
    """Float64, token by token, in plain Python lists: (weights [T, k] float64, ids [T, k]) with ids in descending
    order of choice, ties to the lower id (the callers' inputs avoid ties)."""
    all_weights, all_ids = [], []
    for row in logits.to(F64).tolist():
        if routing.scoring == "sigmoid":
            scores = [float(torch.sigmoid(torch.tensor(v, dtype=F64))) for v in row]
        else:
            exps = torch.exp(torch.tensor(row, dtype=F64) - max(row))
            scores = (exps / exps.sum()).tolist()
        bias = routing.bias.tolist() if routing.bias is not None else [0.0] * len(row)
        choice = [s + b for s, b in zip(scores, bias)]
        candidates = list(range(len(row)))
        if routing.num_groups > 1:
            size = len(row) // routing.num_groups
            group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2])
                           for g in range(routing.num_groups)]
            best_groups = sorted(range(routing.num_groups), key=lambda g: (-group_score[g], g))[:routing.topk_groups]
            candidates = [e for e in candidates if e // size in best_groups]
        ids = sorted(candidates, key=lambda e: (-choice[e], e))[:top_k]
        weights = [scores[e] for e in ids]
        if renormalize:
            total = sum(weights)
            weights = [w / total for w in weights]
        all_weights.append([w * routing.scale for w in weights])
        all_ids.append(ids)
    return torch.tensor(all_weights, dtype=F64), torch.tensor(all_ids, dtype=torch.int64)


def distinct_logits(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Logits whose scores, biased choices and group sums do not tie in any row (a tie's order is the kernels')."""
    ranks = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)])  # [T, E]
    return ranks.float() * (6.0 / num_experts) - 3.0 + torch.rand(num_tokens, num_experts, generator=gen) * 0.01


# (experts, top_k, groups, topk_groups, bias, scale, renormalize)
KINDS = [
    (8, 2, 1, 1, True, 1.0, True),  # MiniMax-M2: biased sigmoid, renormalised
    (6, 3, 1, 1, False, 1.0, False),  # plain sigmoid, not renormalised
    (16, 4, 4, 2, True, 2.5, True),  # GLM-4.5 / DeepSeek-V3: groups, bias, routed_scaling_factor
    (12, 3, 3, 1, True, 1.0, False),  # one group kept of three
    (10, 8, 5, 4, True, 0.5, True),  # top_k near the kept experts' count
    (24, 2, 8, 3, False, 1.0, True),  # many groups (DeepSeek's eight), no bias
]


def make_kind(experts, groups, topk_groups, bias, scale, gen) -> Routing:
    # a bias large enough to change which experts win (the weights must still be the unbiased scores)
    b = (torch.rand(experts, generator=gen) - 0.5) if bias else None
    return Routing("sigmoid", b, groups, topk_groups, scale)


def test_the_bias_changes_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    routing = Routing("sigmoid", torch.tensor([0.0, 0.0, 0.0, 0.9]))
    weights, ids = torch_ops.moe_route(logits, 2, False, routing)
    assert ids.tolist() == [[3, 0]]  # sigmoid(-1) + 0.9 = 1.17 beats sigmoid(2) = 0.88 and sigmoid(1) = 0.73
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))


def test_groups_limit_the_choice():
    # group 0 = {0, 1}, group 1 = {2, 3}: expert 0 alone is best, but group 1's two together beat group 0's
    logits = torch.tensor([[3.0, -3.0, 1.0, 1.5]])
    weights, ids = torch_ops.moe_route(logits, 1, False, Routing("sigmoid", None, 2, 1))
    assert ids.tolist() == [[3]]


@pytest.mark.parametrize("num_tokens", [1, 5, 70])  # 70: the C path's threaded loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # both on the CPU: the C path (csrc/stack.c; a
# bfloat16 model's logits routed in float32 on their exact values, as a float32 model's are)
@pytest.mark.parametrize("kind", KINDS, ids=[f"E{k[0]}-k{k[1]}-g{k[2]}of{k[3]}" for k in KINDS])
def test_torch_route_matches_the_oracle(native_spy, poison, num_tokens, dtype, kind):
    experts, top_k, groups, topk_groups, bias, scale, renormalize = kind
    gen = torch.Generator().manual_seed(num_tokens * 31 + experts)
    logits = distinct_logits(num_tokens, experts, gen).to(dtype)
    routing = make_kind(experts, groups, topk_groups, bias, scale, gen)
    spy = native_spy("moe_route_sigmoid")
    weights, ids = torch_ops.moe_route(logits, top_k, renormalize, routing)
    assert spy.calls == 1
    want_weights, want_ids = oracle_route(logits, top_k, renormalize, routing)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-5)


def test_the_c_path_and_its_torch_twin_choose_alike_on_random_rows():
    """Random logits and biases (near-ties included, as a model's are): the C routing and the torch ops' own (the
    twin the other devices run) choose the same experts and weigh them within float rounding."""
    gen = torch.Generator().manual_seed(5)
    for experts, top_k, groups, topk_groups in ((16, 4, 4, 2), (8, 2, 1, 1), (24, 6, 8, 3)):
        logits = torch.randn(300, experts, generator=gen)
        routing = Routing("sigmoid", torch.rand(experts, generator=gen) * 0.2, groups, topk_groups, 2.5)
        weights, ids = torch_ops.moe_route(logits, top_k, True, routing)  # C
        twin_weights, twin_ids = torch_ops._scored_route(logits.double(), top_k, True, routing)  # torch (float32)
        assert torch.equal(ids, twin_ids)
        torch.testing.assert_close(weights, twin_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS, ids=[f"E{k[0]}-k{k[1]}-g{k[2]}of{k[3]}" for k in KINDS])
def test_triton_route_matches_the_oracle(triton_ops, poison, dtype, kind):
    experts, top_k, groups, topk_groups, bias, scale, renormalize = kind
    gen = torch.Generator().manual_seed(experts * 7 + top_k)
    logits = distinct_logits(5, experts, gen).to(dtype)
    routing = make_kind(experts, groups, topk_groups, bias, scale, gen)
    weights, ids = triton_ops.moe_route(logits, top_k, renormalize, routing)
    want_weights, want_ids = oracle_route(logits, top_k, renormalize, routing)
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(weights, want_weights.float(), atol=1e-6, rtol=1e-5)


def test_the_default_kind_is_the_softmax_router(triton_ops):
    """Routing() and None are one router: the existing softmax path, bit for bit, in both implementations."""
    logits = distinct_logits(9, 7, torch.Generator().manual_seed(3))
    for ops in (torch_ops, triton_ops):
        for renormalize in (True, False):
            plain = ops.moe_route(logits, 3, renormalize)
            kind = ops.moe_route(logits, 3, renormalize, Routing())
            assert torch.equal(plain[0], kind[0]) and torch.equal(plain[1], kind[1])


@pytest.mark.parametrize("make, field", [
    (lambda: Routing("tanh"), "scoring"),
    (lambda: Routing("sigmoid", None, 4, 5), "topk_groups"),
    (lambda: Routing("sigmoid", torch.zeros(4, dtype=torch.float16)), "bias"),
    (lambda: Routing("sigmoid", scale=0.0), "scale"),
])
def test_a_bad_kind_names_its_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("routing, experts, top_k, field", [
    (Routing("sigmoid", None, 3, 1), 8, 2, "num_groups"),  # 8 experts do not split in 3
    (Routing("sigmoid", None, 4, 1), 4, 1, "at least 2"),  # groups of one
    (Routing("sigmoid", None, 4, 1), 8, 3, "top_k"),  # one group of two cannot give three
    (Routing("sigmoid", torch.zeros(5)), 8, 2, "bias"),
])
def test_a_kind_that_cannot_route_these_experts_says_why(routing, experts, top_k, field):
    with pytest.raises(ValueError, match=field):
        torch_ops.moe_route(torch.zeros(1, experts), top_k, True, routing)

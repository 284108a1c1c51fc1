"""The sigmoid router kinds (tsterm_kernels.routing) in the compiled Triton routing kernel on a CUDA device, at the
real models' sizes (GLM-4.5-Air, MiniMax-M2, DeepSeek-V3's eight groups), in bfloat16 and float32 logits, against the
float64 oracle of tests/kernels/test_moe_routing.py; and a tiny GLM-4.5 checkpoint decoded on the GPU through the
Triton kernels, token-exact with transformers.

Skipped without CUDA, and under TRITON_INTERPRET (tests/conftest.py sets it for the CPU suite): run with
`pytest --noconftest tests/kernels/test_moe_routing_gpu.py` (to be listed in scripts/gpu_check.sh's GPU_TESTS).
Self-contained: no fixtures from conftest files.
"""
from __future__ import annotations

import os

import pytest
import torch
from tsterm_kernels import triton_ops
from tsterm_kernels.routing import Routing

from tests.kernels.test_moe_routing import distinct_logits, oracle_route

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels only: run with --noconftest (see the module docstring)"),
]

# (name, experts, top_k, groups, topk_groups, scale, renormalize)
REAL = [("glm-4.5-air", 128, 8, 1, 1, 1.0, True), ("glm-4.5", 160, 8, 1, 1, 2.5, True),
        ("minimax-m2", 256, 8, 1, 1, 1.0, True), ("deepseek-v3", 256, 8, 8, 4, 2.5, True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("case", REAL, ids=[c[0] for c in REAL])
def test_sigmoid_routing_on_the_device_matches_the_oracle(case, num_tokens, dtype):
    _, experts, top_k, groups, topk_groups, scale, renormalize = case
    gen = torch.Generator().manual_seed(experts + num_tokens)
    logits = distinct_logits(num_tokens, experts, gen).to(dtype)
    bias = (torch.rand(experts, generator=gen) - 0.5) * 0.1
    routing = Routing("sigmoid", bias.cuda(), groups, topk_groups, scale)
    weights, ids = triton_ops.moe_route(logits.cuda(), top_k, renormalize, routing)
    want_weights, want_ids = oracle_route(logits, top_k, renormalize, Routing("sigmoid", bias, groups, topk_groups,
                                                                              scale))
    assert ids.cpu().tolist() == want_ids.tolist()
    torch.testing.assert_close(weights.cpu(), want_weights.float(), atol=1e-6, rtol=1e-5)


def test_a_glm_checkpoint_decodes_token_exact_on_the_device(tmp_path):
    from tsterm import LLM, SamplingParams

    from tests.helpers.checkpoints import make_checkpoint

    model_dir, hf_model = make_checkpoint(tmp_path / "glm", "glm4_moe", dict(
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True, num_attention_heads=5,
        num_key_value_heads=1, partial_rotary_factor=0.5))
    llm = LLM(str(model_dir), dtype="float32", device="cuda", block_size=4, num_kv_blocks=64, kernels="triton")
    prompt = torch.randint(0, hf_model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert out.token_ids == ids[len(prompt):]

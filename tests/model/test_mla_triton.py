"""DeepSeek-V3's MLA through the Triton ops (interpreted on the CPU, as a GPU runs them compiled): every absorbed step
(decodes, short prompt chunks, verify steps) attends through the MLA kernel (`tsterm_kernels.triton_mla`), never
through the generic paged attention, and the model stays token-exact with transformers (a 70-token prompt expanded,
decodes over its latents absorbed); speculation through the kernel stays lossless (a verify step's rows are the
decode's)."""
from __future__ import annotations

import random

import pytest
import torch
from tsterm_kernels import triton_mla, triton_ops

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import reference_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHAPE = dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
             n_shared_experts=1, num_attention_heads=5, num_key_value_heads=5, q_lora_rank=20, kv_lora_rank=24,
             qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, num_hidden_layers=2)
OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, kernels="triton")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mla_triton") / "deepseek_v3", "deepseek_v3", SHAPE)


@pytest.fixture
def kernel_rows(monkeypatch):
    """The rows each MLA kernel call attended (the ops bind it when the engine loads them), and no generic paged
    attention call."""
    rows = []
    kernel = triton_mla.mla_attention
    monkeypatch.setattr(triton_mla, "mla_attention", lambda q_lat, *rest: rows.append(q_lat.shape[0])
                        or kernel(q_lat, *rest))

    def refuse(*args, **kwargs):
        raise AssertionError("an MLA layer went through the generic paged attention")
    monkeypatch.setattr(triton_ops, "paged_attention", refuse)
    return rows


def test_greedy_through_the_mla_kernel_matches_transformers(checkpoint, kernel_rows):
    model_dir, hf_model = checkpoint
    llm = LLM(str(model_dir), **OPTIONS)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (11, 5, 70)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(hf_model, prompt, 8)[0], f"prompt of {len(prompt)}"
    # every chunk absorbed (deterministic: the three prompts' 86 rows in one kernel call), then every decode step
    assert sum(map(len, prompts)) in kernel_rows and 3 in kernel_rows


def test_speculation_through_the_mla_kernel_is_lossless(checkpoint, kernel_rows):
    rng = random.Random(0)
    prompts = []
    for i in range(3):  # repeated prompts (drafts from the repeats) and one that is not
        base = [rng.randrange(8, 380) for _ in range(rng.randrange(6, 12))]
        prompts.append(base * 4 if i % 2 == 0 else base)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [out.token_ids for out in LLM(str(checkpoint[0]), **OPTIONS).generate(prompts, params)]
    llm = LLM(str(checkpoint[0]), speculative_method="ngram", num_speculative_tokens=4, **OPTIONS)
    llm.engine.draft_length = None  # every draft verified whole (the cost-aware cut depends on timings)
    kernel_rows.clear()
    assert [out.token_ids for out in llm.generate(prompts, params)] == want
    stats = llm.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]  # verify steps kept and dropped drafts
    # verify steps through the kernel: more rows than one per sequence, fewer than the prompts' prefill
    assert any(len(prompts) < n < sum(map(len, prompts)) for n in kernel_rows), kernel_rows

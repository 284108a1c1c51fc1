"""DeepSeek-V3's MLA on the CPU through csrc/mla.c (tsterm_kernels.cpu_mla), in the model and the engine.

The layer: the absorbed form calls the C kernel (not the generic paged attention) for a float32 and a bfloat16 latent
pool and equals the float64 oracle of tests/model/test_mla.py; with the C kernels forced off for its attention
(TSTERM_CPU_KERNELS=torch) it takes the paged attention, with the same result to float32 rounding.

The engine keeps the invariance promise (DESIGN.md) for an MLA model whose prompt chunks are all absorbed (at most 64
rows a step, under the layer's absorb_max_rows): a request's tokens and logprobs are the same bits alone, beside
other prompts and decodes, with its prefix from the cache, under another chunking and on one thread, over a context
past the kernel's first 512-key split."""
from __future__ import annotations

import random

import pytest
import torch
from tsterm_kernels import cpu_select

from tsterm import LLM, SamplingParams
from tsterm.model.mla import MLAttention

from tests.helpers.checkpoints import make_checkpoint
from tests.kernels.conftest import NativeSpy
from tests.model.test_mla import config, layer, meta_for, oracle, queries

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model: op-overhead bound


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16])
def test_the_absorbed_form_runs_the_c_kernel_and_equals_the_definition(monkeypatch, pool):
    mla = layer(config(24), num_blocks=40)
    if pool is torch.bfloat16:
        mla.cache = mla.cache.to(torch.bfloat16)  # the oracle reads the pool's (bfloat16) values exactly
    seqs = [([7, 8, 3, 11, 12, 13], 22, 1), ([20, 21, 22], 11, 5), ([30], 2, 2)]  # a decode, a verify-like chunk, a prompt
    meta = meta_for(seqs)
    q_nope, q_rope = queries(mla, 8, seed=4)
    spy = NativeSpy(monkeypatch, "mla_attention")
    got = mla.absorbed(q_nope, q_rope, meta, torch.float32)
    assert spy.calls == 1
    row = 0
    for table, seq_len, m in seqs:
        want = oracle(mla, q_nope[row:row + m], q_rope[row:row + m], table, seq_len)
        torch.testing.assert_close(got[row:row + m].double(), want, rtol=1e-4, atol=1e-5)
        row += m
    monkeypatch.setenv(cpu_select.ENV, "torch")  # the layer's fallback: the paged attention over the latent rows
    fallback = mla.absorbed(q_nope, q_rope, meta, pool)  # (its queries in the model's dtype: bfloat16 rounds them)
    assert spy.calls == 1
    tolerance = dict(rtol=1e-4, atol=1e-5) if pool is torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(fallback, got, **tolerance)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, ignore_eos=True, logprobs=2, seed=5)
OPTIONS = dict(dtype="float32", device="cpu", block_size=16, num_kv_blocks=192, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    overrides = dict(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, q_lora_rank=20,
                     n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                     n_shared_experts=1, num_attention_heads=5, num_key_value_heads=5, num_hidden_layers=2,
                     max_position_embeddings=1024)
    path, _ = make_checkpoint(tmp_path_factory.mktemp("mla_cpu") / "m", "deepseek_v3", overrides)
    rng = random.Random(6)
    lengths = [530, 40] + [rng.randrange(5, 60) for _ in range(4)]
    prompts = [[rng.randrange(10, 380) for _ in range(n)] for n in lengths]
    solo = {p.seed: _outputs(LLM(str(path), **OPTIONS), [prompts[0]], p)[0] for p in (GREEDY, SEEDED)}
    return str(path), prompts, solo


def _outputs(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    return [(c.token_ids, repr(c.logprobs)) for o in llm.generate(prompts, params) for c in o.outputs]


def test_cached_batched_rechunked_and_one_thread_requests_give_the_solo_bits(model, monkeypatch):
    path, prompts, solo = model
    llm = LLM(path, **OPTIONS)
    spy = NativeSpy(monkeypatch, "mla_attention")
    for params in (GREEDY, SEEDED):
        assert _outputs(llm, prompts[:5], params)[0] == solo[params.seed], "beside other prompts and decodes"
        again = llm.generate([prompts[0]], params)[0]
        assert again.num_cached_tokens > 0
        assert _outputs(llm, [prompts[0]], params)[0] == solo[params.seed], "its prefix from the cache"
    assert spy.calls > 0
    rechunked = LLM(path, **dict(OPTIONS, max_num_batched_tokens=16))
    assert _outputs(rechunked, prompts[:3], GREEDY)[0] == solo[GREEDY.seed], "chunks of 16"
    before = torch.get_num_threads()
    try:
        llm.engine.executor.cpu_threads = None  # the thread governor off
        for threads in (1, 2):
            torch.set_num_threads(threads)  # torch's and the C kernels' OpenMP threads (one libgomp)
            assert _outputs(llm, prompts[1:4] + prompts[:1], SEEDED)[-1] == solo[SEEDED.seed], f"{threads} threads"
    finally:
        torch.set_num_threads(before)


def test_a_long_prompt_in_one_chunk_gives_the_chunked_bits(model, monkeypatch):
    """By default (`deterministic: true`) a prompt chunk longer than the expanded form's break-even is absorbed too:
    the 530-token prompt in one chunk gives the bits of its 64-token chunks (expanded, it would not). With
    `deterministic: false` such a chunk is expanded."""
    path, prompts, solo = model
    calls = []
    expanded = MLAttention.expanded
    monkeypatch.setattr(MLAttention, "expanded", lambda self, *a: calls.append(1) or expanded(self, *a))
    whole = LLM(path, **dict(OPTIONS, max_num_batched_tokens=1024))
    assert _outputs(whole, [prompts[0]], GREEDY)[0] == solo[GREEDY.seed]
    assert not calls
    LLM(path, **dict(OPTIONS, max_num_batched_tokens=1024, deterministic=False)).generate([prompts[0]], GREEDY)
    assert calls

"""The invariance promise (DESIGN.md: a request's tokens and logprobs are the same bits whether its prefix came from the
cache or was computed, alone or batched, whatever the chunking and the thread count) with dtype bfloat16 on the CPU,
for every family the engine runs there: the MoE families, glm4_moe, minimax_m2, gpt_oss, deepseek_v3 (MLA) and the
hybrids (tests/engine/test_invariance.py holds the attention + SwiGLU families' matrix in bfloat16). Greedy and seeded
sampling with logprobs; each case against the same request alone on a fresh engine.

The hybrids promise less, as in float32: their recurrent state is computed by the chunked rule over each piece of a
prompt the scheduler cuts and by the per-token rule in decode, so their bits depend on where a prompt is cut
(test_invariance.py's hybrid section): checked here with every prompt in one piece, alone, beside 2 and 8 others, on
one thread and on two. (deepseek_v3's MLA absorbs every prompt chunk by default, so its long prompt is checked like
the others'; with `deterministic: false` a long chunk is expanded, another arithmetic.)"""
from __future__ import annotations

import random

import pytest
import torch

from tsterm import LLM, SamplingParams

from tests.helpers.bf16_families import FAMILIES, make_family

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, ignore_eos=True, logprobs=2, seed=5)
OPTIONS = dict(dtype="bfloat16", device="cpu", block_size=16, num_kv_blocks=256)
ATTENTION = [name for name, (_, _, hybrid) in FAMILIES.items() if not hybrid]
HYBRIDS = [name for name, (_, _, hybrid) in FAMILIES.items() if hybrid]


def _outputs(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    return [(c.token_ids, repr(c.logprobs)) for o in llm.generate(prompts, params) for c in o.outputs]


def _model(root, name: str, lengths: list[int]):
    """(model dir, prompts, the first two prompts' solo outputs under GREEDY and SEEDED: each request alone on an engine
    that caches nothing)."""
    path, _ = make_family(root, name, dict(max_position_embeddings=1024))
    rng = random.Random(4)
    prompts = [[rng.randrange(10, 380) for _ in range(n)] for n in lengths]
    alone = LLM(str(path), **dict(OPTIONS, enable_prefix_caching=False))
    solo = {(i, p.seed): _outputs(alone, [prompts[i]], p)[0] for i in (0, 1) for p in (GREEDY, SEEDED)}
    return str(path), prompts, solo


@pytest.fixture(scope="module", params=ATTENTION)
def model(request, tmp_path_factory):
    """A short prompt and a long one (300 tokens: blocks of 16, several prefill chunks), then six neighbours."""
    rng = random.Random(3)
    return _model(tmp_path_factory.mktemp("bf16_inv"), request.param,
                  [30, 300] + [rng.randrange(5, 90) for _ in range(6)])


def test_cached_batched_and_one_thread_requests_give_the_solo_bits(model):
    path, prompts, solo = model
    llm = LLM(path, **OPTIONS)
    for params in (GREEDY, SEEDED):
        for index in (0, 1):
            assert _outputs(llm, [prompts[index]], params)[0] == solo[index, params.seed], "cold"
            again = llm.generate([prompts[index]], params)[0]
            assert again.num_cached_tokens > 0
            assert _outputs(llm, [prompts[index]], params)[0] == solo[index, params.seed], "its prefix cached"
        for batch in (3, 7):  # beside other prompts and decodes
            assert _outputs(llm, prompts[1:1 + batch], params)[0] == solo[1, params.seed], f"batch of {batch}"
        assert _outputs(llm, prompts[:1] + prompts[2:], params)[0] == solo[0, params.seed]
    before = torch.get_num_threads()
    try:
        llm.engine.executor.cpu_threads = None  # the thread governor off: one thread, however idle the machine
        torch.set_num_threads(1)  # torch's and the C kernels' OpenMP threads (one libgomp)
        for params in (GREEDY, SEEDED):
            got = _outputs(llm, prompts[2:4] + prompts[1:2], params)[2]
            assert got == solo[1, params.seed], "one thread"
    finally:
        torch.set_num_threads(before)


def test_prefill_chunks_cut_inside_blocks_give_the_solo_bits(model):
    """A 24-token budget: the long prompt in chunks whose boundaries fall inside its 16-token blocks."""
    path, prompts, solo = model
    llm = LLM(path, **dict(OPTIONS, max_num_batched_tokens=24))
    for params in (GREEDY, SEEDED):
        assert _outputs(llm, prompts[1:4], params)[0] == solo[1, params.seed]


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_hybrids_request_has_its_solo_bits_in_any_batch(tmp_path, name):
    """Every prompt fits the step's budget (one piece each): the first request's bits alone on a fresh engine equal
    those beside 2 and 8 others, on two threads and on one."""
    rng = random.Random(4)
    path, prompts, solo = _model(tmp_path, name, [rng.randrange(20, 40) for _ in range(9)])  # solo: prompt 0
    llm = LLM(path, **OPTIONS)
    before = torch.get_num_threads()
    try:
        for params in (GREEDY, SEEDED):
            for batch in (3, 9):
                assert _outputs(llm, prompts[:batch], params)[0] == solo[0, params.seed], f"batch of {batch}"
        llm.engine.executor.cpu_threads = None
        torch.set_num_threads(1)
        for params in (GREEDY, SEEDED):
            assert _outputs(llm, prompts[:9], params)[0] == solo[0, params.seed], "one thread"
    finally:
        torch.set_num_threads(before)

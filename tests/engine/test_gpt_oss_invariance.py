"""gpt-oss keeps the invariance promise (DESIGN.md: a request's tokens and logprobs are the same bits whether its
prefix came from the cache or was computed, alone or batched, whatever the chunking and the thread count) now that its
sink / sliding-window attention runs the C kernels: a float32 checkpoint with a window of 100 (shorter than the long
prompt, not a multiple of the 16-token blocks nor of the 128-position splits) beside full-attention layers."""
from __future__ import annotations

import random

import pytest
import torch

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=6, ignore_eos=True, logprobs=2, seed=5)
OPTIONS = dict(dtype="float32", device="cpu", block_size=16, num_kv_blocks=256)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    overrides = dict(num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5, num_key_value_heads=1,
                     sliding_window=100, num_hidden_layers=2, max_position_embeddings=1024)
    path, _ = make_checkpoint(tmp_path_factory.mktemp("gpt_oss_inv") / "m", "gpt_oss", overrides)
    rng = random.Random(4)
    lengths = [30, 420] + [rng.randrange(5, 90) for _ in range(6)]
    prompts = [[rng.randrange(10, 380) for _ in range(n)] for n in lengths]
    solo = {(i, p.seed): _outputs(LLM(str(path), **OPTIONS), [prompts[i]], p)[0]
            for i in (0, 1) for p in (GREEDY, SEEDED)}
    return str(path), prompts, solo


def _outputs(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    return [(c.token_ids, repr(c.logprobs)) for o in llm.generate(prompts, params) for c in o.outputs]


def test_cached_and_batched_requests_give_the_solo_bits(model):
    path, prompts, solo = model
    llm = LLM(path, **OPTIONS)
    for params in (GREEDY, SEEDED):
        for index in (0, 1):
            llm.generate([prompts[index]], params)
            again = llm.generate([prompts[index]], params)[0]
            assert again.num_cached_tokens > 0
            assert _outputs(llm, [prompts[index]], params)[0] == solo[index, params.seed]  # its prefix cached
        for batch in (3, 7):  # beside other prompts and decodes
            assert _outputs(llm, prompts[1:1 + batch], params)[0] == solo[1, params.seed], f"batch of {batch}"
        assert _outputs(llm, prompts[:1] + prompts[2:], params)[0] == solo[0, params.seed]


@pytest.mark.parametrize("chunk", [16, 64])
def test_any_prefill_chunking_gives_the_solo_bits(model, chunk):
    path, prompts, solo = model
    llm = LLM(path, **dict(OPTIONS, max_num_batched_tokens=chunk))
    for params in (GREEDY, SEEDED):
        assert _outputs(llm, prompts[1:4], params)[0] == solo[1, params.seed]


def test_one_thread_gives_the_bits_of_two(model):
    path, prompts, solo = model
    before = torch.get_num_threads()
    try:
        llm = LLM(path, **OPTIONS)
        llm.engine.executor.cpu_threads = None  # the thread governor off: one thread, however idle the machine
        torch.set_num_threads(1)  # torch's and the C kernels' OpenMP threads (one libgomp)
        for params in (GREEDY, SEEDED):
            assert _outputs(llm, prompts[1:4], params)[0] == solo[1, params.seed]
    finally:
        torch.set_num_threads(before)

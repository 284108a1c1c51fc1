"""Engine behaviour against from-scratch recomputes: multi-turn reuse, batching, pressure, fork, abort, streaming."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.engine.async_engine import AsyncEngine
from tsterm.errors import RequestError

from tests.helpers.checkpoints import make_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, model = make_checkpoint(tmp_path_factory.mktemp("engine") / "qwen3moe", "qwen3_moe",
                                  dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return path, model


@pytest.fixture(scope="module")
def fresh(checkpoint):
    """A reference engine that never reuses anything: every request computes its whole prompt."""
    return LLM(str(checkpoint[0]), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256,
               enable_prefix_caching=False)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 380) for _ in range(n)]


def test_multi_turn_reuses_every_computed_token_and_matches_recompute(checkpoint, fresh):
    llm = LLM(str(checkpoint[0]), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256)
    rng = random.Random(0)
    history = random_ids(rng, 21)
    previous_full = None
    for turn in range(6):
        out = llm.generate(history, greedy(7))[0]
        ref = fresh.generate(history, greedy(7))[0]
        assert out.token_ids == ref.token_ids, f"turn {turn}"
        assert ref.num_cached_tokens == 0
        if previous_full is not None:
            # Every token of the previous turn (its generated ones included) is served from the cache: its full
            # blocks by reference, then its partial last block, taken over. The last sampled token was never fed to
            # the model, so the KV that exists covers len - 1 tokens.
            assert out.num_cached_tokens == len(previous_full) - 1
        previous_full = history + out.token_ids
        history = previous_full + random_ids(rng, rng.randrange(3, 9))
    stats = llm.stats()
    assert stats["prefix_hit_tokens"] > 0 and stats["used"] == 0


def test_batch_of_16_mixed_lengths_equals_solo(checkpoint, fresh):
    llm = LLM(str(checkpoint[0]), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256,
              max_num_batched_tokens=48)  # forces chunked prefill mixed with decodes
    rng = random.Random(1)
    prompts = [random_ids(rng, rng.randrange(1, 40)) for _ in range(16)]
    params = [greedy(rng.randrange(1, 12)) for _ in prompts]
    batched = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batched):
        assert out.token_ids == fresh.generate(prompt, p)[0].token_ids
        assert len(out.token_ids) == p.max_tokens and out.finish_reason == "length"


def test_a_pool_too_small_for_all_preempts_and_every_output_equals_solo(checkpoint, fresh):
    # 8 prompts of 8 tokens take 2 blocks each: all are admitted at once (16 of 20 blocks). Decoding 12 tokens grows
    # each to ceil((8 + 12 - 1) / 4) = 5 blocks, 40 in all: they cannot all stay, so some must be preempted and
    # recomputed later, and their outputs must still equal a solo run's.
    num_requests, prompt_len, max_tokens, num_blocks = 8, 8, 12, 20
    blocks_each = -(-(prompt_len + max_tokens - 1) // BLOCK)
    assert num_requests * prompt_len // BLOCK <= num_blocks < num_requests * blocks_each
    llm = LLM(str(checkpoint[0]), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=num_blocks)
    rng = random.Random(2)
    prompts = [random_ids(rng, prompt_len) for _ in range(num_requests)]
    outs = llm.generate(prompts, greedy(max_tokens))
    stats = llm.stats()
    preempted = [out.request_id for out in outs if out.metrics.num_preemptions > 0]
    assert preempted, "every request kept its blocks: the pool was not too small"
    assert stats["preemptions"] == sum(out.metrics.num_preemptions for out in outs)
    assert [o.request_id for o in outs] == sorted({o.request_id for o in outs}, key=lambda r: int(r.split("-")[1]))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == fresh.generate(prompt, greedy(max_tokens))[0].token_ids, out.request_id
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert stats["used"] == 0  # nothing leaked


def test_request_that_can_never_fit_is_refused(checkpoint):
    llm = LLM(str(checkpoint[0]), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=4)
    with pytest.raises(RequestError, match="context holds 16"):
        llm.generate(list(range(10, 30)), greedy(4))
    assert llm.stats()["used"] == 0


def test_fork_shares_blocks_and_each_branch_equals_its_recompute(checkpoint):
    path, hf_model = checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64)
    prompt = random_ids(random.Random(3), 10)  # 2 full blocks + a partial one
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=8, ignore_eos=True, logprobs=0))
    max_shared, final = 0, None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
        max_shared = max(max_shared, engine.stats()["shared"])
    assert max_shared >= 2  # both full prompt blocks are referenced by both branches
    assert engine.stats()["cow_copies"] == 1  # only the partial last block was copied, once
    branches = [c.token_ids for c in final.outputs]
    assert branches[0] != branches[1]
    for completion in final.outputs:
        ids = prompt + completion.token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        expected = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion.token_ids)]
        got = [lp["logprob"] for lp in completion.logprobs]
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_abort_frees_blocks_immediately(checkpoint):
    llm = LLM(str(checkpoint[0]), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64)
    engine = llm.engine
    rid = engine.add_request(list(range(10, 40)), greedy(50))
    engine.step()
    engine.step()
    assert engine.stats()["used"] > 0
    assert engine.abort(rid)
    assert engine.stats()["used"] == 0 and not engine.has_unfinished()
    assert not engine.abort(rid)


def test_stop_token_ends_the_output_after_it(checkpoint, fresh):
    prompt = list(range(50, 62))
    full = fresh.generate(prompt, greedy(12))[0]
    stop_token = full.token_ids[5]
    out = fresh.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_token
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_token) + 1]


def test_stop_string_across_a_token_boundary_cuts_the_text_before_it(fresh):
    # The stop string is taken from this prompt's own greedy output, so it is certain to occur: the last two
    # characters before token k's text and the first one of it, with k the middle token that adds text.
    prompt, max_tokens = list(range(50, 62)), 24
    engine = fresh.engine
    engine.add_request(prompt, greedy(max_tokens))
    texts = [""]  # texts[k]: the streamed text after k generated tokens
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.token_ids) == len(texts) and out.text.startswith(texts[-1])
            texts.append(out.text)
    boundaries = [k for k in range(2, max_tokens) if len(texts[k - 1]) >= 2 and len(texts[k]) > len(texts[k - 1])]
    assert boundaries, f"the greedy output adds too little text to take a stop string from: {texts[-1]!r}"
    k = boundaries[len(boundaries) // 2]
    stop = texts[k][len(texts[k - 1]) - 2:len(texts[k - 1]) + 1]
    # the engine stops at the first token whose text completes the stop string, and cuts the text before it
    first = next(j for j, text in enumerate(texts) if stop in text)
    out = fresh.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) == first <= k < max_tokens
    assert out.text == texts[first][:texts[first].index(stop)]


async def test_async_stream_deltas_add_up_and_early_exit_aborts(checkpoint):
    llm = LLM(str(checkpoint[0]), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64)
    engine = AsyncEngine(llm.engine)
    try:
        async def run(prompt):
            deltas, last = [], None
            async for out in engine.generate(prompt, greedy(10)):
                deltas.append(out.outputs[0].delta_text)
                last = out
            return "".join(deltas), last

        (text_a, last_a), (text_b, last_b) = await asyncio.gather(run(list(range(20, 33))), run(list(range(40, 45))))
        assert text_a == last_a.text and text_b == last_b.text
        assert last_a.finished and len(last_a.token_ids) == 10

        async for _ in engine.generate(list(range(20, 60)), greedy(200)):
            break  # leaving early aborts the request: the loop closes the dropped generator, which aborts it
        while engine.stats()["running"]:  # each read waits for a step of the engine thread
            await asyncio.sleep(0)  # lets the loop run the generator's close
        assert engine.stats()["used"] == 0
    finally:
        engine.shutdown()


def test_long_prefill_is_chunked_and_never_stalls_running_decodes(checkpoint, fresh):
    llm = LLM(str(checkpoint[0]), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256,
              max_num_batched_tokens=16)
    engine = llm.engine
    short = engine.add_request(list(range(10, 15)), greedy(12))
    engine.step()  # the short request is decoding now
    long_prompt = [10 + i % 300 for i in range(240)]
    long = engine.add_request(long_prompt, greedy(3))
    progress = []
    while engine.has_unfinished():
        outs = {o.request_id: o for o in engine.step()}
        progress.append(short in outs)
        if short in outs and outs[short].finished:
            break
    assert all(progress)  # the decode made a token every step while the 240-token prompt was chunked in
    assert engine.scheduler.running and engine.scheduler.running[0].request_id == long
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.token_ids == fresh.generate(long_prompt, greedy(3))[0].token_ids

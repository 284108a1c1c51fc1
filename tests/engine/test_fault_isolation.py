"""A request can only hurt itself. Every field is checked at admission (a ValueError naming it); adding a request and
forking its samples is all or nothing; a step that fails on one request (a forward that raises on its tokens, a
sampler or a detokenizer that fails on it, a fork that cannot be made) fails that request alone, with the error, and
the others finish token for token as they do alone (greedy and seeded), with every block and state slot free after.
The oracle is a separate engine without prefix caching that runs each request by itself."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.engine.async_engine import AsyncEngine
from tsterm.engine.isolation import isolate
from tsterm.errors import DistributedError, EngineStepError

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint

BLOCK = 4
POISON = 333  # a token id the injected faults raise on
SAFETY = 120  # s: a bound for the async waits, far above what they take; a hang fails instead of blocking


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("faults") / "qwen3moe", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return str(path)


def engine_llm(path: str, **options) -> LLM:
    return LLM(path, **{**dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=128), **options})


@pytest.fixture(scope="module")
def shared(checkpoint):
    """One engine for the admission tests: each leaves it with nothing held (`assert_serves`)."""
    return engine_llm(checkpoint)


@pytest.fixture(scope="module")
def solo(checkpoint):
    """Each request alone on a fresh engine that reuses nothing: the token ids of its samples."""
    reference = engine_llm(checkpoint, enable_prefix_caching=False)

    def run(prompt: list[int], params: SamplingParams) -> list[list[int]]:
        return [c.token_ids for c in reference.generate(prompt, params)[0].outputs]
    return run


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice([t for t in range(8, 380) if t != POISON]) for _ in range(rng.randrange(6, 23))]
            for _ in range(n)]


# greedy, seeded, seeded n=2 with penalties, logprobs: every way a neighbour could be disturbed
MIXED = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
         SamplingParams(temperature=0.9, seed=11, max_tokens=9, ignore_eos=True),
         SamplingParams(temperature=1.0, seed=5, n=2, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=9,
                        ignore_eos=True),
         SamplingParams(temperature=0.8, top_p=0.9, seed=3, logprobs=2, max_tokens=9, ignore_eos=True),
         SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=9, ignore_eos=True)]


def assert_all_free(llm: LLM) -> None:
    engine = llm.engine
    stats = engine.stats()
    assert (stats["used"], stats["running"], stats["waiting"]) == (0, 0, 0), stats
    assert not engine.requests and not engine._samples
    engine.kv.pool.check_invariants()
    if engine.num_state_slots:  # what a finished sequence leaves is a kept snapshot; nothing else holds a slot
        assert engine.kv.pool.num_free_state_slots + stats["state_snapshots"] == engine.num_state_slots


def assert_serves(llm: LLM, solo) -> None:
    prompt = prompts(1, seed=99)[0]
    params = SamplingParams(temperature=0.7, seed=4, n=2, max_tokens=5, ignore_eos=True)
    assert [c.token_ids for c in llm.generate(prompt, params)[0].outputs] == solo(prompt, params)
    assert_all_free(llm)


def run_mixed(llm: LLM, solo, poisoned: list[int], params: SamplingParams) -> tuple:
    """The MIXED requests with `poisoned` (run with `params`) among them: the poisoned one's output, and a check
    that every other one equals its solo run."""
    others = prompts(len(MIXED), seed=1)
    batch = others[:2] + [poisoned] + others[2:]
    outs = llm.generate(batch, MIXED[:2] + [params] + MIXED[2:])
    failed = outs.pop(2)
    for prompt, p, out in zip(others, MIXED, outs):
        assert out.error is None and [c.token_ids for c in out.outputs] == solo(prompt, p), out.request_id
    return failed


# ---- admission ---------------------------------------------------------------------------------------------------

FIELDS = [("seed", 2**64, "[0, 2**64 - 1]"), ("seed", -1, "[0, 2**64 - 1]"), ("seed", 1.5, "integer"),
          ("n", 0, "positive"), ("logprobs", 21, "[0, 20]"), ("logprobs", True, "[0, 20]"), ("top_k", -2, "-1 or 0"),
          ("top_p", float("nan"), "finite"), ("top_p", 0.0, "(0, 1]"), ("temperature", float("inf"), "finite"),
          ("temperature", 1e-9, "0 (greedy) or in [1e-06"), ("min_p", 2.0, "[0, 1]"),
          ("repetition_penalty", 0.0, "(0, inf)"), ("frequency_penalty", 3.0, "[-2, 2]"), ("stop", [""], "non-empty"),
          ("stop", ["a", 3], "strings"), ("stop_token_ids", [-1], "non-negative"), ("max_tokens", 0, "positive"),
          ("ignore_eos", "yes", "true or false")]


@pytest.mark.parametrize("field, value, fragment", FIELDS, ids=[f"{f}={v!r}" for f, v, _ in FIELDS])
def test_an_out_of_range_field_is_a_value_error_naming_it_and_the_engine_serves_on(shared, solo, field, value,
                                                                                    fragment):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and fragment in str(info.value)
    llm = shared
    params = SamplingParams(temperature=0, max_tokens=3)
    setattr(params, field, value)  # changed after it was checked: admission checks it again
    with pytest.raises(ValueError, match=field) as info:
        llm.generate(prompts(1)[0], params)
    assert info.value.param == field and fragment in str(info.value)
    assert_serves(llm, solo)


REQUESTS = [
    ("n", lambda llm: llm.generate([5, 6], SamplingParams(n=9)), "max_num_seqs=8"),
    ("stop_token_ids", lambda llm: llm.generate([5, 6], SamplingParams(stop_token_ids=[384])), "[0, 384)"),
    ("prompt", lambda llm: llm.generate([5, 384], SamplingParams()), "[0, 384)"),
    ("prompt", lambda llm: llm.generate([5] * 64, SamplingParams()), "context holds 64"),
    ("max_tokens", lambda llm: llm.generate([5] * 60, SamplingParams(max_tokens=5)), "must be in [1, 4]"),
    ("max_tokens", lambda llm: llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=64)),
     "must be in [1, "),
    ("request_id", lambda llm: [llm.engine.add_request([5], request_id="x") for _ in range(2)], "already in use"),
]


@pytest.mark.parametrize("field, call, fragment", REQUESTS, ids=[f"{f}-{i}" for i, (f, *_) in enumerate(REQUESTS)])
def test_a_request_the_engine_cannot_serve_is_a_value_error_naming_the_field(checkpoint, solo, field, call, fragment):
    llm = engine_llm(checkpoint, max_model_len=64, max_num_seqs=8)
    with pytest.raises(ValueError) as info:
        call(llm)
    assert info.value.param == field and fragment in str(info.value), str(info.value)
    llm.engine.abort("x")
    assert_serves(llm, solo)


def test_the_default_max_tokens_is_a_cap_that_the_context_ends(checkpoint):
    llm = engine_llm(checkpoint, max_model_len=64, sampling=SamplingParams(temperature=0, max_tokens=20))
    out = llm.generate([5] * 60)[0]  # no params given: the LLM's defaults, not a request for 20 tokens
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_the_largest_seed_forks_its_samples_with_wrapped_seeds(checkpoint, solo):
    llm, prompt = engine_llm(checkpoint), prompts(1)[0]
    top = SamplingParams(temperature=0.8, seed=2**64 - 1, n=2, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, top)[0]
    # sample i draws from seed (seed + i) mod 2**64: sample 1 of the top seed is sample 0 of seed 0
    first = solo(prompt, SamplingParams(temperature=0.8, seed=2**64 - 1, max_tokens=6, ignore_eos=True))
    second = solo(prompt, SamplingParams(temperature=0.8, seed=0, max_tokens=6, ignore_eos=True))
    assert [c.token_ids for c in out.outputs] == first + second
    assert_serves(llm, solo)


def test_a_request_whose_samples_cannot_all_be_made_registers_nothing(checkpoint, solo, monkeypatch):
    import tsterm.engine.request as request_module

    llm, made = engine_llm(checkpoint), []
    real = request_module.seeded_generator

    def third_fails(seed, device):
        made.append(seed)
        if len(made) == 3:
            raise RuntimeError("no generator for you")
        return real(seed, device)

    monkeypatch.setattr(request_module, "seeded_generator", third_fails)
    with pytest.raises(RuntimeError, match="no generator"):
        llm.engine.add_request(prompts(1)[0], SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=4))
    assert not llm.engine.has_unfinished()
    monkeypatch.undo()
    assert_serves(llm, solo)


# ---- a step that fails on one request ----------------------------------------------------------------------------

def poison_forward(llm: LLM, monkeypatch, position: int) -> None:
    """The model's forward raises whenever the step computes token POISON at `position` (a prompt's: no other
    request reaches that position with a generated POISON by chance)."""
    model = llm.engine.executor.model
    forward = model.forward

    def faulty(input_ids, positions):
        if ((input_ids == POISON) & (positions == position)).any():
            raise RuntimeError(f"kernel exploded on token {POISON}")
        return forward(input_ids, positions)

    monkeypatch.setattr(model, "forward", faulty)


def test_a_forward_that_raises_on_one_requests_prompt_fails_it_alone(checkpoint, solo, monkeypatch):
    llm = engine_llm(checkpoint, max_num_batched_tokens=24)  # the poison comes in a later chunk, mid-batch
    poison_forward(llm, monkeypatch, position=35)  # past the others' 22 + 9 tokens
    poisoned = [7 + i for i in range(35)] + [POISON, 9, 10]
    failed = run_mixed(llm, solo, poisoned, SamplingParams(temperature=0.5, seed=2, n=2, max_tokens=9))
    assert failed.finished and isinstance(failed.error, RuntimeError) and f"token {POISON}" in str(failed.error)
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert llm.engine.metrics.requests_finished["error"] == 1  # its sample 0 (the fork never happened)
    assert_all_free(llm)
    monkeypatch.undo()
    assert_serves(llm, solo)


def test_a_step_that_fails_mid_generation_fails_that_request_after_what_it_streamed(checkpoint, solo, monkeypatch):
    llm = engine_llm(checkpoint)
    execute = llm.engine.executor.execute

    def faulty(batch):  # fails on the poisoned request's fourth decode step, whatever else is in the batch
        if any(POISON in seq.prompt_token_ids and seq.num_output_tokens == 3 for seq in batch.seqs):
            raise RuntimeError("illegal memory access")
        return execute(batch)

    monkeypatch.setattr(llm.engine.executor, "execute", faulty)
    poisoned = [POISON] + prompts(1, seed=8)[0]
    failed = run_mixed(llm, solo, poisoned, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert str(failed.error) == "illegal memory access" and failed.finish_reason == "error"
    assert failed.token_ids == solo(poisoned, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert_all_free(llm)


def test_a_failure_no_part_of_the_batch_repeats_fails_nobody(checkpoint, solo, monkeypatch):
    """A transient fault (the first run of a step only): every part runs again, writing the same KV, and every
    request still equals its solo run."""
    llm = engine_llm(checkpoint)
    execute, calls = llm.engine.executor.execute, []

    def once(batch):
        calls.append(len(batch.seqs))
        if len(calls) == 3:
            raise RuntimeError("cosmic ray")
        return execute(batch)

    monkeypatch.setattr(llm.engine.executor, "execute", once)
    batch = prompts(len(MIXED), seed=2)
    outs = llm.generate(batch, MIXED)
    assert calls[2] == calls[3] + calls[4]  # the failed step ran again in two halves
    for prompt, params, out in zip(batch, MIXED, outs):
        assert out.error is None and [c.token_ids for c in out.outputs] == solo(prompt, params)
    assert_all_free(llm)


def test_a_sampler_failure_on_one_row_leaves_the_seeded_neighbours_exact(checkpoint, solo, monkeypatch):
    """The sampler raises after it has drawn for the whole batch: the seeded neighbours' generators and penalty
    states are put back, so that drawing again gives exactly their solo tokens."""
    llm = engine_llm(checkpoint)
    sampler = llm.engine.sampler

    class Faulty:
        def __getattr__(self, name):
            return getattr(sampler, name)

        def __call__(self, logits, rows):
            result = sampler(logits, rows)
            if any(row.params.top_k == 13 for row in rows):
                raise FloatingPointError("nan in the probabilities")
            return result

    monkeypatch.setattr(llm.engine, "sampler", Faulty())
    failed = run_mixed(llm, solo, prompts(1, seed=9)[0], SamplingParams(temperature=1.0, top_k=13, max_tokens=4))
    assert isinstance(failed.error, FloatingPointError) and not failed.token_ids
    assert_all_free(llm)


def test_a_fork_that_fails_leaves_no_child_behind(checkpoint, solo, monkeypatch):
    llm = engine_llm(checkpoint)
    fork, forks = llm.engine.kv.fork, []

    def second_child_fails(parent, child):
        forks.append(child)
        if len(forks) == 2:
            raise MemoryError("no room for the second child")
        return fork(parent, child)

    monkeypatch.setattr(llm.engine.kv, "fork", second_child_fails)
    failed = run_mixed(llm, solo, prompts(1, seed=10)[0],
                       SamplingParams(temperature=1.0, seed=6, n=3, max_tokens=5))
    assert isinstance(failed.error, MemoryError) and [c.finish_reason for c in failed.outputs] == ["error"] * 3
    assert_all_free(llm)  # the first child took every block of its parent: given back
    monkeypatch.undo()
    assert_serves(llm, solo)


def test_a_copy_on_write_that_never_ran_is_not_kept_for_the_next_prompt(checkpoint, solo, monkeypatch):
    """The failed request's copy of its shared partial block never ran: that block holds no KV of its tokens (NaN
    here, as the pool was filled), and must not be cached as their partial block for a later prompt."""
    llm = engine_llm(checkpoint)
    for pool in llm.engine.executor.cache.pools.values():
        pool.kv.fill_(float("nan"))
    prompt = prompts(1, seed=11)[0][:10]  # two full blocks and a partial one, shared by the fork, then copied
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def copy_fails(pairs):
        raise RuntimeError("copy engine fault")

    with monkeypatch.context() as patch:
        patch.setattr(llm.engine.executor, "copy_blocks", copy_fails)
        failed = llm.generate(prompt, SamplingParams(temperature=0, n=2, max_tokens=6, ignore_eos=True))[0]
    assert str(failed.error) == "copy engine fault" and len(failed.token_ids) == 1
    assert llm.stats()["partial_cached"] == 0
    assert llm.generate(prompt, greedy)[0].token_ids == solo(prompt, greedy)[0]
    assert_all_free(llm)


def test_a_tokenizer_detokenizer_or_output_failure_fails_its_request_only(checkpoint, solo, monkeypatch):
    llm = engine_llm(checkpoint)
    engine = llm.engine
    batch = prompts(len(MIXED), seed=3)
    ids = [engine.add_request(p, params) for p, params in zip(batch, MIXED)]
    detok = engine.requests[ids[1]].samples[0].out
    add = detok.add

    def broken_add(token):
        if len(engine.requests[ids[1]].samples[0].seq.output_token_ids) == 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return add(token)

    def broken_output():
        raise KeyError("no such logprob")

    def broken_encode(text, **kwargs):
        raise ValueError(f"cannot encode {text!r}")

    monkeypatch.setattr(detok, "add", broken_add)
    monkeypatch.setattr(engine.requests[ids[3]], "output", broken_output)
    with monkeypatch.context() as patch:
        patch.setattr(engine.tokenizer, "encode", broken_encode)
        with pytest.raises(ValueError, match="cannot encode"):
            engine.add_request("a prompt the tokenizer fails on")
    assert len(engine.requests) == len(ids)
    final, streamed = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).append(out)
            if out.finished:
                final[out.request_id] = out
    assert isinstance(final[ids[1]].error, UnicodeDecodeError) and len(final[ids[1]].token_ids) == 4
    assert final[ids[1]].text == "".join(o.outputs[0].delta_text for o in streamed[ids[1]][:-1])
    assert isinstance(final[ids[3]].error, KeyError) and len(streamed[ids[3]]) == 1  # its first output failed
    for i in (0, 2, 4):
        assert final[ids[i]].error is None
        assert [c.token_ids for c in final[ids[i]].outputs] == solo(batch[i], MIXED[i])
    assert_all_free(llm)


def test_an_executor_failure_is_not_blamed_on_a_request(checkpoint, monkeypatch):
    llm = engine_llm(checkpoint)
    calls = []

    def dead(batch):
        calls.append(batch)
        raise DistributedError("worker rank 1 was killed by signal 9")

    monkeypatch.setattr(llm.engine.executor, "execute", dead)
    with pytest.raises(DistributedError, match="rank 1"):
        llm.generate(prompts(3), SamplingParams(temperature=0, max_tokens=2))
    assert len(calls) == 1  # no part of the batch was tried again on a broken executor
    assert_all_free(llm)


def test_isolate_finds_every_unit_that_fails_alone_in_few_runs():
    bad, runs = {3, 11}, []

    def run(part):
        runs.append(part)
        if bad & set(part):
            raise ValueError(f"{sorted(bad & set(part))}")
        return sum(part)

    found = isolate(list(range(16)), run, ValueError("all"))
    assert {unit for unit, _ in found.failed} == bad and [str(e) for _, e in found.failed] == ["[3]", "[11]"]
    assert sorted(u for part, _ in found.done for u in part) == sorted(set(range(16)) - bad)
    assert all(result == sum(part) for part, result in found.done)
    assert len(runs) <= 2 * 2 * 4  # two culprits, log2(16) levels, two halves a level


# ---- the async engine and a hybrid model -------------------------------------------------------------------------

async def test_the_engine_thread_fails_the_poisoned_stream_and_serves_the_others(checkpoint, solo, monkeypatch):
    llm = engine_llm(checkpoint)
    poison_forward(llm, monkeypatch, position=0)
    aengine = AsyncEngine(llm.engine)

    async def collect(prompt, params):
        return [out async for out in aengine.generate(prompt, params)]

    try:
        good = prompts(2, seed=4)
        results = await asyncio.wait_for(asyncio.gather(
            collect(good[0], MIXED[1]), collect([POISON] + good[1], MIXED[2]), collect(good[1], MIXED[2]),
            return_exceptions=True), SAFETY)
        assert isinstance(results[1], EngineStepError) and f"token {POISON}" in str(results[1])
        assert isinstance(results[1].__cause__, RuntimeError)
        assert [c.token_ids for c in results[0][-1].outputs] == solo(good[0], MIXED[1])
        assert not isinstance(results[2], Exception), repr(results[2].__cause__)
        assert [c.token_ids for c in results[2][-1].outputs] == solo(good[1], MIXED[2])
        later = await asyncio.wait_for(collect(good[0], MIXED[0]), SAFETY)
        assert [c.token_ids for c in later[-1].outputs] == solo(good[0], MIXED[0])
        assert aengine._thread.is_alive()
        await asyncio.to_thread(aengine._call, lambda: assert_all_free(llm))
    finally:
        aengine.shutdown()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_hybrid_models_neighbours_recompute_their_state_and_stay_exact(tmp_path_factory, monkeypatch):
    """A failed forward may have advanced every sequence's recurrent state: the others are computed again from their
    cached prefix, not run a second time on a state already advanced."""
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid") / "m", "qwen3_next")
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=8, n=2, max_tokens=8, ignore_eos=True)
    batch = prompts(3, seed=5)
    reference = LLM(str(path), enable_prefix_caching=False, **options)
    expected = [[c.token_ids for c in reference.generate(p, params)[0].outputs]
                for p, params in zip(batch, [greedy, seeded, greedy])]
    llm = LLM(str(path), **options)
    execute = llm.engine.executor.execute

    def faulty(step_batch):  # the poisoned request decodes once; its second decode step fails after the forward
        logits = execute(step_batch)  # (every state in the batch has advanced)
        if any(POISON in seq.prompt_token_ids and seq.num_output_tokens == 1 for seq in step_batch.seqs):
            raise RuntimeError("conv state out of bounds")
        return logits

    monkeypatch.setattr(llm.engine.executor, "execute", faulty)
    outs = llm.generate(batch[:2] + [[POISON] + batch[2]] + batch[2:], [greedy, seeded, greedy, greedy])
    assert outs[2].finish_reason == "error" and len(outs[2].token_ids) == 1
    assert [[c.token_ids for c in out.outputs] for out in outs[:2] + outs[3:]] == expected
    assert llm.stats()["preemptions"] >= 1  # the neighbours of the failed step started over
    assert_all_free(llm)

"""The sliding-window pool on a tiny random gpt-oss checkpoint (window 8 tokens, blocks of 4, sliding layers beside a
full one): the sliding layers' K/V lives in a pool of its own whose blocks go back once out of every later
position's window, and stay in the prefix cache (`tsterm.engine.kv_manager.WindowBlocks`).

Every output is checked against the same engine without a window pool (`window_kv_blocks=0`: every layer keeps every
block), and the greedy replies against transformers (eager attention, its own sink softmax and window)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from tsterm import LLM, SamplingParams
from tsterm.config import EngineConfig
from tsterm.engine.engine import Engine
from tsterm.engine.executor import MemoryProbe
from tsterm.engine.model_runner import ModelRunner
from tsterm.engine.spec_decode.base import DraftSource
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import assert_greedy_matches

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound

WINDOW, B = 8, 4
OPTIONS = dict(dtype="float32", device="cpu", block_size=B, num_kv_blocks=96, max_num_batched_tokens=16,
               max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gpt_oss_window") / "m", "gpt_oss", dict(
        num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5, num_key_value_heads=1,
        sliding_window=WINDOW, num_hidden_layers=3))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 380) for _ in range(n)]


def _engines(model_dir, **options):
    """(an engine with a window pool, the same engine without one)."""
    options = {**OPTIONS, **options}
    window = LLM(str(model_dir), window_kv_blocks=options.pop("window_kv_blocks", 24), **options)
    plain = LLM(str(model_dir), window_kv_blocks=0, **options)
    assert window.engine.kv.window is not None and plain.engine.kv.window is None
    return window, plain


def _ids(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in outputs]


def test_greedy_matches_transformers_and_a_long_prompt_holds_only_its_window(checkpoint):
    model_dir, hf_model = checkpoint
    llm, plain = _engines(model_dir)
    runner = llm.engine.executor
    sliding = [mixer for _, mixer, _, _ in runner.model.layers if mixer.window]
    assert sliding and all(mixer.window_pool for mixer in sliding)  # their K/V in the window pool
    assert runner.cache.window_layers == tuple(i for i, (_, m, _, _) in enumerate(runner.model.layers) if m.window)
    rng = random.Random(1)
    prompts = [_prompt(rng, n) for n in (40, 5, 23)]
    assert_greedy_matches(llm, hf_model, prompts, 16)
    assert _ids(llm.generate(prompts, GREEDY)) == _ids(plain.generate(prompts, GREEDY))

    # a prompt much longer than the window: after each step the main pool holds every block of it, the window pool
    # the blocks of its next position's window only: ceil((W - 1) / B) + 1 of them
    engine = llm.engine
    released_before = engine.stats()["window_released"]
    engine.add_request(_prompt(rng, 61), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    most = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            c = seq.num_computed_tokens
            assert len(seq.block_table) == -(-c // B) and all(b < engine.kv.pool.num_blocks for b in seq.block_table)
            live = len(seq.window_table) - seq.window_released
            assert seq.window_released == max(0, c - WINDOW + 1) // B
            assert live <= -(-(WINDOW - 1) // B) + 1, (seq, live)
            most = max(most, len(seq.block_table))
        engine.kv.window.check(engine.scheduler.running)
    assert most >= 72 // B - 1  # (the context grew far past the window)
    assert engine.stats()["window_released"] - released_before >= most - 3


def test_multi_turn_reuse_across_the_window_edge_equals_a_fresh_recompute(checkpoint):
    """Each turn's prompt takes every block the last turn computed (its partial one from both pools) and gives what a
    recompute from scratch gives; its new tokens' windows reach back over the cached ones."""
    model_dir, _ = checkpoint
    llm = LLM(str(model_dir), window_kv_blocks=24, **OPTIONS)
    fresh = LLM(str(model_dir), enable_prefix_caching=False, window_kv_blocks=0, **OPTIONS)
    rng = random.Random(2)
    history, previous_full = _prompt(rng, 13), None
    for turn in range(4):
        hits_before = llm.stats()["window_hit_blocks"]
        out = llm.generate(history, GREEDY)[0]
        assert out.token_ids == fresh.generate(history, GREEDY)[0].token_ids, f"turn {turn}"
        if previous_full is not None:  # every token the previous turn computed came from the cache
            assert out.num_cached_tokens == len(previous_full) - 1
            assert llm.stats()["window_hit_blocks"] > hits_before
        previous_full = history + out.token_ids
        history = previous_full + _prompt(rng, rng.randrange(2, 7))


def test_a_shared_prefix_takes_the_released_window_blocks(checkpoint):
    """A prompt sharing the start of an earlier one takes its window blocks from the window pool, where they went
    back (released, cached) once out of the earlier prompt's window; same tokens as without a window pool."""
    model_dir, _ = checkpoint
    llm, plain = _engines(model_dir)
    rng = random.Random(3)
    first = _prompt(rng, 30)
    assert _ids(llm.generate([first], GREEDY)) == _ids(plain.generate([first], GREEDY))
    for shared in (12, 28):  # blocks 1..2 went back while the first prompt ran; 5..6 when it finished
        prompt = first[:shared] + _prompt(rng, 6)
        before = llm.stats()
        out = llm.generate([prompt], GREEDY)
        after = llm.stats()
        assert out[0].num_cached_tokens == shared
        window_hits = after["window_hit_blocks"] - before["window_hit_blocks"]
        assert window_hits == shared // B - (shared - WINDOW + 1) // B
        # taken by reference: the full layers' KV of every hit token, the sliding layers' of the window blocks only
        assert after["kv_reused_bytes"] - before["kv_reused_bytes"] == \
            shared * after["kv_bytes_per_block"] // B + window_hits * after["window_bytes_per_block"]
        assert _ids(out) == _ids(plain.generate([prompt], GREEDY))


def test_evicted_window_blocks_give_a_shorter_hit_with_the_same_tokens(checkpoint):
    """When the window pool has evicted the blocks of a cached prefix's window, the hit stops short of what the main
    pool holds (where the window pool still has the window: here nowhere) and the tokens are the same."""
    model_dir, _ = checkpoint
    llm, plain = _engines(model_dir, window_kv_blocks=8)  # the least one request needs: 7 blocks and the null one
    rng = random.Random(4)
    first = _prompt(rng, 36)
    llm.generate([first], GREEDY)
    evictions = llm.stats()["window_evictions"]
    llm.generate([_prompt(rng, 36)], GREEDY)  # another prompt's windows take every window block
    assert llm.stats()["window_evictions"] > evictions
    prompt = first + _prompt(rng, 5)
    main_run = len(llm.engine.kv.cached_prefix_blocks(prompt))
    assert main_run == 9  # the main pool still holds every full block of the first prompt
    out = llm.generate([prompt], GREEDY)
    assert out[0].num_cached_tokens < main_run * B
    assert _ids(out) == _ids(plain.generate([prompt], GREEDY))


def test_forks_preemption_and_speculation_equal_the_engine_without_a_window_pool(checkpoint):
    model_dir, _ = checkpoint
    rng = random.Random(5)
    # n > 1: three samples fork from one prompt (shared blocks in both pools, the partial one copied on write)
    llm, plain = _engines(model_dir)
    prompt = _prompt(rng, 22)
    params = SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=14, ignore_eos=True)
    forked = _ids(llm.generate([prompt], params))
    assert forked == _ids(plain.generate([prompt], params)) and len({tuple(t) for t in forked[0]}) > 1
    assert llm.stats()["window_cow_copies"] > 0

    # preemption: more work than either pool holds at once
    llm, plain = _engines(model_dir, num_kv_blocks=30, window_kv_blocks=12)
    prompts = [_prompt(rng, 30) for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert _ids(llm.generate(prompts, params)) == _ids(plain.generate(prompts, params))
    assert llm.stats()["preemptions"] > 0

    # speculative decoding: lossless, drafts accepted, rejected ones trimmed from both pools. (A random model's
    # replies rarely repeat, so the drafts come from the replies without speculation, every third one wrong.)
    llm, _ = _engines(model_dir, speculative_method="suffix", num_speculative_tokens=4)
    plain = LLM(str(model_dir), window_kv_blocks=0, **OPTIONS)
    prompts = [_prompt(rng, 26), _prompt(rng, 9)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = _ids(plain.generate(prompts, params))
    llm.engine.drafter = _ReplyDrafter([p + e[0] for p, e in zip(prompts, expected)])
    llm.engine.draft_length = None  # (every draft verified: no measured length)
    assert _ids(llm.generate(prompts, params)) == expected
    stats = llm.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]


class _ReplyDrafter(DraftSource):
    """Drafts a sequence's next tokens from its known full reply, every third draft made wrong."""

    name = "reply"

    def __init__(self, replies: list[list[int]]):
        super().__init__(4)
        self.replies = replies

    def propose(self, seq_id: int, token_ids: list[int], max_tokens: int) -> list[int]:
        for reply in self.replies:
            if reply[:len(token_ids)] == list(token_ids):
                drafts = reply[len(token_ids):len(token_ids) + min(max_tokens, self.num_tokens)]
                return [t if (len(token_ids) + j) % 3 else (t + 1) % 300 for j, t in enumerate(drafts)]
        return []


@pytest.mark.parametrize("options", [dict(kernels="triton"), dict(dtype="bfloat16")], ids=["triton", "bf16"])
def test_other_attention_paths_skip_the_released_entries(checkpoint, options):
    """The Triton kernel (interpreted here) and the bfloat16 CPU path read a window table whose released entries
    name the null block: the same tokens as their own path without a window pool."""
    model_dir, _ = checkpoint
    llm, plain = _engines(model_dir, **options)
    prompts = [_prompt(random.Random(6), 21)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert _ids(llm.generate(prompts, params)) == _ids(plain.generate(prompts, params))
    assert llm.stats()["window_released"] > 0


def test_window_pool_sizes_and_bad_values(checkpoint):
    model_dir, _ = checkpoint
    with pytest.raises(ConfigError, match="window_kv_blocks 7 is too small: one request alone needs 8") as err:
        LLM(str(model_dir), window_kv_blocks=7, **OPTIONS)
    assert err.value.param == "window_kv_blocks"
    with pytest.raises(ConfigError, match="window_kv_blocks must be blocks >= 0"):
        LLM(str(model_dir), window_kv_blocks=-1, **OPTIONS)
    # a budget: the main pool gets what the window pool leaves (window: 2 x 4 windows + a chunk + the null block)
    budget = dict(OPTIONS, num_kv_blocks=None, kv_cache_memory=1 << 20)
    llm = LLM(str(model_dir), **budget)
    runner = llm.engine.executor
    assert runner.num_window_blocks == 1 + 2 * 4 * (WINDOW // B + 1) + 16 // B
    both = (1 << 20) // (runner.kv_bytes_per_block + runner.window_bytes_per_block)
    assert runner.num_blocks * runner.kv_bytes_per_block + runner.num_window_blocks * runner.window_bytes_per_block \
        <= both * (runner.kv_bytes_per_block + runner.window_bytes_per_block)
    assert runner.num_blocks > both  # more main blocks than one pool for every layer would hold
    stats = llm.stats()
    assert stats["window_blocks"] == runner.num_window_blocks - 1 and stats["window_free"] == stats["window_blocks"]
    plain = LLM(str(model_dir), window_kv_blocks=0, **budget).engine.executor
    assert plain.num_window_blocks == 0 and plain.num_blocks == both


class _Memory(MemoryProbe):
    """A device with 64 MiB free whose largest step takes 1 MiB (what a CUDA device's probe reads, on the CPU)."""

    def free_bytes(self) -> int:
        return 64 << 20

    def allocated_bytes(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> int:
        return 1 << 20


def test_the_profile_run_steps_over_both_pools(checkpoint):
    """With a memory probe, the profile run's forward goes over a throw-away cache with a window pool too (its step
    carries window tables), and the budget it leaves is split between the two pools."""
    model_dir, _ = checkpoint
    config = EngineConfig(model=str(model_dir), **{**OPTIONS, "num_kv_blocks": None})
    engine = Engine(config, executor=lambda spec: ModelRunner(dataclasses.replace(spec, memory=_Memory())))
    runner = engine.executor
    assert runner.memory_profile is not None and runner.num_window_blocks == 1 + 2 * 4 * 3 + 4
    assert runner.num_blocks * runner.kv_bytes_per_block + runner.num_window_blocks * runner.window_bytes_per_block \
        <= runner.memory_profile.free_bytes * config.kv_cache_fraction
    prompt = _prompt(random.Random(7), 19)
    engine.add_request(prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["window_released"] > 0


def test_no_window_pool_with_a_kv_tier(checkpoint, caplog):
    """A KV tier copies blocks of the main pool only: the window pool stays off there (said once in the log), every
    layer keeping every block, and the engine runs as without it."""
    model_dir, _ = checkpoint
    with caplog.at_level("INFO", logger="tsterm.engine.model_runner"):
        llm = LLM(str(model_dir), kv_host_bytes=1 << 20, **OPTIONS)
    assert llm.engine.kv.window is None and llm.engine.executor.num_window_blocks == 0
    assert "sliding-window pool off with a KV tier (kv_disk / kv_host_bytes)" in caplog.text
    assert "window_blocks" not in llm.stats()
    prompt = _prompt(random.Random(8), 17)
    plain = LLM(str(model_dir), window_kv_blocks=0, **OPTIONS)
    assert _ids(llm.generate([prompt], GREEDY)) == _ids(plain.generate([prompt], GREEDY))


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
def test_a_pin_keeps_the_window_of_a_waiting_session(checkpoint, pinned):
    """A session pinned while it waits keeps the window pool's blocks of its last window too: other traffic takes
    every other window block, and its next turn still reuses every token (unpinned: a shorter hit). Same tokens."""
    model_dir, _ = checkpoint
    llm, plain = _engines(model_dir, window_kv_blocks=12)
    rng = random.Random(9)
    first = _prompt(rng, 34)
    full = first + llm.generate([first], GREEDY)[0].token_ids
    blocks = (len(full) - 1) // B  # full blocks computed (its last token never is)
    if pinned:
        assert llm.engine.pin(full).num_blocks == blocks
        # and in the window pool the blocks of the window at their end
        assert llm.stats()["window_pinned_blocks"] == blocks - (blocks * B - WINDOW + 1) // B
    for _ in range(2):  # other sessions' windows take every window block that is not pinned
        llm.generate([_prompt(rng, 36)], GREEDY)
    turn = full + _prompt(rng, 3)
    out = llm.generate([turn], GREEDY)
    if pinned:  # (the partly filled block after them, not pinned, may be gone)
        assert out[0].num_cached_tokens in (blocks * B, len(full) - 1)
    else:
        assert out[0].num_cached_tokens < blocks * B
    assert _ids(out) == _ids(plain.generate([turn], GREEDY))

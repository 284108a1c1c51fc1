"""Pins: a session waiting on its tools keeps its prefix in the KV cache while other sessions' traffic fills the pool.

Every test runs a tiny random checkpoint on the CPU; expiry reads a fake clock (no sleeps).
"""
from __future__ import annotations

import random

import pytest

from tsterm import LLM, SamplingParams
from tsterm.errors import ConfigError, RequestError

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.metrics import scrape

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("pinning") / "qwen3moe", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return path


@pytest.fixture(scope="module")
def fresh(checkpoint):
    """A reference engine that never reuses anything: every request computes its whole prompt."""
    return LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=256,
               enable_prefix_caching=False)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_llm(checkpoint, num_blocks: int, **options) -> tuple[LLM, FakeClock]:
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=num_blocks, **options)
    llm.engine.clock = clock = FakeClock()
    return llm, clock


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 380) for _ in range(n)]


def first_turn(llm: LLM, rng: random.Random) -> list[int]:
    """Session A's first turn: a 21-token prompt and 7 generated tokens. Returns all 28 ids (what A pins)."""
    prompt = random_ids(rng, 21)
    return prompt + llm.generate(prompt, greedy(7))[0].token_ids


def other_sessions(llm: LLM, rng: random.Random, rounds: int = 2) -> None:
    """Traffic from other sessions: distinct prompts that take every block of the pool, twice over."""
    for _ in range(rounds):
        llm.generate([random_ids(rng, 17) for _ in range(10)], greedy(4))


def full_blocks_cached(ids: list[int]) -> int:
    """Tokens a next turn starting with `ids` can take from the cache: the KV of the last sampled id was never
    computed, so len - 1 tokens, in whole blocks."""
    return (len(ids) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "control"])
def test_a_pinned_prefix_survives_other_sessions_filling_the_pool(checkpoint, fresh, pinned):
    llm, _ = make_llm(checkpoint, num_blocks=48)
    rng = random.Random(0)
    turn1 = first_turn(llm, rng)
    if pinned:  # A calls a tool: its context waits in the cache
        pin = llm.engine.pin(turn1, ttl_s=60, key="session-a")
        assert pin.pin_id == "session-a" and not pin.capped
        assert pin.num_tokens == full_blocks_cached(turn1) == 24 and llm.stats()["pinned_blocks"] == 6
    evictions_before = llm.stats()["evictions"]
    other_sessions(llm, random.Random(1))
    assert llm.stats()["evictions"] - evictions_before >= 48  # the others took far more than the pool
    turn2 = turn1 + random_ids(rng, 5)  # the tool's result comes back
    out = llm.generate(turn2, greedy(6))[0]
    assert out.token_ids == fresh.generate(turn2, greedy(6))[0].token_ids
    if pinned:
        assert out.num_cached_tokens == full_blocks_cached(turn1)
    else:  # the control: without the pin, the traffic evicted A's whole prefix
        assert out.num_cached_tokens == 0


def test_a_pin_expires_after_its_ttl(checkpoint, fresh):
    llm, clock = make_llm(checkpoint, num_blocks=48)
    rng = random.Random(2)
    turn1 = first_turn(llm, rng)
    pin = llm.engine.pin(turn1, ttl_s=30)
    assert pin.pin_id == "pin-0" and pin.num_blocks == 6
    clock.now += 29.9
    assert llm.stats()["pinned_blocks"] == 6 and llm.stats()["pins"] == 1
    clock.now += 0.1  # at the TTL
    stats = llm.stats()
    assert stats["pinned_blocks"] == 0 and stats["pins"] == 0 and stats["pins_expired"] == 1
    assert not llm.engine.unpin(pin.pin_id)  # already released: not twice
    other_sessions(llm, random.Random(3))
    turn2 = turn1 + random_ids(rng, 5)
    out = llm.generate(turn2, greedy(6))[0]
    assert out.num_cached_tokens == 0  # no longer protected
    assert out.token_ids == fresh.generate(turn2, greedy(6))[0].token_ids


def test_a_pin_expires_inside_a_step(checkpoint):
    """Nothing but traffic calls the engine after the TTL: the step releases the pin before it allocates."""
    llm, clock = make_llm(checkpoint, num_blocks=48)
    rng = random.Random(4)
    turn1 = first_turn(llm, rng)
    llm.engine.pin(turn1, ttl_s=5)
    clock.now += 5
    other_sessions(llm, random.Random(5))
    assert llm.engine.kv.pool.stats()["pinned_blocks"] == 0  # read without stats(), which expires too
    assert llm.generate(turn1 + [9, 10, 11], greedy(1))[0].num_cached_tokens == 0


def test_pins_are_capped_at_a_share_of_the_pool(checkpoint, fresh):
    # 24 blocks, a quarter pinnable: 6. A's prefix has 6 full blocks, B's too; B fits only where it shares A's.
    llm, _ = make_llm(checkpoint, num_blocks=24, max_pinned_fraction=0.25)
    rng = random.Random(6)
    turn_a = first_turn(llm, rng)
    first = llm.engine.pin(turn_a[:17], ttl_s=60, key="a")  # 4 blocks
    assert (first.num_blocks, first.capped) == (4, False)
    turn_b = first_turn(llm, rng)
    b = llm.engine.pin(turn_b, ttl_s=60, key="b")
    assert (b.pin_id, b.num_blocks, b.num_tokens, b.num_cached_blocks, b.capped) == ("b", 2, 8, 6, True)
    a = llm.engine.pin(turn_a, ttl_s=60, key="a")  # re-pin: its own 4 blocks free room for what fits
    assert (a.num_blocks, a.num_cached_blocks, a.capped) == (4, 6, True)
    shared = llm.engine.pin(turn_a, ttl_s=60, key="a2")  # the same blocks again cost nothing
    assert shared.num_blocks == 4 and llm.stats()["pinned_blocks"] == 6 and llm.stats()["pins"] == 3
    assert llm.engine.pin(random_ids(rng, 12), ttl_s=60).pin_id is None  # nothing cached: nothing pinned
    other_sessions(llm, random.Random(7))
    out = llm.generate(turn_a + [5, 6, 7], greedy(3))[0]
    assert out.num_cached_tokens == 4 * BLOCK  # what the capped pin held, no more
    assert out.token_ids == fresh.generate(turn_a + [5, 6, 7], greedy(3))[0].token_ids
    with pytest.raises(ConfigError, match="max_pinned_fraction"):
        LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=24, max_pinned_fraction=1.5)


def test_pinning_off_and_bad_ttl(checkpoint):
    llm, _ = make_llm(checkpoint, num_blocks=24, max_pinned_fraction=0)
    turn = first_turn(llm, random.Random(8))
    pin = llm.engine.pin(turn, ttl_s=60)
    assert pin.pin_id is None and pin.num_blocks == 0 and pin.num_cached_blocks == 6 and pin.capped
    for ttl in (0, -1, float("inf"), float("nan")):
        with pytest.raises(RequestError, match="ttl_s"):
            llm.engine.pin(turn, ttl_s=ttl)


def test_unpin_and_re_pin_release_the_old_blocks(checkpoint):
    llm, _ = make_llm(checkpoint, num_blocks=48)
    rng = random.Random(9)
    turn_a, turn_b = first_turn(llm, rng), first_turn(llm, rng)
    pool = llm.engine.kv.pool
    blocks_a = llm.engine.kv.cached_prefix_blocks(turn_a)
    blocks_b = llm.engine.kv.cached_prefix_blocks(turn_b)
    assert llm.engine.pin(turn_a, ttl_s=60, key="s").num_blocks == 6
    assert all(pool.blocks[b].pin_cnt == 1 for b in blocks_a)
    assert llm.engine.pin(turn_b, ttl_s=60, key="s").num_blocks == 6  # the session moved on: replaces its pin
    assert all(pool.blocks[b].pin_cnt == 0 for b in blocks_a) and set(blocks_a) <= set(pool._cached)
    assert all(pool.blocks[b].pin_cnt == 1 for b in blocks_b)
    assert llm.stats()["pins"] == 1 and llm.stats()["pinned_blocks"] == 6
    assert llm.engine.unpin("s") and not llm.engine.unpin("s")  # the session ended (or was deleted)
    assert all(pool.blocks[b].pin_cnt == 0 for b in blocks_b) and set(blocks_b) <= set(pool._cached)
    assert llm.stats()["pinned_blocks"] == 0 and llm.stats()["pins"] == 0
    pool.check_invariants()


def test_a_pin_never_leaks(checkpoint, fresh):
    llm, _ = make_llm(checkpoint, num_blocks=48)
    rng = random.Random(10)
    turn1 = first_turn(llm, rng)
    pool = llm.engine.kv.pool

    def state():
        return pool.stats(), set(pool._free), set(pool._cached), [(b.ref_cnt, b.pin_cnt, b.block_hash) for b in pool.blocks]

    before = state()
    pinned = llm.engine.kv.cached_prefix_blocks(turn1)
    pin = llm.engine.pin(turn1, ttl_s=60)
    assert pin.num_blocks == len(pinned) == 6
    # The pinned session's next turn runs while its blocks are pinned: shared, by reference, not copied.
    turn2 = turn1 + random_ids(rng, 5)
    request_id = llm.engine.add_request(turn2, greedy(4))
    llm.engine.step()
    assert llm.stats()["used"] > 6 and all(pool.blocks[b].ref_cnt == 1 and pool.blocks[b].pin_cnt == 1
                                           for b in pinned)
    assert llm.engine.abort(request_id)
    assert llm.stats()["used"] == 6  # the pinned blocks alone
    assert llm.engine.unpin(pin.pin_id)
    after_stats, after_free, after_cached, after_blocks = state()
    assert after_stats["used"] == 0 and after_stats["pinned_blocks"] == 0
    # Every block is free or cached again; the first turn's blocks are where they were (turn 2 added its own).
    assert before[1] >= after_free and before[2] <= after_cached
    assert all(after_blocks[i] == before[3][i] for i in pinned)
    pool.check_invariants()


def test_pins_yield_when_nothing_else_could_run(checkpoint, fresh):
    """A prompt that needs more blocks than the pins leave would wait for their TTL: pins are dropped instead."""
    llm, _ = make_llm(checkpoint, num_blocks=16, max_pinned_fraction=1.0)
    rng = random.Random(11)
    turn1 = first_turn(llm, rng)
    assert llm.engine.pin(turn1, ttl_s=600).num_blocks == 6
    big = random_ids(rng, 44)  # 12 blocks with its output; 10 are not pinned
    engine = llm.engine
    engine.add_request(big, greedy(4), request_id="big")
    outputs = [out for _ in range(20) for out in engine.step()]  # bounded: without the fallback it never runs
    assert outputs and outputs[-1].finished
    assert outputs[-1].token_ids == fresh.generate(big, greedy(4))[0].token_ids
    assert llm.stats()["pins_dropped"] == 1 and llm.stats()["pins"] == 0


def test_a_scrape_shows_pinned_blocks(checkpoint):
    llm, _ = make_llm(checkpoint, num_blocks=48)
    assert scrape(llm.engine)["tsterm:kv_cache_blocks_pinned"] == 0
    llm.engine.pin(first_turn(llm, random.Random(12)), ttl_s=60)
    assert scrape(llm.engine)["tsterm:kv_cache_blocks_pinned"] == 6

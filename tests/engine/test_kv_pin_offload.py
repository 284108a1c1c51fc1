"""A session waiting on a tool is offloaded to the disk tier under pressure, not only pinned: when other traffic needs
its pinned blocks, its full blocks and partly filled last block are made sure of on disk (queued again where the
store's bound had evicted them) and the pin released; its next turn reads its prefix back from disk, with the tokens
it gets without any pressure. Without a disk tier a pin yields as before, and the prefix is computed again."""
from __future__ import annotations

import random

import pytest

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_checkpoint

BLOCK = 4
POOL = 40  # blocks: session A pins 7, the traffic needs more than the rest
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("pinoffload") / "qwen3moe", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return path


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 380) for _ in range(n)]


def make_llm(checkpoint, store=None, store_blocks: float = 0, block_file_bytes: int = 0) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=POOL)
    if store is not None:
        options["kv_disk"] = {"path": str(store), "max_bytes": int(store_blocks * block_file_bytes)}
    return LLM(str(checkpoint), **options)


def block_file_bytes(checkpoint, tmp_path) -> int:
    """The bytes one stored block takes on disk (header and checksum included), from a store that holds a few."""
    llm = make_llm(checkpoint, tmp_path / "probe", store_blocks=1 << 20, block_file_bytes=1 << 10)
    llm.generate(ids(random.Random(9), 4 * BLOCK + 1), greedy(1))
    store = llm.engine.kv.tier.store
    llm.engine.kv.tier.flush()
    size = -(-store.size_bytes // store.num_files)
    llm.engine.shutdown()
    return size + 64  # (token ids differ in length from block to block)


def agent_session(llm: LLM, pressure: bool) -> tuple[list[int], object]:
    """Session A: a turn, then a pin while it waits on a tool; with `pressure`, other sessions' traffic in between
    (C fills the pool beside the pin, and the disk store past its bound; B, which extends C, needs A's pinned blocks);
    then A's next turn. Returns A's next turn's output and the engine's stats before it."""
    rng = random.Random(0)
    prompt = ids(rng, 21)
    kept = prompt + llm.generate(prompt, greedy(10))[0].token_ids  # 30 computed: 7 full blocks and 2 in a partial
    pin = llm.engine.pin(kept, ttl_s=600.0, key="agent:a")
    assert pin.num_blocks == 7
    nxt = kept + ids(rng, 5)  # (the tool's result)
    if pressure:
        c_prompt = ids(rng, 28 * BLOCK)
        c_kept = c_prompt + llm.generate(c_prompt, greedy(2))[0].token_ids
        if llm.engine.kv.tier is not None:
            llm.engine.kv.tier.flush()
        llm.generate(c_kept + ids(rng, 11 * BLOCK), greedy(2))  # B: C's prefix by reference, 11 blocks more: all 40
        if llm.engine.kv.tier is not None:
            llm.engine.kv.tier.flush()
    before = llm.stats()
    out = llm.generate(nxt, greedy(6))[0]
    return out, before


def test_a_pinned_session_under_pressure_is_offloaded_and_its_next_turn_reads_it_from_disk(checkpoint, tmp_path):
    reference, _ = agent_session(make_llm(checkpoint), pressure=False)
    size = block_file_bytes(checkpoint, tmp_path)
    # a store of 24 blocks: C's 28 evict all of A's 9 files written through at its turn; A's offload writes them again
    llm = make_llm(checkpoint, tmp_path / "kv", store_blocks=24, block_file_bytes=size)
    out, before = agent_session(llm, pressure=True)
    stats = llm.stats()
    assert before["pins_dropped"] == 1 and before["kv_disk_offloaded_pins"] == 1
    assert before["kv_disk_offloaded_pin_blocks"] == 8  # its 7 full blocks and its partial one, all evicted before
    assert llm.engine.kv.pool.stats()["pinned_blocks"] == 0
    assert out.token_ids == reference.token_ids
    assert out.num_cached_tokens == reference.num_cached_tokens == 30  # the previous prompt and reply: all of it
    assert stats["kv_tier_hit_tokens"] - before["kv_tier_hit_tokens"] == 30  # read from disk, none from the pool
    llm.engine.shutdown()


def test_without_a_disk_tier_the_pin_yields_and_the_prefix_is_computed_again(checkpoint):
    reference, _ = agent_session(make_llm(checkpoint), pressure=False)
    llm = make_llm(checkpoint)
    out, before = agent_session(llm, pressure=True)
    assert before["pins_dropped"] == 1 and "kv_disk_offloaded_pins" not in before
    assert out.token_ids == reference.token_ids
    assert out.num_cached_tokens < reference.num_cached_tokens == 30


@pytest.mark.parametrize("disk", [True, False])
def test_running_requests_that_need_a_pins_blocks_offload_it_instead_of_preempting(checkpoint, tmp_path, disk):
    """Two requests admitted beside a pin whose decodes outgrow the rest of the pool: with a disk tier the pin goes
    to disk (nothing is preempted, nothing recomputed); without one a request is preempted, as before."""
    llm = make_llm(checkpoint, tmp_path / "kv" if disk else None, store_blocks=1 << 12, block_file_bytes=1 << 12)
    rng = random.Random(5)
    prompt = ids(rng, 21)
    kept = prompt + llm.generate(prompt, greedy(10))[0].token_ids
    assert llm.engine.pin(kept, ttl_s=600.0).num_blocks == 7
    prompts = [ids(rng, 15 * BLOCK), ids(rng, 15 * BLOCK)]  # 30 blocks admitted; 38 by the end of their decodes
    outs = llm.generate(prompts, greedy(4 * BLOCK))
    stats = llm.stats()
    alone = make_llm(checkpoint).generate(prompts, greedy(4 * BLOCK))
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    if disk:
        assert stats["preemptions"] == 0 and stats["pins_dropped"] == 1 and stats["kv_disk_offloaded_pins"] == 1
    else:
        assert stats["preemptions"] >= 1 and stats["pins_dropped"] == 0
    if disk:
        llm.engine.shutdown()

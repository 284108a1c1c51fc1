"""The host tier in an engine (`kv_host_bytes`): on the CPU it is a RAM cache under a smaller pool. A session whose
blocks other traffic evicted from the pool resumes from host memory with the tokens of an engine that never evicted
them, none of its prefix computed again, every byte counted as the host tier's traffic (copy audit, stats,
/metrics); with a disk store under it, a restart (an empty host tier) resumes from disk; with the MTP head, the head's
KV travels with its blocks, byte for byte."""
from __future__ import annotations

import random

import pytest

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import add_mtp_head, make_checkpoint
from tests.helpers.metrics import scrape

BLOCK = 4
POOL = 16  # blocks: a 26-token session and a 62-token other one do not fit together
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("kvhost") / "qwen3moe", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return path


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 380) for _ in range(n)]


def llm_of(checkpoint, **kw) -> LLM:
    return LLM(str(checkpoint), **{**dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=POOL), **kw})


def test_a_session_evicted_from_a_small_pool_resumes_from_host_memory(checkpoint):
    reference = llm_of(checkpoint, num_kv_blocks=128)  # a pool that never evicts
    llm = llm_of(checkpoint, kv_host_bytes=1 << 20)
    audit = llm.engine.enable_copy_audit()
    rng = random.Random(0)
    history = ids(rng, 22)
    first = llm.generate(history, greedy(5))[0]
    assert first.token_ids == reference.generate(history, greedy(5))[0].token_ids
    llm.generate(ids(rng, 60), greedy(3))  # other traffic: all of the session's blocks leave the pool
    assert llm.stats()["evictions"] > 0
    kept = history + first.token_ids
    nxt = kept + ids(rng, 5)
    before = llm.stats()
    out = llm.generate(nxt, greedy(5))[0]
    assert out.token_ids == reference.generate(nxt, greedy(5))[0].token_ids
    stats = llm.stats()
    resumed = len(kept) - 1  # the previous turn's prompt and reply but its last token: full blocks and the partial
    assert out.num_cached_tokens == resumed
    assert stats["kv_host_hit_tokens"] - before["kv_host_hit_tokens"] == resumed and stats["kv_disk_hit_tokens"] == 0
    assert stats["prefill_tokens"] - before["prefill_tokens"] == len(nxt) - resumed
    read = -(-resumed // BLOCK) * stats["kv_bytes_per_block"]
    assert stats["kv_host_read_bytes"] - before["kv_host_read_bytes"] == read
    assert audit.copy_bytes[("kv_tier", "host_read")] == stats["kv_host_read_bytes"]
    assert audit.copy_bytes[("kv_tier", "host_write")] == stats["kv_host_written_bytes"] > 0
    assert ("kv_tier", "disk_write") not in audit.copy_bytes
    assert stats["kv_host_bytes"] <= stats["kv_host_max_bytes"]
    metrics = scrape(llm.engine)
    assert metrics['tsterm:prefix_cache_hits_by_tier_total{tier="host"}'] == stats["kv_host_hit_tokens"]
    assert metrics['tsterm:kv_tier_read_bytes_total{tier="host"}'] == stats["kv_host_read_bytes"]
    assert metrics['tsterm:kv_tier_bytes{tier="host"}'] == stats["kv_host_bytes"]
    assert 'tsterm:kv_tier_bytes{tier="disk"}' not in metrics


def test_a_restart_empties_the_host_tier_and_the_disk_store_under_it_serves_the_session(checkpoint, tmp_path):
    reference = llm_of(checkpoint, num_kv_blocks=128)
    options = dict(kv_host_bytes=3 * 1024, kv_disk={"path": str(tmp_path / "kv"), "max_bytes": 1 << 24})
    rng = random.Random(1)
    history = ids(rng, 22)
    llm = llm_of(checkpoint, **options)
    first = llm.generate(history, greedy(5))[0]
    stats = llm.stats()
    assert stats["kv_host_bytes"] <= 3 * 1024 < stats["kv_host_written_bytes"]  # its bound: 3 blocks of 1 KiB
    llm.engine.shutdown()
    nxt = history + first.token_ids + ids(rng, 4)
    llm = llm_of(checkpoint, **options)
    out = llm.generate(nxt, greedy(5))[0]
    assert out.token_ids == reference.generate(nxt, greedy(5))[0].token_ids
    stats = llm.stats()
    resumed = len(history) + len(first.token_ids) - 1
    assert out.num_cached_tokens == resumed == stats["kv_disk_hit_tokens"] and stats["kv_host_hit_tokens"] == 0
    llm.engine.shutdown()


def test_the_mtp_heads_kv_travels_with_its_blocks(tmp_path):
    path, _ = make_checkpoint(tmp_path / "headed", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                                                     num_hidden_layers=2, norm_topk_prob=True))
    add_mtp_head(path)
    llm = llm_of(path, kv_host_bytes=1 << 20, speculative_method="mtp", num_speculative_tokens=2)
    engine, pool = llm.engine, llm.engine.kv.pool
    mtp_kv = engine.executor.mtp.kv_pool.kv
    rng = random.Random(2)
    history = ids(rng, 20)
    first = llm.generate(history, greedy(4))[0]
    kept = history + first.token_ids
    hashes, parent, before = [], None, []
    for i in range((len(kept) - 1) // BLOCK):  # the full blocks the turn left: their head KV as it computed it
        block_tokens = kept[i * BLOCK:(i + 1) * BLOCK]
        block_hash = pool.hash_block(parent, block_tokens)
        block_id = pool.lookup(block_hash, block_tokens, parent)
        before.append(mtp_kv[:, :, block_id].clone())
        hashes.append((block_hash, block_tokens, parent))
        parent = block_hash
    llm.generate(ids(rng, 60), greedy(3))  # other traffic: the session's blocks leave the pool
    assert all(pool.lookup(h, t, p) is None for h, t, p in hashes)
    out = llm.generate(kept + ids(rng, 3), greedy(4))[0]
    assert out.num_cached_tokens == len(kept) - 1 and llm.stats()["kv_host_hit_tokens"] == len(kept) - 1
    for (block_hash, block_tokens, parent), head_kv in zip(hashes, before):
        block_id = pool.lookup(block_hash, block_tokens, parent)  # read back into a fresh block
        assert block_id is not None and mtp_kv[:, :, block_id].equal(head_kv)

"""The KV cache's disk tier: a new engine over the same store (a restart) resumes a conversation without computing it
again, with the tokens one process gives; a corrupted or foreign block is refused and computed instead; a half-written
block is never read. (The store's bound under a random workload: test_kv_store.py.)"""
from __future__ import annotations

import random

import pytest

from tsterm import LLM, SamplingParams
from tsterm.engine.kv_store import SNAPSHOT_SUFFIX, session_block_names

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint
from tests.helpers.metrics import scrape

BLOCK = 4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("kvdisk") / "qwen3moe", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return path


@pytest.fixture(scope="module")
def one_process(checkpoint):
    """The reference: one engine for the whole conversation, no disk tier."""
    return LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=128)


def engine(checkpoint, store, **kw) -> LLM:
    options = dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=128,
                   kv_disk={"path": str(store), "max_bytes": 1 << 24})
    return LLM(str(checkpoint), **{**options, **kw})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(8, 380) for _ in range(n)]


def test_a_restart_between_turns_serves_the_previous_prompt_and_reply_from_disk(checkpoint, one_process, tmp_path):
    rng = random.Random(0)
    history = ids(rng, 22)
    kept = None
    for turn in range(3):
        reference = one_process.generate(history, greedy(6))[0]
        llm = engine(checkpoint, tmp_path / "kv")  # a new engine each turn: the process restarted
        audit = llm.engine.enable_copy_audit()
        out = llm.generate(history, greedy(6))[0]
        assert out.token_ids == reference.token_ids, f"turn {turn}"
        stats = llm.stats()
        if kept is not None:
            # the previous turn's prompt and reply, all but its last token (never fed to the model): its full blocks
            # and its partly filled last one, read from disk; nothing of it computed again
            assert out.num_cached_tokens == reference.num_cached_tokens == len(kept) - 1
            assert stats["kv_tier_hit_tokens"] == len(kept) - 1
            assert stats["prefill_tokens"] == len(history) - (len(kept) - 1)
            read = stats["kv_disk_read_blocks"] * stats["kv_bytes_per_block"]
            assert stats["kv_disk_read_bytes"] == read > 0
            # tier traffic is a copy in the ledger, apart from the reuse by reference (none here: a fresh pool)
            assert audit.copy_bytes[("kv_tier", "disk_read")] == read and stats["kv_reused_bytes"] == 0
            metrics = scrape(llm.engine)  # what /metrics shows: hits by tier, the bytes read, the store's size
            assert metrics['tsterm:prefix_cache_hits_by_tier_total{tier="disk"}'] == len(kept) - 1
            assert metrics['tsterm:prefix_cache_hits_by_tier_total{tier="device"}'] == 0
            assert metrics['tsterm:prefix_cache_hits_by_tier_total{tier="host"}'] == 0
            assert metrics['tsterm:kv_tier_read_bytes_total{tier="disk"}'] == read
            assert metrics['tsterm:kv_tier_bytes{tier="disk"}'] == stats["kv_disk_bytes"] > 0
            assert metrics["tsterm:kv_tier_loads_total"] == 1
        else:
            assert out.num_cached_tokens == 0 and stats["kv_disk_read_blocks"] == 0
        llm.engine.shutdown()  # its queued writes finish first
        kept = history + out.token_ids
        history = kept + ids(rng, rng.randrange(3, 7))


def _first_turn(checkpoint, store, prompt) -> list[int]:
    llm = engine(checkpoint, store)
    out = llm.generate(prompt, greedy(5))[0]
    fingerprint = llm.engine.kv.tier.store.fingerprint
    llm.engine.shutdown()
    return prompt + out.token_ids, fingerprint


def test_a_corrupted_block_is_refused_and_computed_again(checkpoint, one_process, tmp_path):
    store = tmp_path / "kv"
    prompt = ids(random.Random(1), 20)
    kept, fingerprint = _first_turn(checkpoint, store, prompt)
    names = session_block_names(fingerprint, BLOCK, kept)
    target = store / names[2]  # the third full block: the first two still come from disk
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit of its payload
    target.write_bytes(bytes(data))
    nxt = kept + ids(random.Random(2), 4)
    llm = engine(checkpoint, store)
    out = llm.generate(nxt, greedy(5))[0]
    assert out.token_ids == one_process.generate(nxt, greedy(5))[0].token_ids
    stats = llm.stats()
    assert stats["kv_disk_refused_checksum"] == 1 and stats["kv_disk_read_blocks"] == 2
    assert out.num_cached_tokens == 2 * BLOCK  # up to the refused block; the rest computed
    llm.engine.shutdown()
    assert target.read_bytes() != bytes(data)  # deleted, then written again from the recomputed block


def test_a_foreign_models_block_is_refused_never_served(checkpoint, one_process, tmp_path_factory):
    store = tmp_path_factory.mktemp("foreign") / "kv"
    other, _ = make_checkpoint(tmp_path_factory.mktemp("other") / "qwen3moe", "qwen3_moe",
                               dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2), seed=7)
    prompt = ids(random.Random(3), 20)
    kept, other_fingerprint = _first_turn(other, store, prompt)  # the other model's blocks
    llm = engine(checkpoint, store)
    fingerprint = llm.engine.kv.tier.store.fingerprint
    assert fingerprint != other_fingerprint
    # the other model's blocks under the names this model's chain asks for (as a fingerprint that missed a difference
    # between the two would have named them)
    for theirs, ours in zip(session_block_names(other_fingerprint, BLOCK, kept),
                            session_block_names(fingerprint, BLOCK, kept)):
        (store / theirs).rename(store / ours)
    llm.engine.shutdown()
    llm = engine(checkpoint, store)  # (indexes the renamed files)
    nxt = kept + ids(random.Random(4), 4)
    out = llm.generate(nxt, greedy(5))[0]
    assert out.token_ids == one_process.generate(nxt, greedy(5))[0].token_ids
    stats = llm.stats()
    assert stats["kv_disk_refused_fingerprint"] == 1 and stats["kv_disk_read_blocks"] == 0
    assert out.num_cached_tokens == 0
    llm.engine.shutdown()


def test_a_hybrid_session_resumes_after_a_restart_from_its_blocks_and_state_snapshot(tmp_path):
    """A hybrid (Gated DeltaNet layers) resumes where a state snapshot was kept: at the last block boundary its turn
    computed. Its blocks and that snapshot go to disk, and a new engine reads both back: the same tokens as one
    process, with the same cached tokens, none of them computed again."""
    path, _ = make_hybrid_checkpoint(tmp_path / "hybrid", "qwen3_next")
    reference_llm = LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64)
    rng = random.Random(5)
    history = ids(rng, 21)
    kept = None
    for turn in range(3):
        reference = reference_llm.generate(history, greedy(6))[0]
        llm = engine(path, tmp_path / "kv", num_kv_blocks=64)
        out = llm.generate(history, greedy(6))[0]
        assert out.token_ids == reference.token_ids, f"turn {turn}"
        stats = llm.stats()
        if kept is not None:
            resumed = (len(kept) - 1) // BLOCK * BLOCK  # the last block boundary of the previous turn's computed ids
            assert out.num_cached_tokens == reference.num_cached_tokens == resumed > 0
            assert stats["kv_tier_hit_tokens"] == resumed and stats["kv_tier_hit_snapshots"] == 1
            assert stats["prefill_tokens"] == len(history) - resumed
        else:
            assert out.num_cached_tokens == 0 and stats["kv_tier_hit_snapshots"] == 0
        llm.engine.shutdown()
        assert stats["kv_tier_saved_snapshots"] >= 1
        kept = history + out.token_ids
        history = kept + ids(rng, rng.randrange(3, 7))


def test_a_hybrids_corrupted_state_snapshot_is_refused_and_the_prefix_computed(tmp_path):
    path, _ = make_hybrid_checkpoint(tmp_path / "hybrid", "qwen3_next")
    reference_llm = LLM(str(path), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=64)
    prompt = ids(random.Random(6), 21)
    llm = engine(path, tmp_path / "kv", num_kv_blocks=64)
    kept = prompt + llm.generate(prompt, greedy(5))[0].token_ids
    llm.engine.shutdown()
    snapshots = sorted((tmp_path / "kv").glob(f"*{SNAPSHOT_SUFFIX}"))
    assert len(snapshots) == 1  # the state at the last block boundary the turn computed
    data = bytearray(snapshots[0].read_bytes())
    data[len(data) // 2] ^= 0x40
    snapshots[0].write_bytes(bytes(data))
    nxt = kept + ids(random.Random(7), 4)
    llm = engine(path, tmp_path / "kv", num_kv_blocks=64)
    out = llm.generate(nxt, greedy(5))[0]
    assert out.token_ids == reference_llm.generate(nxt, greedy(5))[0].token_ids
    stats = llm.stats()
    assert stats["kv_disk_refused_checksum"] == 1 and stats["kv_tier_hit_snapshots"] == 0
    assert out.num_cached_tokens == 0  # without a state to resume from, none of the blocks is any use
    llm.engine.shutdown()

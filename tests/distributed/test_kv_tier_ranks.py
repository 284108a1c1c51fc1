"""The KV tiers over tensor / expert parallel gloo CPU ranks: rank 0 decides which blocks are saved and read, each rank
moves its own share of every block to and from its own store (`rank<R>` under the store's path, under a fingerprint
naming its rank and layout), and a load keeps only the leading blocks every rank read.

The oracle is one process without tiers: a restart between two turns (a new multi-rank engine over the same store)
gives its tokens, with the first turn's prompt and reply read from disk; a block one rank cannot read is computed on
every rank, from there on; a store written by two ranks serves nothing to one.
"""
from __future__ import annotations

import json
import random
import shutil

import pytest

from tsterm import LLM, SamplingParams
from tsterm.engine.kv_store import SNAPSHOT_SUFFIX, session_block_names, store_models
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint

BLOCK = 4
OPTIONS = dict(dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=40, distributed_timeout_s=30)
PROMPT = [random.Random(0).randrange(8, 380) for _ in range(14)]
MORE = [50, 51, 52]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def with_store(checkpoint, store, **kw) -> LLM:
    return LLM(str(checkpoint), kv_disk={"path": str(store), "max_bytes": 1 << 22}, **OPTIONS, **kw)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("kvranks") / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=387))
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """One process, no tiers: the first turn's reply, and the second turn (prompt, reply)."""
    llm = LLM(str(checkpoint), **OPTIONS)
    first = llm.generate(PROMPT, greedy(5))[0].token_ids
    second = PROMPT + first + MORE
    return first, second, llm.generate(second, greedy(5))[0].token_ids


def first_turn(checkpoint, store, tp: int, ep: int, reference) -> str:
    """Run the first turn on `tp x ep` ranks with a store at `store`; rank 0's fingerprint."""
    llm = with_store(checkpoint, store, tensor_parallel_size=tp, expert_parallel_size=ep)
    try:
        assert llm.generate(PROMPT, greedy(5))[0].token_ids == reference[0]
        fingerprint = llm.engine.kv.tier.store.fingerprint
    finally:
        llm.engine.shutdown()  # every rank's queued writes finish first
    return fingerprint


@pytest.fixture(scope="module")
def tp2_store(checkpoint, reference, tmp_path_factory):
    """A store the first turn wrote on two tensor-parallel ranks (copied by each test that changes it)."""
    store = tmp_path_factory.mktemp("tp2") / "kv"
    return store, first_turn(checkpoint, store, 2, 1, reference)


def second_turn(checkpoint, store, reference, **kw) -> tuple[list[int], int, dict]:
    """(tokens, cached tokens, stats with the copy ledger's disk reads as `ledger_disk_read`) of the second turn."""
    llm = with_store(checkpoint, store, **kw)
    try:
        audit = llm.engine.enable_copy_audit()
        out = llm.generate(reference[1], greedy(5))[0]
        stats = {**llm.stats(), "ledger_disk_read": audit.copy_bytes.get(("kv_tier", "disk_read"), 0)}
        return out.token_ids, out.num_cached_tokens, stats
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)])
def test_a_restart_between_turns_reads_every_ranks_share_from_disk(checkpoint, reference, tp2_store, tmp_path, tp,
                                                                   ep):
    store = tmp_path / "kv"
    if tp == 2:
        shutil.copytree(tp2_store[0], store)
        fingerprint = tp2_store[1]
    else:
        fingerprint = first_turn(checkpoint, store, tp, ep, reference)
    # each rank's own store: the same block names (rank 0's chain), under its own rank's fingerprint
    names = session_block_names(fingerprint, BLOCK, PROMPT + reference[0])
    assert names and all((store / name).is_file() and (store / "rank1" / name).is_file() for name in names)
    (rank1,) = store_models(store / "rank1")
    assert json.loads(rank1["fingerprint"]) == {**json.loads(fingerprint), "rank": 1}
    tokens, cached, stats = second_turn(checkpoint, store, reference, tensor_parallel_size=tp,
                                        expert_parallel_size=ep)
    assert tokens == reference[2]
    kept = len(PROMPT) + len(reference[0]) - 1  # the first turn's prompt and reply but its last token (never fed)
    assert cached == stats["kv_tier_hit_tokens"] == kept
    assert stats["prefill_tokens"] == len(reference[1]) - kept
    # every rank read its share: the ledger counts them all, the store's counters are rank 0's (half of each block)
    read = stats["kv_disk_read_blocks"] * stats["kv_bytes_per_block"]
    assert stats["ledger_disk_read"] == read == 2 * stats["kv_disk_read_bytes"] > 0


@pytest.mark.parametrize("how", ["corrupted", "evicted"])
def test_a_block_one_rank_cannot_read_is_computed_on_every_rank(checkpoint, reference, tp2_store, tmp_path, how):
    store = tmp_path / "kv"
    shutil.copytree(tp2_store[0], store)
    names = session_block_names(tp2_store[1], BLOCK, PROMPT + reference[0])
    target = store / "rank1" / names[1]  # rank 1's share of the second full block; rank 0's is whole
    original = target.read_bytes()
    if how == "corrupted":
        data = bytearray(original)
        data[len(data) // 2] ^= 0x40
        target.write_bytes(bytes(data))
    else:  # (each rank's store evicts by itself: gone from rank 1's only)
        target.unlink()
    tokens, cached, stats = second_turn(checkpoint, store, reference, tensor_parallel_size=2)
    assert tokens == reference[2]
    # the first block from every rank's store; the second and everything after it computed, on both ranks
    assert cached == stats["kv_tier_hit_tokens"] == BLOCK
    assert stats["prefill_tokens"] == len(reference[1]) - BLOCK
    # (refused and deleted, or gone) written again from the KV rank 1 computed: the same bytes as the first turn's
    assert target.read_bytes() == original


def test_a_two_rank_store_serves_nothing_to_one_rank(checkpoint, reference, tp2_store, tmp_path):
    store = tmp_path / "kv"
    shutil.copytree(tp2_store[0], store)
    tokens, cached, stats = second_turn(checkpoint, store, reference)
    assert tokens == reference[2]
    assert cached == stats["kv_tier_hit_tokens"] == 0 and stats["kv_disk_read_blocks"] == 0
    # never even looked up: one rank's chain starts at another fingerprint than two ranks' (no header was refused)
    assert sum(stats[f"kv_disk_refused_{why}"] for why in ("checksum", "fingerprint", "mismatch")) == 0


def test_another_ranks_share_is_refused_never_served(checkpoint, reference, tp2_store, tmp_path):
    store = tmp_path / "kv"
    shutil.copytree(tp2_store[0], store)
    # rank 1's shares under rank 0's names (as a fingerprint without the rank would have let them be)
    for name in session_block_names(tp2_store[1], BLOCK, PROMPT + reference[0]):
        shutil.copyfile(store / "rank1" / name, store / name)
    tokens, cached, stats = second_turn(checkpoint, store, reference, tensor_parallel_size=2)
    assert tokens == reference[2]
    assert cached == stats["kv_tier_hit_tokens"] == 0 and stats["kv_disk_refused_fingerprint"] == 1


def test_a_hybrid_resumes_on_two_ranks_from_every_ranks_blocks_and_state_snapshot(tmp_path):
    """A hybrid (Gated DeltaNet layers) on two expert-parallel ranks: each rank keeps its share of the state snapshot
    at the last block boundary with its blocks; after a restart both read them back (the tokens and cached tokens of
    one process), and when rank 1's snapshot is corrupted no rank resumes from it: the prefix is computed."""
    hybrid, _ = make_hybrid_checkpoint(tmp_path / "m", "qwen3_next",
                                       dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    one = LLM(str(hybrid), **OPTIONS)
    first = one.generate(PROMPT, greedy(5))[0].token_ids
    nxt = PROMPT + first + MORE
    want = one.generate(nxt, greedy(5))[0]
    store = tmp_path / "kv"
    llm = with_store(hybrid, store, expert_parallel_size=2)
    try:
        assert llm.generate(PROMPT, greedy(5))[0].token_ids == first
    finally:
        llm.engine.shutdown()
    (snapshot,) = (store / "rank1").glob(f"*{SNAPSHOT_SUFFIX}")
    assert (store / snapshot.name).is_file()
    shutil.copytree(store, tmp_path / "corrupted")
    corrupted = bytearray(snapshot.read_bytes())
    corrupted[len(corrupted) // 2] ^= 0x40
    (tmp_path / "corrupted" / "rank1" / snapshot.name).write_bytes(bytes(corrupted))
    tokens, cached, stats = second_turn(hybrid, store, (first, nxt), expert_parallel_size=2)
    resumed = (len(PROMPT) + len(first) - 1) // BLOCK * BLOCK  # the last block boundary the first turn computed
    assert tokens == want.token_ids and cached == want.num_cached_tokens == resumed > 0
    assert stats["kv_tier_hit_tokens"] == resumed and stats["kv_tier_hit_snapshots"] == 1
    tokens, cached, stats = second_turn(hybrid, tmp_path / "corrupted", (first, nxt), expert_parallel_size=2)
    assert tokens == want.token_ids and cached == 0 and stats["prefill_tokens"] == len(nxt)


def test_a_session_evicted_from_a_small_pool_resumes_from_every_ranks_host_tier(checkpoint):
    """`kv_host_bytes` on two ranks: each keeps its share in its own host memory; other traffic evicts the session
    from the pool (16 blocks), and its next turn reads it back on both ranks."""
    one = LLM(str(checkpoint), **OPTIONS)  # (40 blocks: never evicts)
    llm = LLM(str(checkpoint), tensor_parallel_size=2, kv_host_bytes=1 << 20, **{**OPTIONS, "num_kv_blocks": 16})
    try:
        rng = random.Random(1)
        history = [rng.randrange(8, 380) for _ in range(22)]
        first = llm.generate(history, greedy(5))[0].token_ids
        assert first == one.generate(history, greedy(5))[0].token_ids
        llm.generate([rng.randrange(8, 380) for _ in range(60)], greedy(3))  # the session's blocks leave the pool
        assert llm.stats()["evictions"] > 0
        nxt = history + first + MORE
        before = llm.stats()
        out = llm.generate(nxt, greedy(5))[0]
        stats = llm.stats()
    finally:
        llm.engine.shutdown()
    assert out.token_ids == one.generate(nxt, greedy(5))[0].token_ids
    resumed = len(history) + len(first) - 1
    assert out.num_cached_tokens == stats["kv_host_hit_tokens"] - before["kv_host_hit_tokens"] == resumed
    assert stats["prefill_tokens"] - before["prefill_tokens"] == len(nxt) - resumed


def test_a_worker_that_cannot_open_its_store_is_named_in_a_config_error(checkpoint, tmp_path):
    store = tmp_path / "kv"
    store.mkdir()
    (store / "rank1").write_text("not a directory")  # rank 0's store opens; rank 1's cannot
    with pytest.raises(ConfigError, match=r"^kv_disk\.path: cannot use .*rank1.* \(worker rank 1\)$"):
        with_store(checkpoint, store, tensor_parallel_size=2)


def test_sessions_count_and_drop_every_ranks_share_of_a_session(tp2_store, reference, tmp_path):
    """`tsterm sessions` counts a session's blocks once and the bytes of every rank's share; dropping it deletes the
    share in each rank's store (`rank<R>`, under rank 0's names), not only rank 0's."""
    from tsterm.chat.session import Session
    from tsterm.chat.store import drop_session_kv, session_kv_usage

    store = tmp_path / "kv"
    shutil.copytree(tp2_store[0], store)
    names = session_block_names(tp2_store[1], BLOCK, PROMPT + reference[0])
    session = Session(id="s", messages=[], token_ids=PROMPT + reference[0])
    files = [d / name for d in (store, store / "rank1") for name in names]
    assert all(f.is_file() for f in files)
    size = sum(f.stat().st_size for f in files)
    assert session_kv_usage([session], store) == {"s": (len(names), size)}
    assert drop_session_kv(session, [], store) == (len(names), size)
    assert not any(f.exists() for f in files)

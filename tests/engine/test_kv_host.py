"""The KV cache's host tier (`kv_host_bytes`), without a model: a block evicted from the pool comes back from host
memory with its exact bytes; the tier stays under its bound under a random workload, evicting least recently used
first and spilling to the disk store what the store does not hold; a read whose header says otherwise is refused;
every byte moved is counted per tier; several pools under one block id (the MTP head's) travel together."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tsterm.config import EngineConfig, SamplingParams
from tsterm.engine.block_pool import BlockPool
from tsterm.engine.kv_host import HostKVCache
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.kv_store import KVDiskStore, block_name
from tsterm.engine.kv_tier import KVTier
from tsterm.engine.sequence import Sequence
from tsterm.errors import ConfigError

B = 4
SHAPE = (2, 2, 3, 2)  # [L, (k, v), ..., B, Hkv, D] around the block axis
BLOCK_BYTES = SHAPE[0] * SHAPE[1] * B * SHAPE[2] * SHAPE[3] * 4  # float32


def kv_of(token: int, position: int, part: int = 0) -> torch.Tensor:
    L, two, H, D = SHAPE
    return torch.arange(L * two * H * D, dtype=torch.float32).reshape(L, two, H, D) + 1000 * token + position + \
        0.5 * part


class Harness:
    """A pool, its KV tensors and a KV manager over a host tier (and a disk store when `store` is given)."""

    def __init__(self, host_blocks: int, num_blocks: int = 16, store=None, parts: int = 1):
        self.pool = BlockPool(num_blocks, B, fingerprint="host-test")
        L, two, H, D = SHAPE
        self.parts = [torch.zeros((L, two, num_blocks + 2 * p, B, H, D)) for p in range(parts)]  # (MTP: scratch)
        self.ledger: dict[str, int] = {}
        self.host = HostKVCache(host_blocks * BLOCK_BYTES * parts)
        self.store = None if store is None else KVDiskStore(store, 1 << 20, "host-test")
        self.tier = KVTier(self.store, self.parts, self.pool.root_hash, host=self.host,
                           ledger=lambda kind, n: self.ledger.__setitem__(kind, self.ledger.get(kind, 0) + n))
        self.manager = KVCacheManager(self.pool, tier=self.tier)

    def run(self, tokens: list[int]) -> Sequence:
        """Match `tokens`' cached prefix, 'compute' the rest (each position's KV a function of its token, position and
        pool), and free the sequence (its last token never computed, as after a turn)."""
        seq = Sequence(list(tokens), SamplingParams())
        self.manager.match_prefix(seq)
        self.manager.record_prefix_query(seq)
        for p, part in enumerate(self.parts):  # a cached position already holds its KV
            for q in range(seq.num_computed_tokens):
                assert torch.equal(part[:, :, seq.block_table[q // B], q % B], kv_of(tokens[q], q, p)), (p, q)
        start, n = seq.num_computed_tokens, seq.num_uncomputed_tokens - 1
        self.manager.allocate_slots(seq, n)
        for q in range(start, start + n):
            for p, part in enumerate(self.parts):
                part[:, :, seq.block_table[q // B], q % B] = kv_of(tokens[q], q, p)
        seq.num_computed_tokens += n
        self.manager.commit(seq)
        self.manager.free(seq)
        return seq

    def evict_all(self) -> None:
        """Every cached block of the pool evicted (taken and given back): only the tiers hold them now."""
        taken = [self.pool.allocate() for _ in range(self.pool.num_free)]
        for block_id in taken:
            self.pool.release(block_id)
        self.pool.check_invariants()

    def close(self) -> None:
        self.tier.close()


@pytest.mark.parametrize("parts", [1, 2])
def test_a_block_evicted_from_the_pool_comes_back_from_host_memory(parts):
    h = Harness(host_blocks=16, parts=parts)
    tokens = list(range(10, 32))
    first = h.run(tokens)
    assert first.num_cached_tokens == 0 and len(h.host) == 6  # 5 full blocks and the partial one (21 computed)
    h.evict_all()
    second = h.run(tokens + [99, 98])
    assert second.num_cached_tokens == 21  # the full blocks and the partial's token, from host memory
    stats = h.manager.stats()
    assert stats["kv_host_hit_tokens"] == stats["kv_tier_hit_tokens"] == 21 and stats["kv_disk_hit_tokens"] == 0
    assert stats["kv_host_read_blocks"] == 6 and stats["kv_tier_loads"] == 1
    # every byte counted as tier traffic: 6 blocks out of the pool and back, then the second turn's new ones out
    assert h.ledger["host_read"] == 6 * BLOCK_BYTES * parts == stats["kv_host_read_bytes"]
    assert h.ledger["host_write"] == stats["kv_host_written_bytes"] == stats["kv_host_written_blocks"] * BLOCK_BYTES * parts
    assert "disk_write" not in h.ledger
    h.pool.check_invariants()


def test_the_host_tier_spills_what_it_evicts_to_disk_and_a_read_falls_through_to_it(tmp_path):
    h = Harness(host_blocks=3, store=tmp_path / "kv")
    tokens = list(range(10, 32))
    h.run(tokens)
    h.tier.flush()
    assert h.host.size_bytes <= 3 * BLOCK_BYTES and len(h.host) == 3 and h.host.evicted_blocks == 3
    # written through: the store holds all six; the host tier's evictions found them there (no second write)
    assert h.store.num_files == 6 and h.host.spilled_blocks == 0 and h.ledger["disk_write"] == 6 * BLOCK_BYTES
    h.evict_all()
    second = h.run(tokens + [99])
    stats = h.manager.stats()
    assert second.num_cached_tokens == 21
    assert stats["kv_disk_hit_tokens"] == 3 * B and stats["kv_host_hit_tokens"] == 21 - 3 * B
    assert h.ledger["disk_read"] == 3 * BLOCK_BYTES and h.ledger["host_read"] == 3 * BLOCK_BYTES
    h.close()


def test_an_evicted_block_the_store_lost_is_spilled_to_it():
    spilled: dict[str, bytes] = {}
    host = HostKVCache(2 * 8, spill=lambda name, header, payload, ready: spilled.setdefault(name, bytes(payload)) and True)
    for i in range(3):
        host.put(f"b{i}", {"kind": "full"}, bytearray([i]) * 8)
    assert host.names() == ["b1", "b2"] and spilled == {"b0": bytes([0]) * 8} and host.spilled_blocks == 1
    into = memoryview(bytearray(8))
    assert host.read("b1", {"kind": "full"}, into) and bytes(into) == bytes([1]) * 8
    host.put("b3", {"kind": "full"}, bytearray(8))  # b1 was read: b2 is the least recently used now
    assert host.names() == ["b1", "b3"] and set(spilled) == {"b0", "b2"}
    assert not host.put("big", {}, bytearray(17)) and host.skipped_writes == 1 and "big" in spilled


def test_a_read_whose_header_differs_is_refused_and_dropped():
    host = HostKVCache(64)
    host.put("x", {"kind": "full", "tokens": [1, 2]}, bytearray(b"\x07" * 8))
    into = memoryview(bytearray(8))
    assert not host.read("x", {"kind": "full", "tokens": [1, 3]}, into) and bytes(into) == bytes(8)
    assert host.refused == 1 and not host.contains("x") and host.size_bytes == 0
    host.put("y", {"kind": "full"}, bytearray(8))
    assert not host.read("y", {"kind": "full"}, memoryview(bytearray(4)))  # another size: refused too
    assert host.refused == 2


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "put", "read", "touch", "delete"]), st.integers(0, 30),
                              st.integers(1, 40)), max_size=80),
       budget=st.integers(1, 120))
def test_the_host_tier_stays_under_its_bound_and_evicts_least_recently_used(ops, budget):
    spilled: list[str] = []
    host = HostKVCache(budget, spill=lambda name, *_: spilled.append(name) or True)
    model: dict[str, int] = {}  # the reference: name -> size, least recently used first (dicts keep order)
    for op, key, size in ops:
        name = f"n{key}"
        if op == "put":
            if name in model:
                model[name] = model.pop(name)
                assert not host.put(name, {}, bytearray(size))
                continue
            kept = host.put(name, {}, bytearray(size))
            assert kept == (size <= budget)
            if kept:
                while sum(model.values()) + size > budget:
                    oldest = next(iter(model))
                    del model[oldest]
                    assert spilled[-1] != name and oldest in spilled
                model[name] = size
        elif op == "read":
            present = name in model
            assert host.read(name, {}, memoryview(bytearray(model.get(name, 1)))) == present
            if present:
                model[name] = model.pop(name)
        elif op == "touch":
            assert host.touch(name) == (name in model)
            if name in model:
                model[name] = model.pop(name)
        else:
            assert host.delete([name]) == model.pop(name, 0)
        assert host.names() == list(model) and host.size_bytes == sum(model.values()) <= budget


def test_kv_host_bytes_is_checked_and_named():
    for bad in (-1, 1.5, "1G", True):
        with pytest.raises(ConfigError) as e:
            EngineConfig(model="m", kv_host_bytes=bad)
        assert e.value.param == "kv_host_bytes"
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        EngineConfig(model="m", kv_host_bytes=1 << 20, enable_prefix_caching=False)
    assert EngineConfig(model="m", kv_host_bytes=1 << 20).kv_host_bytes == 1 << 20


def test_partial_blocks_are_found_by_their_parent_and_dropped_from_the_index():
    """Partial blocks are found by their parent in the host tier as in the store (`partials`), and dropped from the
    index with their entry."""
    h = Harness(host_blocks=16)
    rng = random.Random(0)
    tokens = [rng.randrange(8, 300) for _ in range(10)]  # 9 computed: two full blocks and a partial of 1
    h.run(tokens)
    parent = h.pool.hash_block(h.pool.hash_block(None, tokens[:4]), tokens[4:8])
    assert [n for n, _ in h.host.partials(parent)] == [1]
    assert h.host.contains(block_name(parent))
    h.host.delete([name for _, name in h.host.partials(parent)])
    assert h.host.partials(parent) == []

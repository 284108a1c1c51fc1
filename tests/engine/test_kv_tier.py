"""The KV manager over the disk tier, without a model: what a block's bytes are after a round trip through the store,
a prompt whose blocks are partly in the pool and partly on disk, and a pool with room for only some of them."""
from __future__ import annotations

import pytest
import torch

from tsterm.config import SamplingParams
from tsterm.engine.block_pool import BlockPool
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.kv_store import KVDiskStore
from tsterm.engine.kv_tier import DiskTier
from tsterm.engine.sequence import Sequence

B = 4
SHAPE = (2, 2, 3, 2)  # [L, (k, v), ..., B, Hkv, D] around the block axis: 2 layers, 3 heads, head_dim 2


class Engine:
    """A pool, its KV tensor and a KV manager over a disk tier: an engine's bookkeeping with no model."""

    def __init__(self, path, num_blocks: int = 16):
        self.pool = BlockPool(num_blocks, B, fingerprint="tier-test")
        L, two, H, D = SHAPE
        self.kv = torch.zeros((L, two, num_blocks, B, H, D))
        self.tier = DiskTier(KVDiskStore(path, 1 << 20, "tier-test"), self.kv, self.pool.root_hash)
        self.manager = KVCacheManager(self.pool, tier=self.tier)

    def compute(self, seq: Sequence) -> None:
        """Allocate and 'compute' the rest of `seq`: each position's KV is a function of its token and position."""
        start, n = seq.num_computed_tokens, seq.num_uncomputed_tokens
        self.manager.allocate_slots(seq, n)
        for p in range(start, start + n):
            self.kv[:, :, seq.block_table[p // B], p % B] = kv_of(seq.token_ids[p], p)
        seq.num_computed_tokens += n
        self.manager.commit(seq)

    def close(self) -> None:
        self.tier.close()


def kv_of(token: int, position: int) -> torch.Tensor:
    L, two, H, D = SHAPE
    return torch.arange(L * two * H * D, dtype=torch.float32).reshape(L, two, H, D) + 1000 * token + position


def check_kv(engine: Engine, seq: Sequence, upto: int) -> None:
    for p in range(upto):
        assert torch.equal(engine.kv[:, :, seq.block_table[p // B], p % B], kv_of(seq.token_ids[p], p)), p


def new_seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


@pytest.fixture
def stored(tmp_path):
    """A store holding a finished 22-token sequence's 5 full blocks and its partial one (21 computed tokens)."""
    tokens = list(range(10, 32))
    first = Engine(tmp_path)
    seq = new_seq(tokens)
    first.manager.match_prefix(seq)
    first.compute(seq)
    seq.num_computed_tokens -= 1  # (the last token: sampled, never fed to the model)
    first.manager.free(seq)
    first.close()
    return tmp_path, tokens


def test_a_new_pool_reads_the_prefix_back_with_its_exact_bytes(stored):
    path, tokens = stored
    engine = Engine(path)
    seq = new_seq(tokens + [99, 98])
    assert engine.manager.match_prefix(seq) == 21  # 5 full blocks and the partial one's 1 token
    engine.manager.record_prefix_query(seq)
    check_kv(engine, seq, 21)
    assert engine.manager.stats()["kv_tier_hit_tokens"] == 21
    assert engine.tier.hit_blocks == 6 and engine.tier.loads == 1
    engine.pool.check_invariants()
    engine.close()


def test_blocks_in_the_pool_and_on_disk_interleave_in_one_prefix(stored):
    path, tokens = stored
    engine = Engine(path)
    head = new_seq(tokens[:12])  # blocks 0-2 computed in this pool ...
    engine.manager.match_prefix(head)
    engine.compute(head)
    held = list(head.block_table)
    third = held[2]
    engine.manager.free(head)
    engine.pool.acquire(third)
    taken = [engine.pool.allocate() for _ in range(engine.pool.num_free)]  # ... then blocks 0 and 1 evicted
    for block_id in taken:
        engine.pool.release(block_id)
    engine.pool.release(third)
    assert [engine.pool.blocks[b].block_hash is not None for b in held] == [False, False, True]
    before = engine.tier.hit_blocks
    seq = new_seq(tokens + [99])
    assert engine.manager.match_prefix(seq) == 21  # disk, disk, pool, disk, disk, then the partial from disk
    assert seq.block_table[2] == third and engine.tier.hit_blocks - before == 5
    check_kv(engine, seq, 21)
    engine.pool.check_invariants()
    engine.close()


def test_a_pool_with_room_for_some_blocks_loads_those_and_computes_the_rest(stored):
    path, tokens = stored
    engine = Engine(path, num_blocks=8)
    holder = new_seq(list(range(200, 220)))  # 5 blocks referenced by a running sequence: 3 left
    engine.manager.match_prefix(holder)
    engine.compute(holder)
    seq = new_seq(tokens + [99])
    assert engine.manager.match_prefix(seq) == 3 * B  # the first three full blocks, in order; not the others
    check_kv(engine, seq, 3 * B)
    assert engine.tier.hit_blocks == 3 and engine.pool.num_free == 0
    engine.pool.check_invariants()
    engine.manager.free(seq)
    engine.manager.free(holder)
    engine.pool.check_invariants()
    engine.close()

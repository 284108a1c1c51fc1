"""BlockPool's recurrent-state slots and snapshots (hybrid models), ids only: a snapshot lives while its block is
hashed and leaves with it; when slots run out, live sequences take the least recently used snapshot's slot."""
from __future__ import annotations

import pytest

from tsterm.engine.block_pool import BlockPool, NoFreeBlocksError


def filled(pool: BlockPool, tokens: list[int]) -> int:
    """A referenced, registered block holding `tokens`."""
    block_id = pool.allocate()
    pool.register(block_id, None, tokens)
    return block_id


def test_a_snapshot_lives_with_its_block_and_leaves_with_its_hash():
    pool = BlockPool(2, 2, num_state_slots=3)
    block = filled(pool, [1, 2])
    slot = pool.allocate_state_slot()
    assert pool.attach_snapshot(block, slot) and pool.blocks[block].snapshot == slot
    assert not pool.attach_snapshot(block, pool.allocate_state_slot())  # one per block: the second is released
    pool.release(block)  # cached, snapshot and all
    pool.check_invariants()
    assert pool.use_snapshot(block) == slot and pool.state_slot_refs(slot) == 2  # held for the copy from it
    pool.release_state_slot(slot)  # the copy has run
    other = pool.allocate()  # the free block
    evicting = pool.allocate()  # evicts the cached one: its snapshot's slot is free again
    assert evicting == block and pool.blocks[block].snapshot is None
    assert sorted(pool.allocate_state_slot() for _ in range(3)) == [0, 1, 2]
    pool.release(other)
    pool.release(evicting)
    pool.check_invariants()


def test_an_unhashed_block_keeps_no_snapshot():
    pool = BlockPool(2, 2, num_state_slots=1)
    block = pool.allocate()  # never registered (a partial block, or prefix caching off)
    assert not pool.attach_snapshot(block, pool.allocate_state_slot())
    assert pool.allocate_state_slot() == 0  # released back


def test_live_sequences_take_the_least_recently_used_snapshot():
    pool = BlockPool(4, 2, num_state_slots=2)
    a, b = filled(pool, [1, 2]), filled(pool, [3, 4])
    pool.attach_snapshot(a, pool.allocate_state_slot())
    pool.attach_snapshot(b, pool.allocate_state_slot())
    pool.release_state_slot(pool.use_snapshot(a))  # a is now the most recently used (its copy ran at once)
    slot = pool.allocate_state_slot()
    assert pool.blocks[b].snapshot is None and pool.blocks[a].snapshot not in (None, slot)
    assert pool.stats()["state_snapshot_evictions"] == 1 and pool.stats()["state_snapshots"] == 1
    pool.allocate_state_slot()  # a's
    with pytest.raises(NoFreeBlocksError, match="all 2 recurrent-state slots are held by live sequences"):
        pool.allocate_state_slot()
    pool.check_invariants()


def test_a_snapshot_read_by_a_pending_copy_is_neither_evicted_nor_handed_out():
    """A matched snapshot is held until its copy has run: a live sequence that needs a slot takes another snapshot's,
    or none; its block may lose its hash meanwhile, but the slot is free only once the copy lets go."""
    pool = BlockPool(4, 2, num_state_slots=2)
    a, b = filled(pool, [1, 2]), filled(pool, [3, 4])
    pool.attach_snapshot(a, pool.allocate_state_slot())
    read = pool.use_snapshot(a)  # a sequence resumes from a's snapshot (its copy runs at the sequence's next step)
    pool.attach_snapshot(b, pool.allocate_state_slot())  # b is the most recently used; a, still, is not the one to go
    taken = pool.allocate_state_slot()
    assert pool.blocks[b].snapshot is None and taken != read and pool.blocks[a].snapshot == read
    with pytest.raises(NoFreeBlocksError, match="or by copies not yet run"):
        pool.allocate_state_slot()
    pool.release(a)
    pool.release(b)
    for _ in range(3):  # the two free blocks, then the least recently released: a, its hash and snapshot
        pool.allocate()
    assert pool.blocks[a].snapshot is None and pool.state_slot_refs(read) == 1 and pool.num_free_state_slots == 0
    pool.check_invariants()
    pool.release_state_slot(read)  # the copy has run
    assert pool.allocate_state_slot() == read
    pool.check_invariants()

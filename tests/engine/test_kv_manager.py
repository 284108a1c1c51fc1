"""Unit tests of KVCacheManager + BlockPool: prefix hits, commit of generated tokens, fork/CoW, LRU, errors."""
from __future__ import annotations

import pytest

from tsterm.config import SamplingParams
from tsterm.engine.block_pool import BlockPool, NoFreeBlocksError
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.sequence import Sequence

B = 4


def make(num_blocks: int = 16, **kw) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, B, fingerprint="test-model", **kw)
    return pool, KVCacheManager(pool)


def new_seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def run(kv: KVCacheManager, seq: Sequence, num_tokens: int | None = None) -> list[tuple[int, int]]:
    """What the scheduler + runner do for one step: allocate, 'compute', commit."""
    n = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
    copies = kv.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    kv.commit(seq)
    return copies


def admit(kv: KVCacheManager, tokens) -> tuple[Sequence, int]:
    seq = new_seq(tokens)
    hit = kv.match_prefix(seq)
    kv.record_prefix_query(seq)  # what the scheduler does once the admission succeeds
    run(kv, seq)
    return seq, hit


def snapshot(pool: BlockPool, kv: KVCacheManager, *seqs: Sequence):
    return (sorted(pool._free), list(pool._cached), dict(pool._hash_to_block),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks], kv.stats(),
            [(list(s.block_table), s.num_computed_tokens) for s in seqs])


def test_fresh_sequence_gets_consecutive_blocks():
    pool, kv = make()
    a, _ = admit(kv, range(10))
    b, _ = admit(kv, range(100, 118))
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [4, 5, 6, 7, 8]  # block 3 stays free: where `a` grows next
    assert kv.slot_mapping(a, 3, 6) == [3, 4 * 1 + 0, 4 * 1 + 1]
    assert kv.slot_mapping(b, 0, 2) == [16, 17]
    a.token_ids.extend(range(10, 13))
    run(kv, a)
    assert a.block_table == [0, 1, 2, 3]  # still one run


def test_consecutive_after_evicting_tail_first():
    pool, kv = make(num_blocks=4)
    a, _ = admit(kv, range(16))  # 4 full blocks, all committed
    kv.free(a)
    b, _ = admit(kv, range(100, 116))  # evicts a's cached blocks (tail first), sorted in one call
    assert b.block_table == [0, 1, 2, 3]


def test_a_growing_sequence_takes_the_block_after_its_last_one():
    pool, kv = make()
    a, _ = admit(kv, range(6))  # [0, 1], block 1 half full
    b, _ = admit(kv, range(100, 104))
    assert b.block_table == [3]  # block 2 is left free for `a`
    kv.free(a)  # block 0 is cached (full), block 1 too (a partial block: a's tokens 4, 5); block 2 is free again
    b.token_ids.extend(range(104, 108))
    run(kv, b)
    assert b.block_table == [3, 4]  # one run, not [3, 2]
    c, _ = admit(kv, range(200, 204))
    assert c.block_table == [2]  # nothing to continue: the lowest free id after an unreferenced block
    pool.check_invariants()


def test_headroom_is_given_up_when_every_free_block_follows_a_live_one():
    pool, kv = make(num_blocks=4)
    a, _ = admit(kv, range(4))  # [0]
    b, _ = admit(kv, range(100, 104))  # [2]: block 1 left for `a`
    c, _ = admit(kv, range(200, 208))  # two blocks, and only 1 and 3 are free: both taken
    assert (a.block_table, b.block_table, sorted(c.block_table)) == ([0], [2], [1, 3])
    pool.check_invariants()


def test_shared_prefix_of_two_and_a_half_blocks_hits_two_blocks():
    pool, kv = make()
    prefix = list(range(10))  # 2.5 blocks
    a, hit_a = admit(kv, prefix + [50, 51, 52])
    assert hit_a == 0
    b, hit_b = admit(kv, prefix + [60, 61])
    assert hit_b == 8 and b.num_cached_tokens == 8 and b.num_computed_tokens == 10 + 2
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert pool.stats()["shared"] == 2
    # still hits once `a` is gone: its blocks are cached, not freed
    kv.free(a)
    kv.free(b)
    c, hit_c = admit(kv, prefix + [70])
    assert hit_c == 8
    s = kv.stats()
    assert s["prefix_hit_tokens"] == 16 and s["prefix_query_tokens"] == 13 + 12 + 11


def test_last_token_never_served_from_cache():
    pool, kv = make()
    tokens = list(range(12))  # exactly 3 blocks
    a, _ = admit(kv, tokens)
    b = new_seq(tokens)
    assert kv.match_prefix(b) == 8  # len/B - 1 blocks
    assert b.num_uncomputed_tokens == 4
    assert kv.allocate_slots(b, 4) == []
    assert len(b.block_table) == 3 and b.block_table[2] != a.block_table[2]


def test_generated_tokens_become_cacheable_after_commit():
    pool, kv = make()
    seq, _ = admit(kv, range(6))
    for t in range(100, 107):  # decode: append the sampled token, compute it next step
        seq.token_ids.append(t)
        copies = kv.allocate_slots(seq, 1)
        assert copies == []
        seq.num_computed_tokens += 1
        if t < 105:
            kv.commit(seq)
    history = list(seq.token_ids)  # 13 tokens, all computed; blocks 0-1 committed, block 2 full but not yet
    probe = new_seq(history + [7])
    assert kv.match_prefix(probe) == 8  # block 2 (tokens 8..11) computed but not committed yet
    kv.free(probe)
    kv.commit(seq)
    kv.free(seq)
    next_turn = new_seq(history + [1, 2, 3])
    assert kv.match_prefix(next_turn) == 13  # 3 full blocks, then the partial block holding token 12


def test_the_next_turn_takes_over_the_partial_block_and_appends_in_place():
    """A reply's last block is partly filled when it finishes: the next turn's prompt (the history and more) takes
    that block over instead of computing its tokens again, and writes its own tokens into it, no copy."""
    pool, kv = make()
    a, _ = admit(kv, range(10))  # blocks 0, 1 full, block 2 holds tokens 8, 9
    partial = a.block_table[2]
    kv.free(a)
    assert pool.stats()["partial_cached"] == 1 and pool.blocks[partial].partial_ids == (8, 9)
    b = new_seq(list(range(10)) + [50, 51, 52])
    assert kv.match_prefix(b) == 10 and b.block_table == [0, 1, partial]
    assert pool.blocks[partial].ref_cnt == 1 and pool.stats()["partial_cached"] == 0  # b's alone now
    assert kv.allocate_slots(b, 3) == [] and b.block_table == [0, 1, partial, 3]  # no copy-on-write
    assert kv.slot_mapping(b, 10, 13) == [partial * B + 2, partial * B + 3, 3 * B]  # in place after 8, 9
    pool.check_invariants()


def test_a_partial_block_serves_the_tokens_a_prompt_shares_with_it():
    pool, kv = make()
    a, _ = admit(kv, range(7))  # block 1 holds 4, 5, 6
    partial = a.block_table[1]
    kv.free(a)
    b = new_seq([0, 1, 2, 3, 4, 5, 99, 100])  # shares 4, 5 of the three
    assert kv.match_prefix(b) == 6 and b.block_table == [0, partial]
    kv.free(b)  # (b computed nothing more: the block is kept again, now holding 4, 5)
    assert pool.blocks[partial].partial_ids == (4, 5)
    c = new_seq([0, 1, 2, 3, 4])  # 4 is its last token: computed, never served
    assert kv.match_prefix(c) == 4 and len(c.block_table) == 1
    d = new_seq([0, 1, 2, 3, 77, 5])  # differs at once: nothing after the full block
    assert kv.match_prefix(d) == 4
    for s in (c, d):
        kv.free(s)
    pool.check_invariants()


def test_a_partial_block_another_table_holds_is_not_kept():
    pool, kv = make()
    a, _ = admit(kv, range(6))
    child = new_seq(a.token_ids)
    kv.fork(a, child)  # both hold block 1 (4, 5)
    kv.free(a)
    assert pool.stats()["partial_cached"] == 0  # the child still writes into it
    kv.free(child)  # the last holder: now it is kept
    assert pool.stats()["partial_cached"] == 1
    pool.check_invariants()


def test_fork_shares_blocks_and_cows_the_partial_block_once_per_branch():
    pool, kv = make()
    parent, _ = admit(kv, range(10))  # blocks: full, full, partial (2 of 4)
    children = [new_seq(parent.token_ids) for _ in range(2)]
    for child in children:
        kv.fork(parent, child)
        assert child.block_table == parent.block_table
        assert child.num_computed_tokens == 10
    assert pool.stats()["shared"] == 3 and pool.blocks[parent.block_table[2]].ref_cnt == 3
    partial = parent.block_table[2]
    branches = [parent, *children]
    for k, seq in enumerate(branches):
        seq.token_ids.append(200 + k)
        copies = kv.allocate_slots(seq, 1)
        if k < 2:  # the block is still shared: copy it
            assert copies == [(partial, seq.block_table[2])] and seq.block_table[2] != partial
        else:  # the last holder now owns it alone: write in place
            assert copies == [] and seq.block_table[2] == partial
        assert seq.block_table[:2] == branches[0].block_table[:2]
        seq.num_computed_tokens += 1
    assert kv.cow_copies == 2
    for seq in branches:  # a later append on any branch never copies again
        seq.token_ids.append(300)
        assert kv.allocate_slots(seq, 1) == []
        seq.num_computed_tokens += 1
    assert len({s.block_table[2] for s in branches}) == 3
    assert kv.stats()["cow_copies"] == 2 and pool.stats()["shared"] == 2
    for seq in branches:
        kv.free(seq)
    pool.check_invariants()
    assert pool.stats()["used"] == 0


def test_forged_hash_with_other_tokens_is_a_miss():
    pool, kv = make()
    a, _ = admit(kv, range(9))
    h0 = pool.blocks[a.block_table[0]].block_hash
    assert pool.lookup(h0, [0, 1, 2, 3]) == a.block_table[0]
    assert pool.lookup(h0, [0, 1, 2, 99]) is None
    assert pool.lookup(h0, [0, 1, 2, 3], parent_hash=12345) is None


def test_hash_collisions_never_serve_wrong_blocks(monkeypatch):
    pool, kv = make()
    monkeypatch.setattr(pool, "hash_block", lambda parent, token_ids: 42)  # every block collides
    a, _ = admit(kv, [1, 2, 3, 4] * 3 + [9])  # equal token ids in every block, different parents
    assert len(pool._hash_to_block) == 1  # the first registration is kept
    b = new_seq([5, 6, 7, 8] * 2 + [9])
    assert kv.match_prefix(b) == 0  # same hash, other tokens: miss
    c = new_seq([1, 2, 3, 4] * 3 + [9])
    assert kv.match_prefix(c) == 4  # block 1 has the same hash and tokens but another parent: miss
    assert c.block_table == a.block_table[:1]
    for s in (a, b, c):
        kv.free(s)
    pool.check_invariants()


def test_eviction_is_lru():
    pool, kv = make(num_blocks=6)
    seqs = [admit(kv, [k] * 4 + [k])[0] for k in range(3)]  # each: 1 full (hashed) + 1 partial block
    full, part = [s.block_table[0] for s in seqs], [s.block_table[1] for s in seqs]
    for s in seqs:
        kv.free(s)  # the partial block first: a sequence's tail is evicted before its head
    assert list(pool._cached) == [part[0], full[0], part[1], full[1], part[2], full[2]]
    assert pool.stats()["cached"] == 6 and pool.stats()["partial_cached"] == 3 and pool.stats()["free"] == 0
    touch = new_seq([0] * 4 + [0])  # a hit on seq 0's full block makes it the most recent
    assert kv.match_prefix(touch) == 4  # (not the partial block: the last token is always computed)
    kv.free(touch)
    assert list(pool._cached) == [part[0], part[1], full[1], part[2], full[2], full[0]]
    taken = [pool.allocate() for _ in range(4)]  # nothing free: the least recently released, in order
    assert taken == [part[0], part[1], full[1], part[2]] and pool.stats()["evictions"] == 4
    assert kv.match_prefix(new_seq([1] * 4 + [1])) == 0
    assert kv.match_prefix(new_seq([2] * 4 + [2])) == 4
    pool.check_invariants()


def test_sequence_tail_evicted_before_head():
    pool, kv = make(num_blocks=4)
    s, _ = admit(kv, range(12))  # 3 full blocks, all committed
    table = list(s.block_table)
    kv.free(s)
    assert list(pool._cached) == table[::-1]
    extra = [pool.allocate() for _ in range(2)]  # 1 free block, then the tail block is evicted
    assert extra == [3, table[2]]
    assert kv.match_prefix(new_seq(range(13))) == 8


def test_no_free_blocks_leaves_state_untouched():
    pool, kv = make(num_blocks=4)
    a, _ = admit(kv, range(6))  # 2 blocks
    b = new_seq(range(100, 112))  # needs 3 blocks, 2 available
    kv.match_prefix(b)
    before = snapshot(pool, kv, a, b)
    assert not kv.can_append(b, 12)
    with pytest.raises(NoFreeBlocksError):
        kv.allocate_slots(b, 12)
    assert snapshot(pool, kv, a, b) == before
    # copy-on-write that cannot get its block: also all or nothing
    child = new_seq(a.token_ids)
    kv.fork(a, child)
    filler = [pool.allocate() for _ in range(2)]
    before = snapshot(pool, kv, a, child)
    a.token_ids.append(7)
    assert not kv.can_append(a, 1)
    with pytest.raises(NoFreeBlocksError):
        kv.allocate_slots(a, 1)
    assert snapshot(pool, kv, a, child) == before
    for block_id in filler:
        pool.release(block_id)
    assert kv.can_append(a, 1)
    assert len(kv.allocate_slots(a, 1)) == 1
    pool.check_invariants()


def test_prefix_caching_disabled():
    pool, kv = make(enable_prefix_caching=False)
    a, _ = admit(kv, range(12))
    kv.free(a)
    b, hit = admit(kv, range(12))
    assert hit == 0 and pool.stats()["cached"] == 0
    kv.free(b)
    assert pool.stats()["free"] == 16
    pool.check_invariants()


def test_fingerprint_separates_models():
    assert BlockPool(4, B, "model-a").hash_block(None, [1, 2, 3, 4]) != \
        BlockPool(4, B, "model-b").hash_block(None, [1, 2, 3, 4])
    pool = BlockPool(4, B, "model-a")
    assert pool.hash_block(None, [1, 2, 3, 4]) == BlockPool(4, B, "model-a").hash_block(None, [1, 2, 3, 4])
    assert pool.hash_block(None, [1, 2, 3, 4]) != pool.hash_block(7, [1, 2, 3, 4])


def test_release_below_zero_asserts():
    pool = BlockPool(2, B)
    block_id = pool.allocate()
    pool.release(block_id)
    with pytest.raises(AssertionError):
        pool.release(block_id)


def test_cached_prefix_blocks_is_what_a_longer_prompt_would_take():
    pool, kv = make()
    a, _ = admit(kv, range(14))  # blocks 0..2 full and committed, the 4th partial
    kv.free(a)
    assert kv.cached_prefix_blocks(list(range(14))) == [0, 1, 2]
    assert kv.cached_prefix_blocks(list(range(12))) == [0, 1, 2]  # a full last block counts (it is cached)
    assert kv.cached_prefix_blocks([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11]) == [0]  # a chain stops at a miss
    assert kv.cached_prefix_blocks([]) == []
    b, hit = admit(kv, list(range(12)) + [50])
    assert hit == 12 and b.block_table[:3] == kv.cached_prefix_blocks(list(range(12)))
    # looking up acquired nothing: b holds the three; a's partial block (12, 13) is all that is cached
    assert pool.stats()["cached"] == pool.stats()["partial_cached"] == 1


def test_a_pinned_block_is_shared_with_a_table_and_outlives_it():
    pool, kv = make(num_blocks=6, max_pinned_blocks=3)
    a, _ = admit(kv, range(13))  # three full blocks
    kv.free(a)
    assert pool.pin("s", kv.cached_prefix_blocks(list(range(13))), expires_at=10.0) == 3
    assert pool.stats()["cached"] == 1 and pool.stats()["used"] == 3 and pool.num_free == 3  # (1: a's partial block)
    b, hit = admit(kv, range(13))  # the session's next turn: the pinned blocks by reference
    assert hit == 12 and all(pool.blocks[i].ref_cnt == 1 and pool.blocks[i].pin_cnt == 1 for i in b.block_table[:3])
    kv.free(b)
    assert pool.stats()["used"] == 3  # still pinned
    with pytest.raises(NoFreeBlocksError):
        admit(kv, range(100, 117))  # 5 blocks: the 3 pinned ones cannot be evicted for it
    pool.check_invariants()
    assert pool.expire_pins(now=9.9) == 0 and pool.expire_pins(now=10.0) == 1
    assert pool.stats()["used"] == 0 and pool.stats()["pinned_blocks"] == 0
    c, _ = admit(kv, range(100, 117))
    assert pool.num_evictions > 0
    pool.check_invariants()

"""Bookkeeping of KV block ids: ref counts, a content-addressed prefix cache, pins, LRU eviction. No tensors here."""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_HASH_BYTES = 16  # 128-bit chain hashes: a collision is not a practical concern, and token ids are re-checked
_HASH_MASK = (1 << (8 * _HASH_BYTES)) - 1
_ANY = object()  # lookup(): do not check the parent hash
# blake2b personalisation of a cache salt's root (`BlockPool.salt_root`): a function apart from the blocks' chain
# hashes, so no salt, however chosen, makes a root equal to a chain hash of other prompts' blocks
_SALT_PERSON = b"tsterm-salt"


class NoFreeBlocksError(RuntimeError):
    """Not enough free or evictable blocks. The scheduler catches it (wait / preempt); nothing was changed."""


class Block:
    """One KV block id and what the pool knows about it.

    States (exactly one at any time):
      free        ref_cnt == 0, pin_cnt == 0, block_hash is None, in the pool's free list
      referenced  ref_cnt > 0 (hashed or not, pinned or not), in at least one block table
      pinned      ref_cnt == 0, pin_cnt > 0, block_hash set, neither free nor in the LRU: not evictable
      cached      ref_cnt == 0, pin_cnt == 0, block_hash set, or (a partial block) partial_ids set, in the pool's
                  LRU of evictable blocks
    """

    __slots__ = ("block_id", "ref_cnt", "pin_cnt", "block_hash", "token_ids", "parent_hash", "snapshot",
                 "partial_ids", "partial_parent")

    def __init__(self, block_id: int):
        self.block_id = block_id  # fixed for life: the index into every layer's KV pool
        self.ref_cnt = 0  # number of block tables holding this block; only BlockPool changes ref_cnt
        # Number of pins holding it (each pin holds a block at most once); only BlockPool changes pin_cnt. A pinned
        # block is always hashed: only registered blocks are pinned, and only eviction unregisters.
        self.pin_cnt = 0
        # Set only while the block is the registered one for its hash (pool._hash_to_block[block_hash] is
        # this block); None otherwise. token_ids / parent_hash are set and cleared together with it.
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # the B token ids it holds, re-checked on every hit
        self.parent_hash: int | None = None  # chain hash of the previous block; None for a sequence's first
        # Hybrid models: the state slot holding the recurrent state after this block's last token, so that a prefix
        # ending here can resume. Set only while the block is hashed (unregistering releases it); only BlockPool
        # changes it.
        self.snapshot: int | None = None
        # A finished sequence's last, partly filled block, kept so that a prompt continuing its tokens takes it over
        # (`take_partial`) instead of computing them again: the token ids whose KV it holds (1 to B - 1 of them) and
        # the chain hash of the full block before it (None for a sequence's first). Set only while it is cached so;
        # never together with block_hash.
        self.partial_ids: tuple[int, ...] | None = None
        self.partial_parent: int | None = None

    def __repr__(self) -> str:
        h = None if self.block_hash is None else f"{self.block_hash:032x}"[:8]
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, pin={self.pin_cnt}, hash={h})"


@dataclass(slots=True)
class Pin:
    """A pool-level hold on cached blocks (a session's prefix while it waits on a tool or the user), until `unpin`
    or `expires_at` (the caller's clock). Holds `block_ids` (each once) through their pin_cnt, not their ref_cnt:
    a pin is no block table."""

    block_ids: tuple[int, ...]
    expires_at: float


class BlockPool:
    """`num_blocks` KV block ids of `block_size` slots each.

    `allocate` takes a free block (the one asked for when it is free, else the lowest id that leaves the block
    after a live sequence's last one free, so that every sequence's blocks form consecutive runs) or, when none is
    free, evicts the least recently released cached block. A referenced or pinned block is never evicted.
    `fingerprint` names the model (and anything else that changes KV for equal token ids): it seeds the root
    of every hash chain, so two models never share blocks. A request's cache salt (`salt_root`) replaces that root
    for its own chain, so prompts of different salts (or with and without one) never share blocks either.
    `max_pinned_blocks` caps the distinct blocks that pins hold (None: no cap beyond the pool).

    `num_state_slots` (hybrid models): ids of the model's recurrent-state slots, handed out and reference-counted
    here too, like blocks. A live sequence holds its working slot and, with prefix caching, a snapshot slot; a
    finished sequence's snapshot is attached to the hashed block it ends at (`attach_snapshot`), and so is a live
    sequence's at a stride boundary of its prompt when a free slot can take its place (`take_free_state_slot`). A
    copy that will read a slot (a matched snapshot, until it is copied into the sequence's own slot) holds it too
    (`use_snapshot` / `acquire_state_slot`), so that it is neither handed out nor written before the copy ran. An
    attached snapshot is released with its block's hash, or taken back least recently used first when a live
    sequence needs a slot and none is free; never one that a pending copy still reads.
    """

    def __init__(self, num_blocks: int, block_size: int, fingerprint: str = "", enable_prefix_caching: bool = True,
                 max_pinned_blocks: int | None = None, num_state_slots: int = 0):
        assert num_blocks >= 1 and block_size >= 1, (num_blocks, block_size)
        assert max_pinned_blocks is None or 0 <= max_pinned_blocks <= num_blocks, max_pinned_blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: set[int] = set(range(num_blocks))
        self._free_heap: list[int] = list(range(num_blocks))  # min-heap over a superset of _free (lazy removal)
        self._cached: OrderedDict[int, None] = OrderedDict()  # evictable, least recently released first
        self._hash_to_block: dict[int, int] = {}
        self._partials: dict[int | None, list[int]] = {}  # parent chain hash -> cached partial blocks after it
        self._num_partials = 0  # blocks in _partials, kept up to date so stats() is O(1)
        self._root_hash = int.from_bytes(hashlib.blake2b(fingerprint.encode(), digest_size=_HASH_BYTES).digest(),
                                         "little")
        self._num_shared = 0  # blocks with ref_cnt > 1, kept up to date so stats() is O(1)
        self.num_evictions = 0
        self.max_pinned_blocks = num_blocks if max_pinned_blocks is None else max_pinned_blocks
        # pin key -> its pin. Block.pin_cnt == the number of pins listing the block; _num_pinned <= max_pinned_blocks
        self._pins: dict[str, Pin] = {}
        self._num_pinned = 0  # blocks with pin_cnt > 0, kept up to date so stats() and the cap are O(1)
        self.num_pins_expired = 0
        self.num_state_slots = num_state_slots
        # Holders of each state slot: the live sequence whose state or snapshot it is (1), the block it is attached
        # to as a snapshot (1), and each pending copy that reads it (1 each). Only BlockPool changes it. A slot is
        # in _free_state_slots exactly when it has no holder: a slot a copy still reads is never handed out.
        self._state_refs = [0] * num_state_slots
        self._free_state_slots = list(range(num_state_slots - 1, -1, -1))  # a stack: slot 0 is handed out first
        # blocks holding a snapshot (Block.snapshot), least recently attached or used first
        self._snapshots: OrderedDict[int, None] = OrderedDict()
        self.num_snapshot_evictions = 0

    # ---- hashing and lookup

    @property
    def root_hash(self) -> int:
        """The parent hash a first block is chained from (None's, in `hash_block`): the model fingerprint's."""
        return self._root_hash

    def salt_root(self, salt: str) -> int:
        """The parent hash of the first block of a prompt cached under `salt` (a request's `cache_salt`), in place of
        None (the model fingerprint's root): the fingerprint's root and the salt, hashed apart from the chain hashes
        (`_SALT_PERSON`). Its chain and its partial blocks are then reachable only with the same salt."""
        h = hashlib.blake2b(digest_size=_HASH_BYTES, person=_SALT_PERSON)
        h.update(self._root_hash.to_bytes(_HASH_BYTES, "little"))
        h.update(salt.encode("utf-8", "surrogatepass"))  # (a JSON string may hold a lone surrogate)
        return int.from_bytes(h.digest(), "little")

    def hash_block(self, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """Chain hash of a full block: its parent's hash (the model fingerprint for the first, or its salt's root:
        `salt_root`) + its token ids."""
        h = hashlib.blake2b(digest_size=_HASH_BYTES)
        parent = self._root_hash if parent_hash is None else parent_hash & _HASH_MASK
        h.update(parent.to_bytes(_HASH_BYTES, "little"))
        h.update(array("q", token_ids).tobytes())
        return int.from_bytes(h.digest(), "little")

    def lookup(self, block_hash: int, token_ids: Sequence[int], parent_hash: int | None | object = _ANY) -> int | None:
        """The cached or referenced block registered under `block_hash` holding exactly `token_ids` (and, when
        given, chained to `parent_hash`); None on a miss, a mismatch included. Does not acquire it."""
        if not self.enable_prefix_caching:
            return None
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids) or (parent_hash is not _ANY and block.parent_hash != parent_hash):
            return None
        return block_id

    def keep_partial(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> bool:
        """Before the last holder releases `block_id`, a partly filled block (the KV of `token_ids`, the tokens after
        the full block hashed `parent_hash`): keep it cached, for a prompt that continues those tokens. False (and
        nothing kept) when prefix caching is off, another table holds it too, or it is not partial."""
        block = self.blocks[block_id]
        if (not self.enable_prefix_caching or block.ref_cnt != 1 or block.block_hash is not None
                or not 0 < len(token_ids) < self.block_size):
            return False
        block.partial_ids, block.partial_parent = tuple(token_ids), parent_hash
        self._partials.setdefault(parent_hash, []).append(block_id)
        self._num_partials += 1
        return True

    def lookup_partial(self, parent_hash: int | None, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(block, n): the cached partial block after the full block hashed `parent_hash` whose first n >= 1 token
        ids are the first n of `token_ids`, n as large as any such block gives; None when none matches."""
        best = None
        for block_id in self._partials.get(parent_hash, ()):
            held = self.blocks[block_id].partial_ids
            n = 0
            while n < len(held) and n < len(token_ids) and held[n] == token_ids[n]:
                n += 1
            if n and (best is None or n > best[1]):
                best = (block_id, n)
        return best

    def take_partial(self, block_id: int) -> None:
        """A cached partial block leaves the cache for one block table (ref_cnt 1), which writes its next tokens in
        place: no other prompt can take it from here on."""
        block = self.blocks[block_id]
        assert block.ref_cnt == 0 and block.partial_ids is not None, f"take_partial of {block}"
        del self._cached[block_id]
        self._drop_partial(block)
        block.ref_cnt = 1

    def _drop_partial(self, block: Block) -> None:
        siblings = self._partials[block.partial_parent]
        siblings.remove(block.block_id)
        if not siblings:
            del self._partials[block.partial_parent]
        block.partial_ids = block.partial_parent = None
        self._num_partials -= 1

    # ---- allocation and ref counts

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now: free + evictable cached."""
        return len(self._free) + len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, prefer: int | None = None) -> int:
        """A fresh block with ref_cnt 1: `prefer` if it is free (a sequence asks for the id after its last block,
        so its context stays one run of blocks), else the lowest free id, else the least recently used cached
        block."""
        if prefer in self._free:
            block_id = prefer
            self._free.remove(block_id)  # its heap entry goes stale and is skipped later
        elif self._free:
            block_id = self._lowest_free_with_headroom()
            self._free.remove(block_id)
        elif self._cached:
            block_id, _ = self._cached.popitem(last=False)
            block = self.blocks[block_id]
            if block.partial_ids is not None:
                self._drop_partial(block)
            else:
                self._unregister(block)
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV blocks are referenced")
        self.blocks[block_id].ref_cnt = 1
        return block_id

    def _lowest_free_with_headroom(self) -> int:
        """The lowest free id whose predecessor is not referenced, else the lowest free id.

        A referenced block followed by a free one is, in practice, the last block of a live sequence: the free block
        after it is where that sequence grows next (`prefer`). Starting a new run there would split the other
        sequence's context into two runs (two attention calls and a merge per layer, every decode step)."""
        skipped: list[int] = []
        found = None
        while self._free_heap:
            block_id = heapq.heappop(self._free_heap)
            if block_id not in self._free:
                continue  # stale: taken through `prefer`
            if block_id == 0 or self.blocks[block_id - 1].ref_cnt == 0:
                found = block_id
                break
            skipped.append(block_id)
        if found is None:  # every free block follows a referenced one: take the lowest
            found = skipped.pop(0)
        for block_id in skipped:
            heapq.heappush(self._free_heap, block_id)
        return found

    def acquire(self, block_id: int) -> None:
        """One more block table holds `block_id` (a cached block leaves the LRU)."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            assert block.block_hash is not None, f"acquire of free block {block_id}: use allocate()"
            if block.pin_cnt == 0:  # a pinned block is not in the LRU
                del self._cached[block_id]
        elif block.ref_cnt == 1:
            self._num_shared += 1
        block.ref_cnt += 1

    def release(self, block_id: int) -> None:
        """One block table fewer holds `block_id`; at 0 it stays pinned if a pin holds it, else becomes cached (most
        recent) if hashed, else free."""
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"release of unreferenced block {block_id}"
        block.ref_cnt -= 1
        if block.ref_cnt == 1:
            self._num_shared -= 1
        elif block.ref_cnt == 0 and block.pin_cnt == 0:
            if block.block_hash is not None or block.partial_ids is not None:
                self._cached[block_id] = None
            else:
                self._free.add(block_id)
                heapq.heappush(self._free_heap, block_id)
                if len(self._free_heap) > 2 * self.num_blocks:  # too many stale entries: rebuild
                    self._free_heap = sorted(self._free)

    def register(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """Make a full, referenced block content-addressed and return its chain hash. If another block is
        already registered under that hash, that registration stays and this block remains unhashed."""
        block_hash = self.hash_block(parent_hash, token_ids)
        block = self.blocks[block_id]
        assert block.ref_cnt > 0 and len(token_ids) == self.block_size, (block, len(token_ids))
        if not self.enable_prefix_caching or block.block_hash == block_hash or block_hash in self._hash_to_block:
            return block_hash
        assert block.block_hash is None, f"block {block_id} re-registered with different content"
        block.block_hash, block.token_ids, block.parent_hash = block_hash, tuple(token_ids), parent_hash
        self._hash_to_block[block_hash] = block_id
        return block_hash

    def _unregister(self, block: Block) -> None:
        assert block.pin_cnt == 0, f"unregister of pinned {block}"
        del self._hash_to_block[block.block_hash]
        block.block_hash = block.token_ids = block.parent_hash = None
        if block.snapshot is not None:
            self._detach_snapshot(block)

    # ---- recurrent-state slots and snapshots (hybrid models)

    def allocate_state_slot(self) -> int:
        """A state slot for a live sequence (one holder): a free one, else the least recently used snapshot's (its
        block stays cached, without a state to resume from) that no pending copy reads; one on a pinned block (a
        session waiting on a tool or its user) only when every such snapshot is pinned."""
        if not self._free_state_slots:
            block_id = self._evictable_snapshot()
            if block_id is not None:
                self._detach_snapshot(self.blocks[block_id])
                self.num_snapshot_evictions += 1
        if not self._free_state_slots:
            raise NoFreeBlocksError(f"all {self.num_state_slots} recurrent-state slots are held by live sequences "
                                    "or by copies not yet run")
        return self._take_state_slot()

    def _evictable_snapshot(self) -> int | None:
        """The block of the least recently used snapshot held by its block alone (unpinned first), or None."""
        pinned = None
        for block_id in self._snapshots:
            block = self.blocks[block_id]
            if self._state_refs[block.snapshot] > 1:  # a pending copy reads it: it must stay as it is
                continue
            if block.pin_cnt == 0:
                return block_id
            pinned = block_id if pinned is None else pinned
        return pinned

    def _take_state_slot(self) -> int:
        slot = self._free_state_slots.pop()
        self._state_refs[slot] = 1
        return slot

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_state_slots)

    def take_free_state_slot(self) -> int | None:
        """A free state slot, or None: unlike `allocate_state_slot`, never takes a kept snapshot's (for snapshots
        that are worth keeping only while slots are spare)."""
        return self._take_state_slot() if self._free_state_slots else None

    def acquire_state_slot(self, slot: int) -> None:
        """One more holder of a held slot: a copy that will read it (release it once the copy has run)."""
        assert 0 <= slot < self.num_state_slots and self._state_refs[slot] > 0, f"acquire of free state slot {slot}"
        self._state_refs[slot] += 1

    def release_state_slot(self, slot: int) -> None:
        """One holder fewer; the slot is free when none is left."""
        assert 0 <= slot < self.num_state_slots and self._state_refs[slot] > 0, f"release of free state slot {slot}"
        self._state_refs[slot] -= 1
        if self._state_refs[slot] == 0:
            self._free_state_slots.append(slot)

    def state_slot_refs(self, slot: int) -> int:
        """Holders of `slot` (0: free)."""
        return self._state_refs[slot]

    def attach_snapshot(self, block_id: int, slot: int) -> bool:
        """Keep `slot` (the state after `block_id`'s last token) with the block, which takes over the caller's hold
        on it; False (and the caller's hold released) when the block is not hashed or already has one (the same
        prefix: the same state)."""
        if not self.can_attach_snapshot(block_id):
            self.release_state_slot(slot)
            return False
        block = self.blocks[block_id]
        block.snapshot = slot
        self._snapshots[block_id] = None
        return True

    def can_attach_snapshot(self, block_id: int) -> bool:
        block = self.blocks[block_id]
        return block.block_hash is not None and block.snapshot is None

    def use_snapshot(self, block_id: int) -> int:
        """The snapshot slot of `block_id`, marked most recently used and held for the caller's copy from it, so
        that it is neither handed out nor overwritten before that copy has run (`release_state_slot` after)."""
        self._snapshots.move_to_end(block_id)
        slot = self.blocks[block_id].snapshot
        self.acquire_state_slot(slot)
        return slot

    def _detach_snapshot(self, block: Block) -> None:
        del self._snapshots[block.block_id]
        self.release_state_slot(block.snapshot)
        block.snapshot = None

    # ---- pins

    def pin(self, key: str, block_ids: Sequence[int], expires_at: float) -> int:
        """Pin the hashed blocks `block_ids` (a prefix chain, first block first) under `key` until `expires_at`,
        replacing the pin `key` held before (released first, so its blocks count against the cap no more).

        Under the cap it pins the longest leading run that fits: a block some other pin already holds costs
        nothing, any other costs one of `max_pinned_blocks`. A later block without the earlier ones would be
        useless to a prefix match, so it stops at the first that does not fit. Returns the number of blocks
        pinned; with 0 no pin is recorded under `key`."""
        self.unpin(key)
        taken: dict[int, None] = {}  # ordered, and O(1) to check that no block comes twice
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.block_hash is not None and block_id not in taken, f"pin of unhashed or repeated {block}"
            if block.pin_cnt == 0:
                if self._num_pinned >= self.max_pinned_blocks:
                    break
                self._num_pinned += 1
                if block.ref_cnt == 0:
                    del self._cached[block_id]  # out of the LRU: never evicted while pinned
            block.pin_cnt += 1
            taken[block_id] = None
        if taken:
            self._pins[key] = Pin(tuple(taken), expires_at)
        return len(taken)

    def unpin(self, key: str) -> bool:
        """Release the pin held under `key` (False if there is none). A block no one holds any more becomes cached,
        most recent: it was in use until now."""
        pin = self._pins.pop(key, None)
        if pin is None:
            return False
        for block_id in pin.block_ids:
            block = self.blocks[block_id]
            block.pin_cnt -= 1
            if block.pin_cnt == 0:
                self._num_pinned -= 1
                if block.ref_cnt == 0:
                    self._cached[block_id] = None
        return True

    def expire_pins(self, now: float) -> int:
        """Release every pin whose `expires_at` is at or before `now`; returns how many. O(number of pins)."""
        expired = [key for key, pin in self._pins.items() if pin.expires_at <= now]
        for key in expired:
            self.unpin(key)
        self.num_pins_expired += len(expired)
        return len(expired)

    def pins(self) -> dict[str, Pin]:
        """The live pins by key (a copy of the mapping; do not change the Pin objects)."""
        return dict(self._pins)

    # ---- introspection

    def stats(self) -> dict[str, int]:
        """used: blocks neither free nor evictable (referenced, or pinned); pinned_blocks: blocks some pin holds,
        whether a block table holds them too or not."""
        free, cached = len(self._free), len(self._cached)
        return {"num_blocks": self.num_blocks, "free": free, "used": self.num_blocks - free - cached,
                "cached": cached, "partial_cached": self._num_partials,
                "shared": self._num_shared, "evictions": self.num_evictions,
                "pinned_blocks": self._num_pinned, "pins": len(self._pins), "pins_expired": self.num_pins_expired,
                "state_snapshots": len(self._snapshots), "state_snapshot_evictions": self.num_snapshot_evictions}

    def check_invariants(self) -> None:
        """O(num_blocks) consistency check for tests."""
        free, cached = self._free, set(self._cached)
        assert free <= set(self._free_heap), "a free id missing from the allocation heap"
        assert not free & cached
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            hashed = block.block_hash is not None
            assert hashed == (block.token_ids is not None), block
            if hashed:
                assert self._hash_to_block.get(block.block_hash) == block.block_id, block
                assert len(block.token_ids) == self.block_size, block
            else:
                assert block.parent_hash is None, block
            assert block.pin_cnt >= 0 and (block.pin_cnt == 0 or hashed), block
            partial = block.partial_ids is not None
            assert not (partial and (hashed or block.ref_cnt or block.pin_cnt)), block
            assert partial == (block.block_id in self._partials.get(block.partial_parent, ())), block
            if partial:
                assert 0 < len(block.partial_ids) < self.block_size, block
            else:
                assert block.partial_parent is None, block
            if block.ref_cnt > 0 or block.pin_cnt > 0:
                assert block.block_id not in free and block.block_id not in cached, block
            elif hashed or partial:
                assert block.block_id in cached and block.block_id not in free, block
            else:
                assert block.block_id in free and block.block_id not in cached, block
        assert len(self._hash_to_block) == sum(b.block_hash is not None for b in self.blocks)
        assert self._num_shared == sum(b.ref_cnt > 1 for b in self.blocks)
        pin_holders: dict[int, int] = {}
        for pin in self._pins.values():
            assert pin.block_ids and len(set(pin.block_ids)) == len(pin.block_ids), pin
            for block_id in pin.block_ids:
                pin_holders[block_id] = pin_holders.get(block_id, 0) + 1
        assert all(b.pin_cnt == pin_holders.get(b.block_id, 0) for b in self.blocks), "pin_cnt != pins holding it"
        assert self._num_pinned == len(pin_holders) <= self.max_pinned_blocks
        assert self._num_partials == sum(len(ids) for ids in self._partials.values()) == \
            sum(b.partial_ids is not None for b in self.blocks)
        if not self.enable_prefix_caching:
            assert not self._hash_to_block and not self._cached
        assert set(self._snapshots) == {b.block_id for b in self.blocks if b.snapshot is not None}
        assert all(self.blocks[i].block_hash is not None for i in self._snapshots), "a snapshot on an unhashed block"
        attached = [self.blocks[i].snapshot for i in self._snapshots]
        assert len(attached) == len(set(attached)), "a state slot attached to two blocks"
        assert len(self._free_state_slots) == len(set(self._free_state_slots))
        free_slots = set(self._free_state_slots)
        assert free_slots == {slot for slot, refs in enumerate(self._state_refs) if refs == 0}, \
            "a state slot both free and held, or neither free nor held"
        assert all(refs >= 0 for refs in self._state_refs) and not free_slots & set(attached)

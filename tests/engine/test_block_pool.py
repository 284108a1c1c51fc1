"""Stateful property test of BlockPool + KVCacheManager under random interleavings of admission (with shared
prefixes, and partial blocks taken over), prefill chunks, decode appends, commit, fork, preemption, free and eviction pressure, and pins (pin,
re-pin under the same key, unpin, expiry) under a cap.

A shadow KV store records, per slot, the full token context whose KV was written there; copy-on-write pairs
copy it. If blocks were ever shared, evicted or reused wrongly, some sequence would read a wrong context. A shadow of the
pins says which blocks each key holds: a pinned block must keep its content (never evicted) and be released exactly
once, by the unpin or expiry of the last pin holding it.

Hybrid models (`hybrid`): the pool also hands out recurrent-state slots, as many as an engine of MAX_LIVE sequences
holds. A shadow state store records, per slot, the token context whose state is there: a step copies a matched
snapshot in first (`state_restore`), then writes the sequence's state (and its snapshot at a block or interval
boundary); a fork copies the parent's state at once; a slot handed out to anyone (a sequence, an interval snapshot,
someone under slot pressure) holds garbage until written. Every sequence must resume from its own context's state,
every kept snapshot hold its block's, and every pending copy's source stay as it was matched until the copy runs.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tsterm.config import SamplingParams
from tsterm.engine.block_pool import BlockPool, NoFreeBlocksError
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.sequence import Sequence

MAX_LIVE = 6
PIN_KEYS = ("a", "b", "c")
MAX_LEN = 24
GARBAGE = ("garbage",)  # what a state slot holds when it is handed out, until a copy or a step writes it
tokens = st.lists(st.integers(0, 2), max_size=6)  # a tiny vocabulary: prefixes are shared often


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(2, 14),
                caching=st.sampled_from((True, True, True, False)), pin_share=st.sampled_from((0.0, 0.3, 0.6, 1.0)),
                hybrid=st.booleans(), interval_blocks=st.sampled_from((0, 1, 2)))
    def setup(self, block_size, num_blocks, caching, pin_share, hybrid, interval_blocks):
        self.B = block_size
        # what an engine running MAX_LIVE sequences holds (`tsterm.model.cache.num_state_slots`)
        num_state_slots = (3 if caching else 1) * MAX_LIVE if hybrid else 0
        self.pool = BlockPool(num_blocks, block_size, fingerprint="m", enable_prefix_caching=caching,
                              max_pinned_blocks=int(pin_share * num_blocks), num_state_slots=num_state_slots)
        self.now = 0.0
        self.pins: dict[str, tuple[tuple[int, ...], tuple[int, ...], float]] = {}  # key -> (ids, their hashes, expiry)
        self.kv = KVCacheManager(self.pool, snapshot_interval=interval_blocks * block_size)
        self.state_data: dict[int, tuple] = {}  # state slot -> token context whose state it holds (GARBAGE: none)
        self.live: list[Sequence] = []
        self.history: list[list[int]] = []  # token ids of freed sequences, to build shared prefixes from
        self.kv_data: dict[int, tuple[int, ...]] = {}  # slot -> token context whose KV was written there

    def _pick(self, i: int) -> Sequence:
        return self.live[i % len(self.live)]

    def _snapshot(self, seq: Sequence):
        pool = self.pool
        return (list(pool._free), list(pool._cached), dict(pool._hash_to_block),
                [(b.ref_cnt, b.block_hash) for b in pool.blocks], self.kv.stats(),
                list(seq.block_table), seq.num_computed_tokens)

    def _admit(self, seq: Sequence) -> None:
        hit = self.kv.match_prefix(seq)
        B = self.B
        assert hit <= len(seq) - 1  # the last token is always computed
        assert seq.num_computed_tokens == seq.num_cached_tokens == hit and len(seq.block_table) == -(-hit // B)
        for i, block_id in enumerate(seq.block_table[:hit // B]):  # every full hit holds exactly the request's tokens
            block = self.pool.blocks[block_id]
            assert block.token_ids == tuple(seq.token_ids[i * B:(i + 1) * B])
            assert self.kv_data[block_id * B + B - 1] == tuple(seq.token_ids[:(i + 1) * B])
        if hit % B:  # a partial block taken over: this table's alone, written in place from here on
            block = self.pool.blocks[seq.block_table[-1]]
            assert block.ref_cnt == 1 and block.block_hash is None and block.partial_ids is None, block
            # (its slots hold the prompt's own context: sequences_read_their_own_context)
        if not self.pool.enable_prefix_caching:
            assert hit == 0

    # ---- rules

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data(), tail=tokens, prefill=st.booleans())
    def new_sequence(self, data, tail, prefill):
        prompt = []
        sources = self.history + [s.token_ids for s in self.live]
        if sources and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(sources))
            prompt = list(base[:data.draw(st.integers(0, len(base)))])
        prompt = (prompt + tail)[:MAX_LEN] or [0]
        seq = Sequence(prompt, SamplingParams())
        self._admit(seq)
        self.live.append(seq)
        if prefill:  # the whole prompt in one step, committed: what most admissions look like
            self._compute(seq, seq.num_uncomputed_tokens, commit=True)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, 8), token=st.integers(0, 2), commit=st.booleans())
    def step(self, i, n, token, commit):
        """One scheduler step for a sequence: a prefill chunk, or a decode of a freshly sampled token."""
        seq = self._pick(i)
        if seq.num_uncomputed_tokens == 0:
            if len(seq) >= MAX_LEN:
                return
            seq.token_ids.append(token)
        self._compute(seq, min(n, seq.num_uncomputed_tokens), commit)

    def _compute(self, seq: Sequence, n: int, commit: bool) -> None:
        """allocate_slots + what the model runner does (copy CoW blocks, write KV) + optional commit."""
        B, start = self.B, seq.num_computed_tokens
        fits = self.kv.can_append(seq, n)
        before = self._snapshot(seq)
        slots_before = (seq.state_slot, seq.snapshot_slot)
        try:
            copies = self.kv.allocate_slots(seq, n)
        except NoFreeBlocksError:
            assert not fits
            assert self._snapshot(seq) == before
            return
        assert fits
        for src, dst in copies:
            assert self.pool.blocks[dst].ref_cnt == 1 and self.pool.blocks[src].ref_cnt >= 1
            for j in range(B):
                if src * B + j in self.kv_data:
                    self.kv_data[dst * B + j] = self.kv_data[src * B + j]
        for p, slot in zip(range(start, start + n), self.kv.slot_mapping(seq, start, start + n)):
            block = self.pool.blocks[slot // B]
            assert block.ref_cnt == 1 and block.block_hash is None, block  # only private blocks are written
            self.kv_data[slot] = tuple(seq.token_ids[:p + 1])
        if self.pool.num_state_slots:
            self._compute_state(seq, n, slots_before)
        seq.num_computed_tokens += n
        if commit:
            self.kv.commit(seq)
        self._handed_out(seq, self.kv.keep_interval_snapshot)
        self.kv.state_copied(seq)  # the step has run

    def _compute_state(self, seq: Sequence, n: int, slots_before: tuple[int, int]) -> None:
        """What the runner and the layers do with `seq`'s recurrent state in a step computing its next n tokens:
        copy a matched snapshot in, resume from the state (its own context's), keep a snapshot where told."""
        start, data = seq.num_computed_tokens, self.state_data
        for slot, before in zip((seq.state_slot, seq.snapshot_slot), slots_before):
            if slot != before:  # just handed out: nothing of this sequence's in it yet
                data[slot] = GARBAGE
        position = self.kv.snapshot_at(seq, n)
        if seq.state_restore >= 0:  # before the forward
            data[seq.state_slot] = data[seq.state_restore]
        if start:  # (a sequence starting at position 0 clears its slot)
            assert data[seq.state_slot] == tuple(seq.token_ids[:start]), f"{seq} resumes from another state"
        data[seq.state_slot] = tuple(seq.token_ids[:start + n])
        if position:
            data[seq.snapshot_slot] = tuple(seq.token_ids[:position])

    def _handed_out(self, seq: Sequence, call) -> None:
        """call(seq); a state or snapshot slot it gives `seq` holds garbage until written."""
        before = (seq.state_slot, seq.snapshot_slot)
        call(seq)
        for slot, old in zip((seq.state_slot, seq.snapshot_slot), before):
            if slot >= 0 and slot != old:
                self.state_data[slot] = GARBAGE

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def commit(self, i):
        self.kv.commit(self._pick(i))

    @precondition(lambda self: self.live and len(self.live) < MAX_LIVE)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self._pick(i)
        if self.pool.num_state_slots and (parent.state_slot < 0 or parent.state_restore >= 0):
            return  # the engine forks a sequence right after a step computed it: its state is its own
        child = Sequence(list(parent.token_ids), SamplingParams())
        copies = self.kv.fork(parent, child)
        assert child.block_table == parent.block_table
        if self.pool.num_state_slots:  # the runner copies the state at once; the child's snapshot slot is fresh
            assert copies == [(parent.state_slot, child.state_slot)] and child.state_restore < 0
            self.state_data[child.state_slot] = self.state_data[parent.state_slot]
            if child.snapshot_slot >= 0:
                self.state_data[child.snapshot_slot] = GARBAGE
        else:
            assert copies == []
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq = self._pick(i)
        self.kv.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        self.live.remove(seq)
        self.history = (self.history + [list(seq.token_ids)])[-8:]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), tail=tokens, prefill=st.booleans())
    def next_turn(self, i, tail, prefill):
        """A conversation's next turn: a sequence finishes and a prompt continuing all its tokens arrives (where a
        hybrid resumes from the snapshot its last turn left)."""
        seq = self._pick(i)
        self.free(i)
        prompt = (seq.token_ids + tail)[:MAX_LEN]
        if len(prompt) < MAX_LEN:
            prompt.append(tail[0] if tail else 0)
        turn = Sequence(prompt, SamplingParams())
        self._admit(turn)
        self.live.append(turn)
        if prefill:
            self._compute(turn, turn.num_uncomputed_tokens, commit=True)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def preempt_and_readmit(self, i):
        seq = self._pick(i)
        self.kv.free(seq)
        self._admit(seq)

    @rule(n=st.integers(1, 14))
    def eviction_pressure(self, n):
        """Someone takes blocks (evicting cached ones LRU) and gives them back."""
        n = min(n, self.pool.num_free)
        taken = [self.pool.allocate() for _ in range(n)]
        for block_id in taken:
            assert self.pool.blocks[block_id].block_hash is None
            self.pool.release(block_id)

    @precondition(lambda self: hasattr(self, "pool") and self.pool.num_state_slots)
    @rule(n=st.integers(0, 4))
    def state_slot_pressure(self, n):
        """Someone takes every free state slot and n more (evicting kept snapshots LRU), writes them and gives them
        back."""
        taken = []
        for _ in range(self.pool.num_free_state_slots + n):
            try:
                taken.append(self.pool.allocate_state_slot())
            except NoFreeBlocksError:
                break
            self.state_data[taken[-1]] = GARBAGE
        for slot in taken:
            self.pool.release_state_slot(slot)

    @rule(key=st.sampled_from(PIN_KEYS), data=st.data(), ttl=st.floats(0.5, 5.0))
    def pin(self, key, data, ttl):
        """A session's prefix is pinned (a live or finished sequence's tokens); an old pin under `key` is replaced."""
        sources = self.history + [s.token_ids for s in self.live]
        if not sources:
            return
        base = data.draw(st.sampled_from(sources))
        tokens = list(base if data.draw(st.booleans()) else base[:data.draw(st.integers(0, len(base)))])
        cached = self.kv.cached_prefix_blocks(tokens)
        B = self.B
        for i, block_id in enumerate(cached):  # the run is what a longer prompt's match_prefix would take
            assert self.pool.blocks[block_id].token_ids == tuple(tokens[i * B:(i + 1) * B])
        old = self.pins.pop(key, None)
        before = [b.pin_cnt for b in self.pool.blocks]
        if old is not None:
            for block_id in old[0]:
                before[block_id] -= 1
        # what the cap allows: the leading blocks while each is pinned already or a new one fits
        pinned = {b for ids, _, _ in self.pins.values() for b in ids}
        expected = 0
        for block_id in cached:
            if block_id not in pinned:
                if len(pinned) >= self.pool.max_pinned_blocks:
                    break
                pinned.add(block_id)
            expected += 1
        n = self.pool.pin(key, cached, self.now + ttl)
        assert n == expected
        if n:
            ids = tuple(cached[:n])
            self.pins[key] = (ids, tuple(self.pool.blocks[b].block_hash for b in ids), self.now + ttl)
            for block_id in ids:
                assert self.pool.blocks[block_id].pin_cnt == before[block_id] + 1
        else:
            assert key not in self.pool.pins()
        self._released(old)

    def _released(self, pin) -> None:
        """Blocks of a pin just released: each held by no other pin and no table is evictable (cached) again."""
        if pin is None:
            return
        held = {b for ids, _, _ in self.pins.values() for b in ids}
        for block_id in pin[0]:
            block = self.pool.blocks[block_id]
            if block_id not in held and block.ref_cnt == 0:
                assert block.pin_cnt == 0 and block_id in self.pool._cached, block

    @rule(key=st.sampled_from(PIN_KEYS))
    def unpin(self, key):
        pin = self.pins.pop(key, None)
        assert self.pool.unpin(key) == (pin is not None)
        assert not self.pool.unpin(key)  # released exactly once
        self._released(pin)

    @rule(dt=st.floats(0.0, 3.0))
    def clock_advances(self, dt):
        self.now += dt
        due = {key for key, (_, _, expires_at) in self.pins.items() if expires_at <= self.now}
        assert self.pool.expire_pins(self.now) == len(due)
        for key in due:
            self._released(self.pins.pop(key))
        assert set(self.pool.pins()) == set(self.pins)

    # ---- invariants

    @invariant()
    def pool_consistent(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        s = pool.stats()
        assert s["free"] + s["used"] + s["cached"] == pool.num_blocks
        assert pool.num_free == s["free"] + s["cached"]

    @invariant()
    def ref_cnt_equals_table_count(self):
        if not hasattr(self, "pool"):
            return
        holders = Counter(b for seq in self.live for b in seq.block_table)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), block

    @invariant()
    def pinned_blocks_are_never_evicted(self):
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pin_holders = Counter(b for ids, _, _ in self.pins.values() for b in ids)
        for key, (ids, hashes, expires_at) in self.pins.items():
            assert pool.pins()[key].block_ids == ids and pool.pins()[key].expires_at == expires_at
            for block_id, block_hash in zip(ids, hashes):
                assert pool.blocks[block_id].block_hash == block_hash, "a pinned block was evicted"
                assert block_id not in pool._cached and block_id not in pool._free
        for block in pool.blocks:
            assert block.pin_cnt == pin_holders.get(block.block_id, 0), block
        assert pool.stats()["pinned_blocks"] == len(pin_holders) <= pool.max_pinned_blocks
        assert pool.stats()["pins"] == len(self.pins)

    @invariant()
    def sequences_read_their_own_context(self):
        if not hasattr(self, "pool"):
            return
        B = self.B
        for seq in self.live:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // B)
            for p, slot in enumerate(self.kv.slot_mapping(seq, 0, seq.num_computed_tokens)):
                assert self.kv_data.get(slot) == tuple(seq.token_ids[:p + 1]), (seq, p)

    @invariant()
    def registered_blocks_hold_their_content(self):
        if not hasattr(self, "pool"):
            return
        B, pool = self.B, self.pool
        for block in pool.blocks:
            if block.block_hash is None:
                continue
            context = self.kv_data[block.block_id * B + B - 1]
            assert context[-B:] == block.token_ids
            chain = None
            for k in range(0, len(context), B):
                chain = pool.hash_block(chain, context[k:k + B])
            assert chain == block.block_hash

    @invariant()
    def partial_blocks_hold_their_content(self):
        """A cached partial block holds the KV of its token ids, after the context its parent hash names."""
        if not hasattr(self, "pool"):
            return
        B, pool = self.B, self.pool
        for block in pool.blocks:
            if block.partial_ids is None:
                continue
            n = len(block.partial_ids)
            context = self.kv_data[block.block_id * B + n - 1]
            assert context[-n:] == block.partial_ids and len(context) % B == n
            for j in range(n):
                assert self.kv_data[block.block_id * B + j] == context[:len(context) - n + j + 1]
            chain = None
            for k in range(0, len(context) - n, B):
                chain = pool.hash_block(chain, context[k:k + B])
            assert chain == block.partial_parent

    @invariant()
    def state_slot_holders_balance(self):
        """Each slot's holders are the live sequences' state and snapshot slots, the blocks its snapshot is kept
        with and the copies pending from it; a slot is free exactly when it has none (pool.check_invariants)."""
        if not hasattr(self, "pool") or not self.pool.num_state_slots:
            return
        holders = Counter(slot for seq in self.live for slot in (seq.state_slot, seq.snapshot_slot, seq.state_restore)
                          if slot >= 0)
        holders.update(b.snapshot for b in self.pool.blocks if b.snapshot is not None)
        for slot in range(self.pool.num_state_slots):
            assert self.pool.state_slot_refs(slot) == holders.get(slot, 0), slot

    @invariant()
    def states_are_their_contexts(self):
        """A pending copy's source still holds the state of the prefix matched; a sequence's own slot the state
        of its computed tokens; a snapshot (kept with a block, or a live sequence's) the state where it was taken."""
        if not hasattr(self, "pool") or not self.pool.num_state_slots:
            return
        B, data = self.B, self.state_data
        for seq in self.live:
            context = tuple(seq.token_ids[:seq.num_computed_tokens])
            if seq.state_restore >= 0:
                assert data[seq.state_restore] == context, f"the state {seq} starts from changed before its copy ran"
            elif seq.state_slot >= 0 and seq.num_computed_tokens:
                assert data[seq.state_slot] == context, seq
            if seq.snapshot_slot >= 0 and 0 < seq.snapshot_position <= seq.num_computed_tokens:
                assert data[seq.snapshot_slot] == tuple(seq.token_ids[:seq.snapshot_position]), seq
        for block in self.pool.blocks:
            if block.snapshot is not None:
                assert data[block.snapshot] == self.kv_data[block.block_id * B + B - 1], block

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for seq in list(self.live):
            self.kv.free(seq)
        for key in list(self.pins):
            assert self.pool.unpin(key)
        self.pool.check_invariants()
        s = self.pool.stats()
        assert s["used"] == 0 and s["shared"] == 0 and s["free"] + s["cached"] == self.pool.num_blocks
        assert self.pool.num_free_state_slots + s["state_snapshots"] == self.pool.num_state_slots


TestKVCacheStateful = KVCacheMachine.TestCase
TestKVCacheStateful.settings = settings(max_examples=200, stateful_step_count=50, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])

"""Stateful property test of the sliding-window pool (`KVCacheManager` with `WindowBlocks`): two block pools, the
main one holding every block of a sequence and the window one holding only the blocks the window of its next
position reads, under random admission (shared prefixes, partial blocks taken over), prefill chunks, decodes,
speculative verify steps (drafts written, some accepted, the rest trimmed), forks, preemption, frees, eviction
pressure on either pool and pins.

Shadow KV stores record, per slot of each pool, the token context whose KV was written there; copy-on-write pairs
(the main pool's, returned by `allocate_slots`, and the window pool's, queued on the sequence) copy it. Every live
sequence must read its own context: each computed position in the main pool, and each position the window of its
next position reads in the window pool; and its window table must have given back exactly the entries wholly before
that window (`window_released`), each still cached under its hash when it was registered. A prefix hit must hold
its prompt's context in both pools. Pinned window blocks keep their content.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tsterm.config import SamplingParams
from tsterm.engine.block_pool import BlockPool, NoFreeBlocksError
from tsterm.engine.kv_manager import KVCacheManager, WindowBlocks
from tsterm.engine.sequence import Sequence

MAX_LIVE = 5
MAX_LEN = 28
PIN_KEYS = ("a", "b")
tokens = st.lists(st.integers(0, 2), max_size=7)  # a tiny vocabulary: prefixes are shared often


class WindowPoolMachine(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), window=st.integers(1, 9), num_blocks=st.integers(3, 16),
                num_window=st.integers(2, 12), caching=st.sampled_from((True, True, True, False)))
    def setup(self, block_size, window, num_blocks, num_window, caching):
        self.B, self.W = block_size, window
        self.pool = BlockPool(num_blocks, block_size, fingerprint="m", enable_prefix_caching=caching,
                              max_pinned_blocks=num_blocks // 2)
        self.window = WindowBlocks(BlockPool(num_window, block_size, fingerprint="m", enable_prefix_caching=caching,
                                             max_pinned_blocks=num_window // 2), window)
        self.kv = KVCacheManager(self.pool, window=self.window)
        self.main_data: dict[int, tuple[int, ...]] = {}  # main slot -> the context whose KV was written there
        self.window_data: dict[int, tuple[int, ...]] = {}  # window slot -> the same for the window pool
        self.live: list[Sequence] = []
        self.history: list[list[int]] = []
        self.now = 0.0
        self.window_pins: dict[str, dict[int, tuple]] = {}  # key -> {window slot: its content when pinned}

    def _pick(self, i: int) -> Sequence:
        return self.live[i % len(self.live)]

    def _window_slot(self, seq: Sequence, p: int) -> int:
        return seq.window_table[p // self.B] * self.B + p % self.B

    def _reads_own_context(self, seq: Sequence) -> None:
        """Every computed position in the main pool, and every one the next position's window reads in the window
        pool, holds `seq`'s own context."""
        B, c = self.B, seq.num_computed_tokens
        for p in range(c):
            assert self.main_data.get(seq.block_table[p // B] * B + p % B) == tuple(seq.token_ids[:p + 1]), (seq, p)
        for p in range(max(0, c - self.W + 1), c):
            assert seq.window_table[p // B] != WindowBlocks.NULL, (seq, p)
            assert self.window_data.get(self._window_slot(seq, p)) == tuple(seq.token_ids[:p + 1]), (seq, p)

    def _admit(self, seq: Sequence) -> None:
        hits_before = self.window.hit_blocks
        hit = self.kv.match_prefix(seq)
        assert hit <= len(seq) - 1 and seq.num_computed_tokens == hit
        assert len(seq.window_table) == len(seq.block_table) == -(-hit // self.B)
        assert seq.window_released == self.window.first_needed(hit)
        assert self.window.hit_blocks - hits_before == len(seq.window_table) - seq.window_released
        if not self.pool.enable_prefix_caching:
            assert hit == 0
        self._reads_own_context(seq)

    def _compute(self, seq: Sequence, n: int, drafts: list[int] | None = None, accepted: int = 0) -> bool:
        """One step of `seq`: allocate_slots for its next n tokens (+ drafts), what the runner does (copy-on-write in
        both pools, write every new position's KV into both), then what the scheduler does after it (the tokens
        computed, committed; a verify's accepted drafts appended, committed, the rest trimmed)."""
        drafts = drafts or []
        B, start = self.B, seq.num_computed_tokens
        fits = self.kv.can_append(seq, n + len(drafts))
        before = (list(seq.block_table), list(seq.window_table), self.pool.num_free, self.window.pool.num_free)
        try:
            copies = self.kv.allocate_slots(seq, n + len(drafts))
        except NoFreeBlocksError:
            assert not fits  # all or nothing: neither pool changed
            assert before == (seq.block_table, seq.window_table, self.pool.num_free, self.window.pool.num_free)
            return False
        assert fits
        for pairs, data, pool in ((copies, self.main_data, self.pool),
                                  (seq.window_copies, self.window_data, self.window.pool)):
            for src, dst in pairs:
                assert pool.blocks[dst].ref_cnt == 1
                for j in range(B):
                    if src * B + j in data:
                        data[dst * B + j] = data[src * B + j]
        context = seq.token_ids[:start + n] + drafts
        for p in range(start, start + n + len(drafts)):
            main_block = self.pool.blocks[seq.block_table[p // B]]
            window_block = self.window.pool.blocks[seq.window_table[p // B]]
            for block in (main_block, window_block):  # only private blocks are written
                assert block.ref_cnt == 1 and block.block_hash is None and block.block_id is not None, block
            assert window_block.block_id != WindowBlocks.NULL
            self.main_data[main_block.block_id * B + p % B] = tuple(context[:p + 1])
            self.window_data[self._window_slot(seq, p)] = tuple(context[:p + 1])
        seq.num_computed_tokens += n
        self.kv.commit(seq)
        assert seq.window_copies == []  # the step ran them
        if drafts:
            seq.token_ids.extend(drafts[:accepted])
            seq.num_computed_tokens += accepted
            self.kv.commit(seq)
            self.kv.trim(seq)
        return True

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
        if prefill:
            self._compute(seq, seq.num_uncomputed_tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, 8), token=st.integers(0, 2))
    def step(self, i, n, token):
        """A prefill chunk, or a decode of a freshly sampled token."""
        seq = self._pick(i)
        if seq.num_uncomputed_tokens == 0:
            if len(seq) >= MAX_LEN:
                return
            seq.token_ids.append(token)
        self._compute(seq, min(n, seq.num_uncomputed_tokens))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=5), data=st.data())
    def verify(self, i, drafts, data):
        """A decoding sequence verifies drafts: every draft's KV is written, the first `accepted` are kept."""
        seq = self._pick(i)
        if seq.num_uncomputed_tokens != 1 or len(seq) + len(drafts) >= MAX_LEN:
            return
        accepted = data.draw(st.integers(0, len(drafts)))
        if self._compute(seq, 1, drafts, accepted):
            seq.token_ids.append(data.draw(st.integers(0, 2)))  # the target's own token, computed next step

    @precondition(lambda self: self.live and len(self.live) < MAX_LIVE)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self._pick(i)
        child = Sequence(list(parent.token_ids), SamplingParams())
        assert self.kv.fork(parent, child) == []
        assert child.block_table == parent.block_table and child.window_table == parent.window_table
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq = self._pick(i)
        self.kv.free(seq)
        assert seq.block_table == seq.window_table == [] and seq.window_released == 0
        self.live.remove(seq)
        self.history = (self.history + [list(seq.token_ids)])[-8:]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), tail=tokens, prefill=st.booleans())
    def next_turn(self, i, tail, prefill):
        """A conversation's next turn: its prompt continues every token of the last one (its partial block kept)."""
        seq = self._pick(i)
        self.free(i)
        prompt = (seq.token_ids + tail + [0])[:MAX_LEN]
        turn = Sequence(prompt, SamplingParams())
        self._admit(turn)
        self.live.append(turn)
        if prefill:
            self._compute(turn, turn.num_uncomputed_tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def preempt_and_readmit(self, i):
        seq = self._pick(i)
        self.kv.free(seq)
        self._admit(seq)

    @rule(n=st.integers(1, 14), window=st.booleans())
    def eviction_pressure(self, n, window):
        """Someone takes blocks of one pool (evicting cached ones LRU) and gives them back."""
        pool, data = (self.window.pool, self.window_data) if window else (self.pool, self.main_data)
        taken = [pool.allocate() for _ in range(min(n, pool.num_free))]
        for block_id in taken:
            assert pool.blocks[block_id].block_hash is None and block_id != (WindowBlocks.NULL if window else -1)
            for j in range(self.B):
                data[block_id * self.B + j] = ("overwritten",)
        for block_id in taken:
            pool.release(block_id)

    @rule(key=st.sampled_from(PIN_KEYS), data=st.data(), ttl=st.floats(0.5, 5.0))
    def pin(self, key, data, ttl):
        sources = self.history + [s.token_ids for s in self.live]
        if not sources:
            return
        ids = list(data.draw(st.sampled_from(sources)))
        self.kv.pin(key, ids, self.now + ttl)
        pin = self.window.pool.pins().get(key)
        self.window_pins.pop(key, None)
        if pin is not None:
            self.window_pins[key] = {b * self.B + j: self.window_data.get(b * self.B + j)
                                     for b in pin.block_ids for j in range(self.B)}

    @rule(key=st.sampled_from(PIN_KEYS))
    def unpin(self, key):
        self.kv.unpin(key)
        self.window_pins.pop(key, None)
        assert key not in self.window.pool.pins()

    @rule(dt=st.floats(0.0, 3.0))
    def clock_advances(self, dt):
        self.now += dt
        self.kv.expire_pins(self.now)
        for key in [k for k in self.window_pins if k not in self.window.pool.pins()]:
            del self.window_pins[key]

    # ---- invariants

    @invariant()
    def pools_consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        self.window.check(self.live)  # the window pool's own, and its ref counts against the window tables
        holders = Counter(b for seq in self.live for b in seq.block_table)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), block
        s = self.kv.stats()
        assert s["window_free"] + s["window_used"] + s["window_cached"] == s["window_blocks"]

    @invariant()
    def windows_hold_exactly_what_they_read(self):
        """Each live sequence has given back every window entry wholly before its next position's window and kept
        the others: at most ceil((W - 1) / B) + 1 entries, plus those its next token and a trimmed verify keep."""
        if not hasattr(self, "pool"):
            return
        B = self.B
        for seq in self.live:
            c = seq.num_computed_tokens
            assert seq.window_released == self.window.first_needed(c), seq
            assert len(seq.window_table) - seq.window_released <= -(-(self.W - 1) // B) + 2, seq
            self._reads_own_context(seq)

    @invariant()
    def pinned_window_blocks_keep_their_content(self):
        if not hasattr(self, "pool"):
            return
        for key, slots in self.window_pins.items():
            assert key in self.window.pool.pins()
            for slot, content in slots.items():
                assert self.window_data.get(slot) == content, (key, slot)


WindowPoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
TestWindowPool = WindowPoolMachine.TestCase

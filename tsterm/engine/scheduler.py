"""Continuous batching with chunked prefill: decodes first (never starved), then prefill chunks under a token budget.

The scheduler owns the sequences' lifecycle (waiting -> running -> finished, preemption, forks) and, through the KV
manager, their blocks, state slots and pins. The engine asks it for a batch (`schedule`), runs it, and hands the
result back (`update_from_output`); it never touches the queues or the pool itself.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from tsterm.config import EngineConfig
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.sequence import Sequence, SequenceStatus

# speculative decoding: (a decoding sequence, the most draft tokens it may carry) -> its draft ids ([]: none)
Proposer = Callable[[Sequence, int], list[int]]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic,
                 proposer: Proposer | None = None,
                 copy_states: Callable[[list[tuple[int, int]]], None] | None = None):
        """clock: seconds, for pin expiry (the engine's; tests pass a fake one). proposer: the draft tokens of a
        decoding sequence (speculative decoding; the engine's, which knows which requests may speculate); None:
        none. copy_states: the executor's state-slot copy (a hybrid's verify step may end on a block boundary, whose
        state its snapshot keeps: `accept_drafts`)."""
        self.proposer = proposer
        self.copy_states = copy_states
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0
        self.num_pins_dropped = 0  # pins released early because nothing else could run (see `schedule`)
        self.num_prefill_tokens = 0  # prompt tokens computed (not taken from the cache), over all steps

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """The next batch, after expiring pins. If pins hold blocks that the waiting requests need and nothing runs,
        nothing ever would (not before the pins expire): pins then yield to traffic, all of them."""
        self.kv.expire_pins(self.clock())
        batch = self._schedule()
        if batch is None and self.waiting and not self.running and self.kv.pins():
            self.num_pins_dropped += self.kv.drop_pins()
            batch = self._schedule()
        return batch

    def _schedule(self) -> ScheduledBatch | None:
        batch = ScheduledBatch([], [], [], [])
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions

        # decode (and unfinished prefill chunks of admitted sequences), oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            drafts = self._drafts(seq, budget)
            n += len(drafts)
            while not self.kv.can_append(seq, n):
                dropped = self.kv.yield_pins_to_tier()  # (with a disk tier, waiting sessions go there, not a victim)
                if dropped:
                    self.num_pins_dropped += dropped
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            self._add_to_batch(batch, seq, n, drafts)
            budget -= n
            i += 1

        # prefill: admit waiting sequences in arrival order while blocks, slots and budget allow (not in a step
        # that had to preempt: the pool is full, and re-admitting the victim at once would only thrash)
        preempted = self.num_preemptions > preemptions_before
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if len(self.running) + self._samples_of(seq) > self.max_num_seqs:
                break  # its n samples will all run: they wait for room together
            first_admission = seq.metrics.first_scheduled_time is None
            cached_before = seq.num_cached_tokens
            self.kv.match_prefix(seq)
            if not first_admission:  # a preempted request keeps its first admission's cache report
                seq.num_cached_tokens = cached_before
            n = min(seq.num_uncomputed_tokens, budget)
            if not preempted and not self.kv.can_append(seq, n):
                self.num_pins_dropped += self.kv.yield_pins_to_tier()  # (a disk tier's: see above)
            if preempted or not self.kv.can_append(seq, n):
                self.kv.free(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if first_admission:
                seq.metrics.first_scheduled_time = time.time()
                seq.metrics.num_cached_tokens = seq.num_cached_tokens
                self.kv.record_prefix_query(seq)
            self.running.append(seq)
            self._add_to_batch(batch, seq, n)
            budget -= n
        return batch if batch.seqs else None

    @staticmethod
    def _samples_of(seq: Sequence) -> int:
        """Sequences `seq` runs as: a prompt not yet sampled forks into its n samples (`Engine._fork_new_samples`)."""
        return seq.params.n if seq.num_output_tokens == 0 else 1

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The draft tokens a decoding `seq` verifies this step (up to `budget` - 1, and only while their KV slots
        fit the pool without preempting anyone: a speculation never costs another sequence its blocks)."""
        if self.proposer is None or budget < 2 or seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0:
            return []
        drafts = self.proposer(seq, budget - 1)
        if drafts and not self.kv.can_append(seq, 1 + len(drafts)):
            return []
        if drafts and self.kv.num_state_slots:  # a hybrid keeps the state after each draft in a slot of its own
            drafts = drafts[:len(self.kv.take_draft_state_slots(seq, len(drafts)))]
        return drafts

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int, drafts: list[int] | None = None) -> None:
        """`n` tokens of `seq` (its `drafts` last, whose KV slots it gets like any other token's)."""
        batch.cow_copies.extend(self.kv.allocate_slots(seq, n))
        if seq.state_restore >= 0:  # a hybrid's cached prefix: its state starts as a copy of the snapshot (held
            batch.state_copies.append((seq.state_restore, seq.state_slot))  # until the step ran: kv.state_copied)
        # (a verify step keeps no snapshot in the forward: its states past the last token are not verified yet; the
        # one at a block boundary that the accepted run reaches is kept by `accept_drafts`)
        batch.snapshots.append(0 if drafts else self.kv.snapshot_at(seq, n))
        batch.seqs.append(seq)
        batch.num_new.append(n)
        batch.drafts.append(drafts or [])
        batch.draft_slots.append(self.kv.draft_state_slots(seq) if drafts else [])
        batch.slot_mappings.append(self.kv.slot_mapping(seq, seq.num_computed_tokens, seq.num_computed_tokens + n))

    def update_from_output(self, batch: ScheduledBatch) -> int:
        """After `batch` ran: mark its tokens computed, register the blocks it filled for the prefix cache, keep the
        state snapshots it took, and release the state copies it consumed. Returns the prompt tokens it computed.
        (The tokens it sampled are appended by the engine, which owns sampling, detokenising and stop checks.) A
        verify step's drafts are not computed yet: only the tokens the engine accepts become so (`accept_drafts`)."""
        prefill_tokens = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            seq.num_computed_tokens += n - len(batch.draft_ids(i))
            self.kv.commit(seq)
            self.kv.keep_interval_snapshot(seq)
            self.kv.state_copied(seq)
            if seq.num_output_tokens == 0:
                prefill_tokens += n
        self.num_prefill_tokens += prefill_tokens
        return prefill_tokens

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After a verify step of `seq`, once the engine has appended the first `num_accepted` of its drafts (the
        target model agreed with them): their KV, written by that step, is the sequence's computed KV; the blocks
        they fill are registered for the prefix cache, and the blocks that held only rejected drafts are released
        (`KVCacheManager.trim`: the sequence is shortened, nothing copied). A hybrid's recurrent state becomes the
        one after its last accepted draft, in the slot that step kept it in (`KVCacheManager.accept_draft_states`:
        the rejected drafts' slots go back, nothing copied but, on a block boundary, its snapshot's state). Called
        before the step's last token, the target's own, is appended."""
        assert seq.num_computed_tokens + num_accepted == len(seq.token_ids), (seq, num_accepted)
        seq.num_computed_tokens += num_accepted
        self.kv.commit(seq)
        self.kv.trim(seq)
        copies = self.kv.accept_draft_states(seq, num_accepted)
        if copies:
            self.copy_states(copies)

    def fork(self, parent: Sequence, children: list[Sequence],
             copy_states: Callable[[list[tuple[int, int]]], None]) -> None:
        """`parent` has computed its prompt: `children` (its other samples) join it, sharing every KV block, and run
        from the next step on. A hybrid's children start from a copy of its state, made now through `copy_states`
        (the executor's): the parent may advance before they run. All or nothing: a failure leaves no block or slot
        held by a child and no child scheduled."""
        forked: list[Sequence] = []
        state_copies: list[tuple[int, int]] = []
        try:
            for child in children:
                forked.append(child)
                state_copies.extend(self.kv.fork(parent, child))
            if state_copies:
                copy_states(state_copies)
        except BaseException:
            for child in forked:
                self.kv.free(child, keep_partial=False)
            raise
        for child in children:
            child.status = parent.status
            self.running.append(child)

    def preempt(self, seqs: list[Sequence]) -> None:
        """Preempt running `seqs` (say, those of a failed step that must be computed again): they keep their order
        at the head of the queue."""
        for seq in reversed(seqs):
            self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free the blocks of `seq` and requeue it first; it recomputes later (mostly from the prefix cache)."""
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished, aborted or failed) and release its blocks; full blocks stay cached for reuse.
        A failed one ("error") keeps no partly filled block: its failed step may have left that block half copied."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq, keep_partial=reason != "error")
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()

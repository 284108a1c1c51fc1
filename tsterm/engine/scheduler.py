"""Continuous batching with chunked prefill: decodes first (never starved), then prefill chunks under a token budget."""
from __future__ import annotations

import time
from collections import deque

from tsterm.config import EngineConfig
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.batch import ScheduledBatch
from tsterm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        batch = ScheduledBatch([], [], [], [])
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions

        # decode (and unfinished prefill chunks of admitted sequences), oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            self._add_to_batch(batch, seq, n)
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

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.cow_copies.extend(self.kv.allocate_slots(seq, n))
        if seq.state_restore >= 0:  # a hybrid's cached prefix: its state starts as a copy of the snapshot (held
            batch.state_copies.append((seq.state_restore, seq.state_slot))  # until the step ran: kv.state_copied)
        batch.snapshots.append(self.kv.snapshot_at(seq, n))
        batch.seqs.append(seq)
        batch.num_new.append(n)
        batch.slot_mappings.append(self.kv.slot_mapping(seq, seq.num_computed_tokens, seq.num_computed_tokens + n))

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
        """Remove a sequence (finished or aborted) and release its blocks; full blocks stay cached for reuse."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.time()

"""What one engine step computes: the scheduler's output, the executor's input."""
from __future__ import annotations

from dataclasses import dataclass, field

from tsterm.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledBatch:
    """What one step computes: `num_new[i]` tokens of `seqs[i]`, starting at its `num_computed_tokens`.

    A decoding sequence may carry draft tokens (`drafts[i]`, speculative decoding): its `num_new[i]` is then its last
    token plus its drafts, fed after its `token_ids` (a verify step: an extend with logits at each of those
    positions), and it samples one row per position."""

    seqs: list[Sequence]
    num_new: list[int]
    slot_mappings: list[list[int]]
    cow_copies: list[tuple[int, int]]  # (src_block, dst_block) pairs to copy before the forward
    # hybrid models: (snapshot slot, state slot) pairs to copy before the forward (a cached prefix resumed), and per
    # sequence the position whose state the model keeps in its snapshot slot this step (0: none)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per sequence, the draft ids it verifies ([]: none)
    # hybrid models: per sequence, the state slots that keep the states after its drafts, one a draft ([]: none);
    # the state after its last token stays in its own slot (`KVCacheManager.draft_state_slots`)
    draft_slots: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def select(self, seqs: list[Sequence]) -> ScheduledBatch:
        """The part of this batch that computes `seqs` (in batch order), with the block and state copies it needs."""
        ids = {seq.seq_id for seq in seqs}
        keep = [i for i, seq in enumerate(self.seqs) if seq.seq_id in ids]
        blocks = {block for i in keep for block in self.seqs[i].block_table}
        slots = {self.seqs[i].state_slot for i in keep}
        return ScheduledBatch([self.seqs[i] for i in keep], [self.num_new[i] for i in keep],
                              [self.slot_mappings[i] for i in keep], [p for p in self.cow_copies if p[1] in blocks],
                              [p for p in self.state_copies if p[1] in slots],
                              [self.snapshots[i] for i in keep] if self.snapshots else [],
                              [self.drafts[i] for i in keep] if self.drafts else [],
                              [self.draft_slots[i] for i in keep] if self.draft_slots else [])

    def draft_ids(self, i: int) -> list[int]:
        return self.drafts[i] if self.drafts else []

    def drafts_by_seq(self) -> dict[int, list[int]]:
        """seq_id -> the draft ids it verifies, for the sequences that carry drafts ({} in a step without any)."""
        if not any(self.drafts):
            return {}
        return {seq.seq_id: drafts for seq, drafts in zip(self.seqs, self.drafts) if drafts}

    def input_ids(self, i: int) -> list[int]:
        """The token ids `seqs[i]` feeds this step: its uncomputed tokens (those the step reaches), then its drafts."""
        seq, n, drafts = self.seqs[i], self.num_new[i], self.draft_ids(i)
        start = seq.num_computed_tokens
        return seq.token_ids[start:start + n - len(drafts)] + drafts

    def sample_mask(self) -> list[bool]:
        """A sequence samples when this step computes up to its last token (prefill done, or a decode), its drafts
        after it included."""
        return [s.num_computed_tokens + n == len(s.token_ids) + len(self.draft_ids(i))
                for i, (s, n) in enumerate(zip(self.seqs, self.num_new))]

    def sample_rows(self) -> list[int]:
        """How many logits rows each sequence samples: 1 + its drafts when it samples, else 0."""
        return [1 + len(self.draft_ids(i)) if sample else 0 for i, sample in enumerate(self.sample_mask())]

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts))

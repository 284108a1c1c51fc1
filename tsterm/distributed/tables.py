"""Block tables as incremental updates: rank 0 sends each step only what changed; each worker keeps a mirror.

Every rank needs each row's block table (the blocks its context uses) to build the step's inputs. Sending every
table each step costs bytes in proportion to the context held; instead rank 0 remembers the table it last sent for
each sequence (`TableSender`) and sends, per row, `[row, keep, count, ids...]` only when the table changed: keep
the first `keep` ids of the mirrored table, then append `ids`. A decode step that crosses no block boundary sends
nothing for its tables; one that does sends its new block id (3 words of header). A new sequence (a new request,
a fork's child) sends its whole table once; a preempted one that comes back sends what differs from before. A
finished or preempted sequence is dropped from the mirrors at the next step (`freed`), so the mirrors hold the live
sequences only.

Sequence ids are unique among the engine's live sequences. An id that a new sequence takes over from a finished one
before the old record was dropped needs nothing special: the update is taken against what both sides hold under it.
"""
from __future__ import annotations

from tsterm.engine.sequence import Sequence, SequenceStatus


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class TableSender:
    """Rank 0: the block tables the workers hold, and the updates that bring them to a step's tables."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[Sequence, list[int]]] = {}  # seq_id -> (the sequence, its table as sent)

    def updates(self, seqs: list[Sequence], tables: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
        """(row sequence ids, flat updates, freed sequence ids) for a step over `seqs` whose rows use `tables`;
        records them as sent."""
        in_step = {seq.seq_id for seq in seqs}
        freed = [seq_id for seq_id, (seq, _) in self.sent.items()
                 if seq_id not in in_step and (seq.status != SequenceStatus.RUNNING or not seq.block_table)]
        for seq_id in freed:
            del self.sent[seq_id]
        updates: list[int] = []
        for row, (seq, table) in enumerate(zip(seqs, tables)):
            known = self.sent.get(seq.seq_id)
            old = known[1] if known is not None else []
            keep = _common_prefix(old, table)
            if keep != len(old) or keep != len(table):
                updates += [row, keep, len(table) - keep, *table[keep:]]
            self.sent[seq.seq_id] = (seq, table)
        return [seq.seq_id for seq in seqs], updates, freed

    def tables(self) -> dict[int, list[int]]:
        return {seq_id: list(table) for seq_id, (_, table) in self.sent.items()}


class TableMirror:
    """A worker: the block tables rank 0 sent, kept up to date by each step's updates."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def apply(self, seq_ids: list[int], updates: list[int], freed: list[int]) -> list[list[int]]:
        """Apply a step's changes; the step's rows' tables."""
        for seq_id in freed:
            del self.tables[seq_id]
        i = 0
        while i < len(updates):
            row, keep, count = updates[i:i + 3]
            table = self.tables.setdefault(seq_ids[row], [])
            del table[keep:]
            table.extend(updates[i + 3:i + 3 + count])
            i += 3 + count
        return [self.tables.setdefault(seq_id, []) for seq_id in seq_ids]

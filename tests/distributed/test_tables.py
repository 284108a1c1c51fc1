"""The control group's wire format and the incremental block tables, without processes: a step's payload round-trips
through the integer packing, and a worker's mirror, fed only each step's changes, holds exactly the tables rank 0's
steps use through appends, a preemption and its return on other blocks, a fork, finished sequences and a reused id."""
from __future__ import annotations

from tsterm.config import SamplingParams
from tsterm.distributed import protocol
from tsterm.distributed.tables import TableMirror, TableSender
from tsterm.engine.sequence import Sequence, SequenceStatus
from tsterm.engine.step_inputs import HostStep


def test_a_step_round_trips_through_the_packing():
    step = HostStep(input_ids=[5, 6, 7], positions=[0, 1, 9], slot_mapping=[0, 1, 41], query_start_loc=[0, 2, 3],
                    seq_lens=[2, 10], block_tables=[[0], [3, 8, 10]], sample_rows=[1, 2], state_slots=[-1, -1],
                    snapshot_slots=[0, 2], snapshot_positions=[0, 8], state_copies=[(4, 2), (5, 3)])
    words = protocol.step_payload(step, [11, 12], [0, 0, 1, 0], [7, 9])
    got, seq_ids, updates, freed = protocol.parse_step(words)
    step.block_tables = []  # not carried: the mirror rebuilds them
    assert got == step and (seq_ids, updates, freed) == ([11, 12], [0, 0, 1, 0], [7, 9])
    assert protocol.unpack(protocol.pack([], [1], [2, 3])) == [[], [1], [2, 3]]


def seq(seq_id: int) -> Sequence:
    s = Sequence([1, 2, 3], SamplingParams(), seq_id=seq_id)
    s.status = SequenceStatus.RUNNING
    return s


class Ranks:
    """Rank 0's sender and one worker's mirror, joined by what a STEP carries."""

    def __init__(self):
        self.sender, self.mirror, self.words = TableSender(), TableMirror(), []

    def step(self, rows: list[tuple[Sequence, list[int]]]) -> None:
        seqs = [s for s, _ in rows]
        for s, table in rows:
            s.block_table = list(table)
        tables = [list(table) for _, table in rows]
        ids, updates, freed = self.sender.updates(seqs, tables)
        self.words.append(len(updates) + len(freed))
        assert self.mirror.apply(ids, updates, freed) == tables  # the worker's rows are rank 0's
        assert self.mirror.tables == self.sender.tables()


def test_the_mirror_follows_appends_preemption_forks_and_frees():
    ranks = Ranks()
    a, b = seq(1), seq(2)
    ranks.step([(a, [4, 5]), (b, [6])])  # two new sequences: their whole tables
    ranks.step([(a, [4, 5]), (b, [6])])  # a decode inside the last blocks: nothing to send
    assert ranks.words[-1] == 0
    ranks.step([(a, [4, 5, 9]), (b, [6])])  # a crosses a block boundary: one id appended
    assert ranks.words[-1] == 4
    child = seq(3)  # b forks: the child shares b's full blocks, its partial last block copied on write
    ranks.step([(b, [6, 7]), (child, [6, 12])])
    b.status, b.block_table = SequenceStatus.WAITING, []  # b preempted: dropped from the mirrors next step
    ranks.step([(a, [4, 5, 9]), (child, [6, 12])])
    assert 2 not in ranks.mirror.tables
    b.status = SequenceStatus.RUNNING  # b back, its prefix found in the cache, the rest on other blocks
    ranks.step([(a, [4, 5, 9]), (b, [6, 13, 14]), (child, [6, 12])])
    ranks.step([(a, [4, 5, 9]), (b, [6, 13]), (child, [6, 12])])  # b's table cut short (recompute from there)
    a.status = SequenceStatus.FINISHED
    reused = seq(1)  # a finished, and its id comes back at once on a new sequence: a table of its own
    ranks.step([(reused, [20]), (b, [6, 13]), (child, [6, 12, 2])])
    ranks.step([(b, [6, 13])])
    assert sorted(ranks.mirror.tables) == [1, 2, 3]  # running sequences that skipped a step keep their tables
    ranks.step([(b, [6, 13, 21]), (reused, [20, 22])])
    assert ranks.mirror.tables == {1: [20, 22], 2: [6, 13, 21], 3: [6, 12, 2]}
    child.status = SequenceStatus.FINISHED
    ranks.step([(b, [6, 13, 21])])
    assert sorted(ranks.mirror.tables) == [1, 2]  # the finished child dropped from both sides

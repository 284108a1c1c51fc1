"""`mtp`: drafts from the checkpoint's multi-token-prediction head (`tsterm.model.mtp`), run after every step.

The head needs the target model's final hidden state at the position before each of its rows, which only the step
that computed that position has: the executor keeps the step's hidden states (`ModelRunner.hidden_states`, [T, H], the
batch's rows in order) and the engine hands the step to `after_step` (the source declares `wants_hidden`). For each
sequence of the step that is still running, with s its first position this step and c its computed tokens after it
(a verify step counts its last token and the drafts it accepted; the rows of rejected drafts are not read):

1. catch-up: one row per position s..c, token t_p with the target's hidden state at p - 1 (this step's rows; for s,
   the last one kept from the sequence's previous step, `_carry`): the head's KV of every position the target just
   computed, and at c (its newest token, not computed by the target yet) the head's first draft d1;
2. chain: d2..dK, one row per step at positions c + 1, ..., each its previous draft fed with the head's own hidden
   state.

All sequences of a step share each forward (the catch-up's rows as one extend batch, then K - 1 one-row steps). The
head's KV of drafted positions (c + 1 on) is overwritten by the next catch-up before anything reads it; where such a
position is past the sequence's blocks it is written to the executor's scratch blocks (ids from `num_blocks` on,
`mtp_scratch_per_seq` per sequence of the call), never to another sequence's. A sequence whose previous hidden state
is not known (its first step after a prefix-cache hit, a fork or a preemption) builds that one entry from a zero
hidden state, as position 0 is built: only the drafts' quality depends on it. Drafts are the head's argmax; the
verify step keeps what the target agrees with, so the output never depends on them.
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Tokens
from typing import TYPE_CHECKING

import torch

from tsterm.engine.spec_decode.base import DraftSource
from tsterm.engine.step_inputs import HostStep

if TYPE_CHECKING:
    from tsterm.engine.batch import ScheduledBatch
    from tsterm.engine.model_runner import ModelRunner


class MtpSource(DraftSource):
    name = "mtp"
    wants_hidden = True  # the engine calls `after_step` with each step it ran whole

    def __init__(self, num_tokens: int):
        super().__init__(num_tokens)
        # seq_id -> how many drafts are worth chaining for it (the engine sets it from its measured draft length)
        self.chain_length: Callable[[int], int] | None = None
        self._carry: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (position p, the target's hidden at p)
        self._drafts: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (tokens they follow, draft ids)
        self._accepted: dict[int, int] = {}  # seq_id -> drafts accepted by this step's verify (`observe`)

    def propose(self, seq_id: int, token_ids: Tokens[int], max_tokens: int) -> list[int]:
        entry = self._drafts.get(seq_id)
        if entry is None or entry[0] != len(token_ids):  # (made for other tokens: a stale draft drafts nothing)
            return []
        return entry[1][:min(max_tokens, self.num_tokens)]

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        self._accepted[seq_id] = num_accepted

    def release(self, seq_id: int, token_ids: Tokens[int], num_prompt_tokens: int) -> None:
        self._carry.pop(seq_id, None)
        self._drafts.pop(seq_id, None)
        self._accepted.pop(seq_id, None)

    def forget_step(self, batch: ScheduledBatch) -> None:
        """`batch` did not run whole (a failure was isolated): what this source kept for its sequences is dropped (no
        hidden state of theirs is known; their next step starts as after a prefix-cache hit)."""
        for seq in batch.seqs:
            self.release(seq.seq_id, (), 0)

    def after_step(self, batch: ScheduledBatch, executor: ModelRunner) -> None:
        """Catch the head's KV up over what `batch` computed and draft the next tokens of its decoding sequences."""
        hidden = executor.hidden_states  # [T, H]: the batch's rows in order
        B, K = executor.block_size, self.num_tokens
        scratch, per_seq = executor.num_blocks, executor.mtp_scratch_per_seq
        step = HostStep()
        prev: list[tuple[int, int]] = []  # per row: (source, row) of its hidden state: 0 this step's, 1 carried, 2 zero
        carried: list[torch.Tensor] = []
        drafting = []  # (seq, its MTP block table, its newest position c)
        keep_rows, keep = [], []  # this step's row of each sequence's last computed position, to carry
        offset = 0
        accepted, self._accepted = self._accepted, {}
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
            first_row, offset = offset, offset + n
            drafts = batch.draft_ids(i)
            self._drafts.pop(seq.seq_id, None)
            if seq.is_finished:
                continue
            valid = n - len(drafts) + (accepted.get(seq.seq_id, 0) if drafts else 0)
            c = seq.num_computed_tokens
            s = c - valid
            if valid <= 0 or c >= len(seq.token_ids):
                continue
            need = (c + K - 1) // B + 1  # blocks up to position c + K - 1, the chain's last
            table = seq.block_table[:need]
            if len(table) < need:  # drafted positions past its blocks: its scratch blocks
                base = scratch + len(keep) * per_seq
                table = table + list(range(base, base + need - len(table)))
            carry = self._carry.get(seq.seq_id)
            for p in range(s, c + 1):  # one-token rows, each over the context up to it (see `_row`)
                _row(step, seq.token_ids[p], p, table, B)
                if p > s:
                    prev.append((0, first_row + p - 1 - s))
                elif carry is not None and carry[0] == p - 1:
                    prev.append((1, len(carried)))
                    carried.append(carry[1])
                else:
                    prev.append((2, 0))
            keep_rows.append(first_row + c - 1 - s)
            keep.append((seq.seq_id, c - 1))
            decoding = seq.num_output_tokens > 0 and c == len(seq.token_ids) - 1
            # (a chain reaches position c + K - 1: within the context, where there is room for a draft at all)
            if decoding and seq.params.max_tokens - seq.num_output_tokens > 1 and c + K <= executor.max_model_len:
                step.sample_rows.append(len(step.input_ids) - 1)
                drafting.append((seq, table, c))
        if not keep:
            return
        if keep_rows:  # each sequence's newest target hidden state, for its next step's first row
            rows = hidden.index_select(0, torch.tensor(keep_rows, device=hidden.device))
            for (seq_id, position), row in zip(keep, rows):
                self._carry[seq_id] = (position, row)
        sources = [hidden, torch.stack(carried) if carried else hidden[:0], hidden.new_zeros((1, hidden.shape[1]))]
        starts = [0, hidden.shape[0], hidden.shape[0] + len(carried)]
        index = torch.tensor([starts[src] + row for src, row in prev], device=hidden.device)
        prev_hidden = torch.cat(sources).index_select(0, index)  # [T', H]
        out, logits = executor.mtp_forward(step, prev_hidden)
        if not drafting:
            return
        tokens = logits.argmax(dim=-1)  # [S]
        drafts = [[t] for t in tokens.tolist()]
        # how far each chain is worth going (`chain_length`: the engine's measured draft length; the first draft,
        # which the catch-up made anyway, is always kept: its acceptance is scored even when it is not verified)
        lengths = [K if self.chain_length is None else max(1, min(K, self.chain_length(seq.seq_id)))
                   for seq, _, _ in drafting]
        active = list(range(len(drafting)))
        for j in range(1, K):  # chained: the head's own hidden state and draft, one position further
            still = [n for n, i in enumerate(active) if lengths[i] > j]
            if not still:
                break
            if len(still) < len(active):
                out = out.index_select(0, torch.tensor(still, device=out.device))
                active = [active[n] for n in still]
            step = HostStep()
            for i in active:
                seq, table, c = drafting[i]
                _row(step, drafts[i][-1], c + j, table, B)
                step.sample_rows.append(len(step.input_ids) - 1)
            out, logits = executor.mtp_forward(step, out)
            for i, token in zip(active, logits.argmax(dim=-1).tolist()):
                drafts[i].append(token)
        for (seq, _, _), draft in zip(drafting, drafts):
            self._drafts[seq.seq_id] = (len(seq.token_ids), draft)


def _row(step: HostStep, token: int, position: int, table: list[int], block_size: int) -> None:
    """One row of the head's step: `token` at `position`, attending to the context up to it over `table`. Every row is
    a one-token "sequence" of its own (the rows of one sequence share its table; all rows' KV is stored before any row
    attends, as in every step), which is a decode step's shape: the layer's one-call kernel form runs it where there
    is one (`MtpHead.stack`), for catch-up and chain alike."""
    step.input_ids.append(token)
    step.positions.append(position)
    step.slot_mapping.append(table[position // block_size] * block_size + position % block_size)
    step.query_start_loc.append(len(step.input_ids))
    step.seq_lens.append(position + 1)
    step.block_tables.append(table[:position // block_size + 1])
    step.state_slots.append(-1)

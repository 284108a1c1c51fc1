"""A sequence: one stream of tokens with its block table, owned by the scheduler."""
from __future__ import annotations

import enum
import time

from tsterm.config import SamplingParams
from tsterm.outputs import RequestMetrics

class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt + generated) and the KV blocks that hold them.

    Invariants: `num_computed_tokens <= len(token_ids)`; the KV of tokens `[0, num_computed_tokens)` lives
    in `block_table` (block i holds positions `[i*B, (i+1)*B)`); only the KV manager edits `block_table`.
    """

    def __init__(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 arrival_time: float | None = None, seq_id: int | None = None):
        """seq_id: unique among the engine's live sequences (the engine numbers them); default: `id(self)`, unique
        among live objects, for sequences made outside an engine."""
        self.seq_id = id(self) if seq_id is None else seq_id
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        # A model with a sliding-window pool (`tsterm.engine.kv_manager.WindowBlocks`; only the KV manager edits these):
        # the sliding layers' blocks, entry i for the positions of block_table[i]; the leading `window_released`
        # entries, wholly before the window of the next position, hold `WindowBlocks.NULL` (their block went back to
        # the window pool); `window_copies`: copy-on-write pairs of window blocks that its next step copies first
        self.window_table: list[int] = []
        self.window_released = 0
        self.window_copies: list[tuple[int, int]] = []
        self.state_slot = -1  # its slot in the model's recurrent-state pools (-1: the model keeps no state)
        # Hybrid models with prefix caching (only the KV manager sets these): the slot where the model keeps its
        # state at `snapshot_position` (its last block boundary scheduled), and the snapshot its cached prefix
        # resumes from, copied into `state_slot` before its first step's forward (-1: none). While set, the pool
        # holds that slot for the copy (`KVCacheManager.state_copied` lets go once the step has run)
        self.snapshot_slot = -1
        self.snapshot_position = 0
        self.state_restore = -1
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at (first) admission
        self.finish_reason: str | None = None
        self.logprobs: list[dict] = []  # one per generated token when params.logprobs is set
        # its blocks' hash chain starts from this salt's root (Request.create sets it; None: the model's root), so it
        # shares cached blocks only with sequences of the same salt
        self.cache_salt: str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time(), num_prompt_tokens=len(token_ids))

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, len={len(self)}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, status={self.status.value})")

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

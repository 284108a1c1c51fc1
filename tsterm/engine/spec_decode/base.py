"""The interface every draft source implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class DraftSource(ABC):
    """Proposes draft tokens for decoding sequences, keyed by the engine's sequence id.

    A sequence's token ids only grow between calls (prompt, then each step's accepted tokens): a source indexes what
    was appended since its last call for that sequence. A source holds no state outside its instance (two engines in
    one process have their own)."""

    name = ""

    def __init__(self, num_tokens: int):
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_tokens!r}")
        self.num_tokens = num_tokens

    @abstractmethod
    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """At most min(max_tokens, num_tokens) draft ids to follow `token_ids` ([] : none this step)."""

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        """The target model accepted `num_accepted` of the `num_drafted` tokens last proposed for `seq_id`."""

    def release(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """`seq_id` is gone (finished, aborted, failed): drop what is kept for it."""

"""Prompt lookup: the last n tokens matched in the sequence's own tokens, longest n first."""
from __future__ import annotations

from collections.abc import Sequence

from tsterm.engine.spec_decode.base import DraftSource


class _NgramIndex:
    """For each n in [min_n, max_n]: n-gram -> the end (exclusive) of its most recent occurrence, over the ends
    [n, indexed]. Extended as the sequence grows: O(max_n - min_n + 1) dictionary writes per token."""

    __slots__ = ("tables", "indexed")

    def __init__(self, ns: range):
        self.tables = {n: {} for n in ns}
        self.indexed = 0  # every end <= indexed is in the tables

    def extend(self, token_ids: Sequence[int], upto: int) -> None:
        for end in range(self.indexed + 1, upto + 1):
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(token_ids[end - n:end])] = end
        self.indexed = max(self.indexed, upto)


class NgramSource(DraftSource):
    """Drafts the tokens that followed the most recent earlier occurrence of the sequence's last n tokens (n from
    `max_n` down to `min_n`), `num_tokens` of them (or fewer where the sequence ends). No adaptation: the baseline."""

    name = "ngram"

    def __init__(self, num_tokens: int, min_n: int = 2, max_n: int = 4):
        super().__init__(num_tokens)
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.ns = range(max_n, min_n - 1, -1)
        self._index: dict[int, _NgramIndex] = {}

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        length = len(token_ids)
        index = self._index.get(seq_id)
        if index is None or index.indexed >= length:
            index = self._index[seq_id] = _NgramIndex(self.ns)
        # ends up to length - 1 only: the match must end before the sequence's own last n tokens do
        index.extend(token_ids, length - 1)
        k = min(max_tokens, self.num_tokens)
        if k <= 0:
            return []
        for n in self.ns:
            if length < n:
                continue
            end = index.tables[n].get(tuple(token_ids[length - n:length]))
            if end is not None:
                return list(token_ids[end:min(end + k, length)])
        return []

    def release(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._index.pop(seq_id, None)

"""Suffix drafts (after SuffixDecoding, Oliaro et al., NeurIPS 2025): model-free, longest match first, adaptive.

Two kinds of index, both suffix automata (`SuffixAutomaton`: built online, O(1) amortised per appended token):
- one per live sequence over its own tokens (prompt and output). The longest suffix of the sequence that occurred
  before in it is the automaton's suffix link of its last state, read in O(1) after each extension;
- a global one over recent outputs of all sequences: at most `max_outputs` finished outputs (each its last
  `max_output_tokens` tokens), least recently used dropped first (an output is used when a draft from it is taken).
  Each live sequence keeps a matcher per global output (state, match length), advanced with its new tokens;
  a matcher made after the sequence started walks only its last `window` tokens.

The draft comes from the longest match (the sequence's own on a tie): the tokens after that match's earliest
occurrence. Its length is min(num_tokens, the match length x 2 x the sequence's running acceptance rate), and a
match shorter than the sequence's threshold drafts nothing; the threshold starts at `min_match`, doubles after each
draft of which nothing was accepted (up to `max_min_match`) and comes back to `min_match` on an accepted one, so text
that does not repeat stops drafting.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tsterm.engine.spec_decode.base import DraftSource


class SuffixAutomaton:
    """The suffix automaton of a token string, extended one token at a time.

    State 0 is the root (the empty string). For each state: its transitions, suffix link, the length of its longest
    string, and `end`: the index of the last token of that string's first occurrence."""

    __slots__ = ("next", "link", "length", "end", "last", "tokens")

    def __init__(self, token_ids: Sequence[int] = ()):
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.end = [-1]
        self.last = 0
        self.tokens: list[int] = []
        for token in token_ids:
            self.extend(token)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, token: int) -> None:
        nxt, link, length, end = self.next, self.link, self.length, self.end
        position = len(self.tokens)
        self.tokens.append(token)
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        end.append(position)
        p = self.last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                end.append(end[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def repeat(self) -> tuple[int, int]:
        """(n, e): the longest suffix of the string that also occurs earlier has n tokens, and one earlier
        occurrence ends at index e (< the last index); (0, -1) when none does."""
        state = self.link[self.last]
        if state <= 0:
            return 0, -1
        return self.length[state], self.end[state]

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Advance a matcher (state, match length) of another string by its next token: the new state and the length
        of the longest suffix of that string (so far) that occurs in this one."""
        nxt, link, length = self.next, self.link, self.length
        while state and token not in nxt[state]:
            state = link[state]
            matched = length[state]
        if token in nxt[state]:
            return nxt[state][token], matched + 1
        return 0, 0


class _Output:
    """A finished output kept in the global index."""

    __slots__ = ("key", "automaton")

    def __init__(self, key: int, token_ids: Sequence[int]):
        self.key = key
        self.automaton = SuffixAutomaton(token_ids)


class _Live:
    """What the source keeps for one live sequence."""

    __slots__ = ("automaton", "matchers", "rate", "min_match", "source")

    def __init__(self, min_match: int):
        self.automaton = SuffixAutomaton()
        self.matchers: dict[int, list[int]] = {}  # global output key -> [state, match length]
        self.rate = 0.5  # running acceptance rate (accepted / drafted, exponentially averaged)
        self.min_match = min_match  # the shortest match that drafts now
        self.source: int | None = None  # the global output the last draft came from (None: the sequence's own)


class SuffixSource(DraftSource):
    name = "suffix"

    def __init__(self, num_tokens: int, min_match: int = 2, max_min_match: int = 32, max_outputs: int = 64,
                 max_output_tokens: int = 4096, window: int = 64, rate_weight: float = 0.25):
        super().__init__(num_tokens)
        self.min_match, self.max_min_match = min_match, max_min_match
        self.max_outputs, self.max_output_tokens, self.window = max_outputs, max_output_tokens, window
        self.rate_weight = rate_weight
        self._live: dict[int, _Live] = {}
        self._outputs: OrderedDict[int, _Output] = OrderedDict()  # least recently used first
        self._next_key = 0

    # ---- the interface

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        live = self._live.get(seq_id)
        if live is None or len(live.automaton) > len(token_ids):
            live = self._live[seq_id] = _Live(self.min_match)
        self._advance(live, token_ids)
        live.source = None
        k = min(max_tokens, self.num_tokens)
        if k <= 0:
            return []
        best, best_end, best_tokens = live.automaton.repeat() + (live.automaton.tokens,)
        for key, (state, matched) in live.matchers.items():
            if matched > best:
                output = self._outputs[key].automaton
                end = output.end[state]
                if end + 1 < len(output):  # (the match must have a continuation)
                    best, best_end, best_tokens, live.source = matched, end, output.tokens, key
        if best < live.min_match:
            live.source = None
            return []
        k = min(k, max(1, int(best * 2 * live.rate)))
        draft = best_tokens[best_end + 1:best_end + 1 + k]
        if live.source is not None:
            self._outputs.move_to_end(live.source)
        return list(draft)

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        live = self._live.get(seq_id)
        if live is None or num_drafted <= 0:
            return
        w = self.rate_weight
        live.rate = (1 - w) * live.rate + w * (num_accepted / num_drafted)
        live.min_match = self.min_match if num_accepted else min(2 * live.min_match, self.max_min_match)

    def release(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._live.pop(seq_id, None)
        output = token_ids[max(num_prompt_tokens, len(token_ids) - self.max_output_tokens):]
        if len(output) < 2:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self._outputs[key] = _Output(key, output)
        while len(self._outputs) > self.max_outputs:
            old, _ = self._outputs.popitem(last=False)
            for live in self._live.values():
                live.matchers.pop(old, None)

    # ---- incremental indexing

    def _advance(self, live: _Live, token_ids: Sequence[int]) -> None:
        """Index the tokens appended since the last call: the sequence's own automaton, and each global output's
        matcher (a new output's matcher starts from the last `window` tokens)."""
        automaton = live.automaton
        start = len(automaton)
        new = token_ids[start:]
        for token in new:
            automaton.extend(token)
        for key, output in self._outputs.items():
            matcher = live.matchers.get(key)
            if matcher is None:
                matcher = live.matchers[key] = [0, 0]
                walk = token_ids[max(0, len(token_ids) - self.window):]
            else:
                walk = new
            state, matched = matcher
            step = output.automaton.step
            for token in walk:
                state, matched = step(state, matched, token)
            matcher[0], matcher[1] = state, matched

    def stats(self) -> dict[str, int]:
        return {"live": len(self._live), "outputs": len(self._outputs)}

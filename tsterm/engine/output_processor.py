"""Output processor: one sample's generated ids -> streamed text (detokenisation, stop strings, deltas).

Its work per step is O(new tokens), whatever the context or output length:
- the text grows by appending each delta (`AppendOnlyText`), never by re-joining or copying what came before;
- a stop string is searched for only where a new one could begin: the last `longest stop - 1` characters already
  searched plus the new delta;
- `delta_text` comes from the short tail not yet streamed, and the full `token_ids` / `text` / `logprobs` of each
  streamed output are `Snapshot`s of the append-only sources, copied only if the caller reads them.
"""
from __future__ import annotations

from collections.abc import Iterable

from tsterm.engine.sequence import Sequence
from tsterm.outputs import CompletionOutput, Snapshot
from tsterm.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop


class SampleOutput:
    """The streaming state of one sample (one sequence): its text, where a stop string cut it, what was streamed."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: Iterable[str] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.text = self.detokenizer.output  # append-only: the whole text, never copied here
        self.stops = [s for s in stop if s]
        # While the sample runs, this many trailing characters may still turn out to begin a stop string: they are
        # searched again next step and not streamed yet.
        self.hold = max(map(len, self.stops), default=1) - 1
        self.searched_tail = ""  # the last `hold` characters already searched for stop strings
        self.streamed = 0  # characters of text already streamed
        self.pending = ""  # text[streamed:], not streamed yet: at most `hold` + one step's delta
        self.text_end: int | None = None  # where a stop string cut the text
        self.stop_reason: str | int | None = None  # the stop string, or the stop token id, that ended the sample
        self.emitted_tokens = 0  # generated ids already streamed

    def add(self, token_id: int) -> str | None:
        """Detokenise one new id. Returns the stop string it completed, if any (the text is then cut before it)."""
        return self._append(self.detokenizer.add([token_id]))

    def flush(self) -> None:
        """The sample has finished: release text held back for an incomplete character."""
        self._append(self.detokenizer.flush())

    def _append(self, delta: str) -> str | None:
        if not delta or self.text_end is not None:
            return None
        self.pending += delta
        if not self.stops:
            return None
        window = self.searched_tail + delta
        self.searched_tail = window[max(0, len(window) - self.hold):]
        cut = find_stop(window, self.stops, len(window) - len(delta))
        if cut is None:
            return None
        self.stop_reason = next(s for s in self.stops if window.startswith(s, cut))
        self.text_end = len(self.text) - len(window) + cut
        return self.stop_reason

    def output(self, index: int, seq: Sequence) -> CompletionOutput:
        """This step's CompletionOutput: snapshots of the whole output so far, and the deltas since the last one."""
        finished = seq.is_finished
        end = len(self.text) if self.text_end is None else self.text_end
        visible = end if finished else max(self.streamed, end - self.hold)
        delta_text = self.pending[:visible - self.streamed]
        self.pending = "" if finished else self.pending[visible - self.streamed:]
        self.streamed = visible
        num_prompt, num_tokens = seq.num_prompt_tokens, len(seq.token_ids)
        delta_token_ids = seq.token_ids[num_prompt + self.emitted_tokens:]
        self.emitted_tokens = num_tokens - num_prompt
        logprobs = Snapshot(seq.logprobs, 0, len(seq.logprobs)) if seq.params.logprobs is not None else None
        return CompletionOutput(index, Snapshot(seq.token_ids, num_prompt, num_tokens), Snapshot(self.text, 0, visible),
                                finish_reason=seq.finish_reason, stop_reason=self.stop_reason if finished else None,
                                logprobs=logprobs, delta_text=delta_text, delta_token_ids=delta_token_ids)

"""What the engine hands back: one RequestOutput per request (with its RequestMetrics: timings and token counts), one
CompletionOutput per sample (n > 1).

A streamed output is a snapshot taken at one step. Its `token_ids`, `text` and `logprobs` cover everything generated
so far, so copying them every step would cost O(output) per step and O(output^2) per request. The engine therefore
hands them over as `Snapshot`s of its append-only lists and text, and a field is copied only when it is first read.
`delta_text` and `delta_token_ids` (what this step added) are always plain values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestMetrics:
    """Per-request timings (seconds since the epoch) and token counts."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def mean_itl(self) -> float | None:
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else None


class Snapshot:
    """`source[start:end]`, named now and copied on first read.

    Only valid over a source that is only ever appended to (a sequence's token ids and logprobs, a sample's
    `AppendOnlyText`): what `[start:end]` covers then never changes, whenever the read happens.
    """

    __slots__ = ("source", "start", "end")

    def __init__(self, source: Any, start: int, end: int):
        self.source, self.start, self.end = source, start, end

    def __len__(self) -> int:
        return self.end - self.start

    def read(self) -> Any:
        return self.source[self.start:self.end]


class _Field:
    """A CompletionOutput field that may hold a Snapshot: read (copied) on first access, then kept."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = getattr(obj, self.slot)
        if isinstance(value, Snapshot):
            value = value.read()
            setattr(obj, self.slot, value)
        return value

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, value)


class CompletionOutput:
    __slots__ = ("index", "_token_ids", "_text", "finish_reason", "stop_reason", "_logprobs", "delta_text",
                 "delta_token_ids")
    _FIELDS = ("index", "token_ids", "text", "finish_reason", "stop_reason", "logprobs", "delta_text",
               "delta_token_ids")

    token_ids: list[int] = _Field()  # every generated id so far
    text: str = _Field()  # its text (without a stop string that ended it)
    logprobs: list[dict] | None = _Field()  # one per generated token when SamplingParams.logprobs is set

    def __init__(self, index: int, token_ids: list[int] | Snapshot, text: str | Snapshot,
                 finish_reason: str | None = None, stop_reason: str | int | None = None,
                 logprobs: list[dict] | Snapshot | None = None, delta_text: str = "",
                 delta_token_ids: list[int] | None = None):
        self.index = index
        self.token_ids = token_ids
        self.text = text
        self.finish_reason = finish_reason  # "stop" (EOS, stop token or string), "length", "abort", "error"
        self.stop_reason = stop_reason  # the stop string or token id that ended it
        self.logprobs = logprobs
        self.delta_text = delta_text  # new text since the previous output of this request (streaming)
        self.delta_token_ids = [] if delta_token_ids is None else delta_token_ids

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self._FIELDS)

    def __repr__(self) -> str:
        return f"CompletionOutput({', '.join(f'{name}={getattr(self, name)!r}' for name in self._FIELDS)})"


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    finished: bool = False
    # why the request failed (a kernel, the sampler or the detokenizer raised on it; the engine served the others):
    # then every completion's finish_reason is "error"; None for a request that did not fail
    error: Exception | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample (n > 1)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tsterm.engine.sequence import RequestMetrics


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" (EOS, stop token or string), "length", "abort"
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[dict] | None = None
    delta_text: str = ""  # new text since the previous output of this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    finished: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

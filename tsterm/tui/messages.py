"""Everything the engine side tells the UI, as dataclass Messages. High-rate ones define `can_replace`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:
    from tsterm.chat.plan import PromptPlan
    from tsterm.outputs import RequestOutput
    from tsterm.server.state import RequestInfo
    from tsterm.chat.session import TurnStats
    from tsterm.tui.engine_host import EngineHost


@dataclass
class LoadProgress(Message):
    done: int
    total: int
    what: str

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgress)


@dataclass
class EngineReady(Message):
    host: EngineHost
    profile: str = ""  # the profile name or path that was asked for


@dataclass
class EngineFailed(Message):
    error: str
    profile: str = ""


@dataclass
class StatsUpdate(Message):
    """One poll of the engine counters (`Engine.stats()`, `Engine.expert_load()`) plus process/device memory."""

    stats: dict[str, Any]
    memory: dict[str, Any]
    polled_at: float = 0.0  # time.monotonic() of the poll
    experts: list[list[int]] = field(default_factory=list)  # tokens routed per expert, per MoE layer, since start
    ranks: list[dict[str, int]] | None = None  # a multi-rank engine: expert tokens and resident bytes per rank

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsUpdate)


@dataclass
class TurnProgress(Message):
    """The reply text so far (cumulative, so a newer one can replace an unhandled older one)."""

    session_id: str
    request_id: str
    text: str
    token_ids: list[int]  # the output's own list (the engine builds a fresh one per output): no copy here
    num_cached_tokens: int
    message: dict | None = None  # the assistant message the reply so far is (its chat format's reading)

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, TurnProgress) and message.request_id == self.request_id


@dataclass
class TurnFinished(Message):
    session_id: str
    request_id: str
    plan: PromptPlan
    text: str
    token_ids: list[int] = field(default_factory=list)
    stats: TurnStats | None = None
    error: str | None = None  # the turn failed: the session is left as before it
    message: dict | None = None  # the assistant message to record (None: one holding `text`)


# ---- the API server (tsterm.tui.api_server): one external request, from start to end


@dataclass
class ApiTurnStarted(Message):
    info: RequestInfo
    messages: list[dict]  # what the session shows for the request (tool calls written as the model writes them)
    started_at: float = 0.0  # time.time()


@dataclass
class ApiTurnProgress(Message):
    request_id: str
    text: str  # the first choice's reply so far (cumulative)
    generated_tokens: int
    num_cached_tokens: int

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ApiTurnProgress) and message.request_id == self.request_id


@dataclass
class ApiTurnFinished(Message):
    info: RequestInfo
    messages: list[dict]
    text: str  # the first choice's reply, raw (tool-call tags included)
    token_ids: list[int]
    output: RequestOutput | None  # the last output (None: the request ended before any)
    error: str | None = None  # why it was cut short (an engine error, the client leaving)


@dataclass
class ApiServerChanged(Message):
    """The workstation's server started (`server`, an ApiServer), stopped (None) or failed to start (`error`)."""

    server: Any = None
    error: str | None = None

"""What every route of the server shares, and what it tells an observer (the workstation) about each request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import llguidance

from tsterm.agent.harmony import chat_tokenizer
from tsterm.chat.history import PRESERVE, check_policy
from tsterm.config import SamplingParams
from tsterm.outputs import RequestOutput
from tsterm.server.conversations import ConversationStore
from tsterm.server.response_store import ResponseStore


@dataclass
class ServerLimits:
    max_body_bytes: int = 4 << 20  # a request body past this is a 413
    max_queued_requests: int = 256  # requests admitted but not finished; past it a 429
    max_n: int = 8  # choices per chat completion
    max_stop: int = 16  # stop strings per request (each is checked at every generated token)
    max_stop_chars: int = 256  # characters per stop string
    # API conversations kept for their next request (conversations.py): how many, and for how long after their
    # last request (0 keeps none: every request is rendered as sent)
    max_conversations: int = 64
    conversation_ttl_s: float = 3600.0
    # stored Responses API responses (`store`), for `previous_response_id`: how many, for how long (0 keeps none)
    max_stored_responses: int = 64
    response_ttl_s: float = 3600.0
    cors_origins: tuple[str, ...] = ()  # origins a browser may call from (CORS); "*" only with an API key
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted besides the loopback names and the bound host
    cache_isolation: str = "none"  # "per_key": prompts of different API keys never share cached blocks
    bound_host: str | None = None  # the address the server listens on: a Host header naming it is accepted too


@dataclass(frozen=True)
class RequestInfo:
    """One generation request as an observer sees it. `messages` are chat-template messages (tool calls with object
    arguments) for the chat and Anthropic routes; `prompt` is the raw text of a /v1/completions request (None when it
    came as token ids)."""

    request_id: str
    api: str  # "chat.completions" | "completions" | "messages"
    prompt_ids: list[int]
    n: int = 1
    messages: list[dict] | None = None
    prompt: str | None = None
    # the chat routes' history policy (tsterm/chat/history.py) applied to this request's prompt: "preserve" (the
    # stored conversation's exact ids + the new messages), "template" (the messages rendered as the template says),
    # None (a request that continues no stored conversation, rendered as sent; or not a chat request);
    # `history_fallback` says why a `preserve` request was planned as `template`
    history_policy: str | None = None
    history_fallback: str | None = None
    # what the chat template renders around the messages for this request (its tools, its own system block:
    # `history.render_context`), which a session keeping this request's ids records with them ("" where not a chat)
    history_context: str = ""
    # the engine's cache salt for this request (security.request_salt: its own `cache_salt`, and the API key's digest
    # under `cache_isolation: per_key`); None shares the cache with every unsalted prompt
    cache_salt: str | None = None


class RequestObserver(Protocol):
    """Told about every generation request, on the server's event loop: keep each call short and never block
    (post a message, append to a list). An observer that raises is logged; the request goes on."""

    def started(self, info: RequestInfo) -> None: ...

    def progress(self, info: RequestInfo, output: RequestOutput) -> None: ...

    def finished(self, info: RequestInfo, output: RequestOutput | None, error: str | None) -> None:
        """`output` is the last output seen (finished, or cut short); `error` says why it was cut short: an
        engine error, or the client leaving. Called once per `started`."""


@dataclass
class ServerState:
    """The engine behind the API and the served model's identity. `engine` is a tsterm AsyncEngine; `tokenizer`
    renders chat templates; `defaults` are the profile's sampling defaults a request's fields override."""

    engine: Any
    tokenizer: Any
    model_name: str
    max_model_len: int
    defaults: SamplingParams = field(default_factory=SamplingParams)
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    in_flight: int = 0  # admitted requests not yet finished (the queue bound counts these)
    observer: RequestObserver | None = None  # the workstation showing external conversations
    # the history policy of a request that continues a stored conversation and names none
    # (`chat_template_kwargs.thinking_history`)
    history_policy: str = PRESERVE
    conversations: ConversationStore | None = None  # made from `limits` when not given
    responses: ResponseStore | None = None  # stored Responses API responses, made from `limits` when not given

    _lltokenizer: Any = field(default=None, repr=False, compare=False)

    def special_token(self, token_id: int) -> bool:
        """Whether llguidance reads `token_id` as a special token (a grammar names it as a token, never as text).
        Its tokenizer is built from the model's tokenizer.json on the first tool-call grammar (a fraction of a
        second), once per server."""
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(self.tokenizer.to_json_str())
        return self._lltokenizer.is_special_token(token_id)

    def __post_init__(self) -> None:
        self.tokenizer = chat_tokenizer(self.tokenizer)  # a harmony model's prompts: rendered by tsterm.agent.harmony
        check_policy(self.history_policy)
        if self.conversations is None:
            self.conversations = ConversationStore(self.limits.max_conversations, self.limits.conversation_ttl_s)
        if self.responses is None:
            self.responses = ResponseStore(self.limits.max_stored_responses, self.limits.response_ttl_s)

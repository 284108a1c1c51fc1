"""The workstation's API server: `tsterm serve`'s app on the TUI's engine, on a thread, with an observer that turns
each request into messages for the chat screen (external conversations shown as live sessions).

Nothing here touches a widget: the observer runs on the server's event loop and only posts Messages (thread-safe).
"""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual.message import Message

from tsterm.agent.tool_calls import CLOSE_TAG, OPEN_TAG
from tsterm.errors import ConfigError
from tsterm.outputs import RequestOutput
from tsterm.server.state import RequestInfo
from tsterm.tui.messages import ApiTurnFinished, ApiTurnProgress, ApiTurnStarted

Post = Callable[[Message], Any]


@dataclass(frozen=True)
class ServeOptions:
    """Where the workstation's server binds (the profile's `server:` section, overridden by `--serve`'s flags)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"


class ApiObserver:
    """A RequestObserver posting ApiTurnStarted / ApiTurnProgress (at most every `interval` s per request) /
    ApiTurnFinished to `post` (the chat screen's post_message); nothing while `post` is None."""

    def __init__(self, post: Post | None = None, interval: float = 1 / 15):
        self.post, self.interval = post, interval
        self._posted: dict[str, float] = {}  # request id -> when its progress was last posted
        # the model's chat format (tsterm.chat.chat_format; set by ApiServer): each reply is shown as it reads it (a
        # harmony reply's analysis as thinking, its calls as tool blocks); None: the engine's text
        self.chat_format: Any = None
        self._readers: dict[str, Any] = {}  # request id -> the reader of its first choice
        self._lock = threading.Lock()

    def _send(self, message: Message) -> None:
        post = self.post
        if post is not None:
            post(message)

    def started(self, info: RequestInfo) -> None:
        with self._lock:
            self._posted[info.request_id] = 0.0
            if self.chat_format is not None:
                self._readers[info.request_id] = self.chat_format.reader()
        self._send(ApiTurnStarted(info, display_messages(info), time.time()))

    def progress(self, info: RequestInfo, output: RequestOutput) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._posted.get(info.request_id, 0.0) < self.interval:
                return
            self._posted[info.request_id] = now
        first = output.outputs[0]
        text = self._text(info, first, output.finished)
        self._send(ApiTurnProgress(info.request_id, text, len(first.token_ids), output.num_cached_tokens))

    def finished(self, info: RequestInfo, output: RequestOutput | None, error: str | None) -> None:
        first = output.outputs[0] if output is not None and output.outputs else None
        text = self._text(info, first, True) if first else ""
        with self._lock:
            self._posted.pop(info.request_id, None)
            self._readers.pop(info.request_id, None)
        self._send(ApiTurnFinished(info, display_messages(info), text,
                                   list(first.token_ids) if first else [], output, error))


    def _text(self, info: RequestInfo, first: Any, final: bool) -> str:
        """The reply so far as shown: the engine's text, or its chat format's reading with the calls as tool blocks."""
        with self._lock:
            reader = self._readers.get(info.request_id)
        if reader is None:
            return first.text
        reader.read(first, final)
        return reader.shown + _call_tags(reader.message())


def _call_tags(message: dict) -> str:
    """An assistant message's tool calls as the model-format tags the log shows as tool blocks."""
    text = ""
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):  # as the model wrote them (a harmony reply's): the object they spell
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
        text += f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"
    return text


def display_messages(info: RequestInfo) -> list[dict]:
    """What the session shows for the request: its messages as {role, content} (an assistant's tool calls written
    as the model writes them, so the log shows them as tool blocks), or a /v1/completions prompt as one message."""
    if info.messages is None:
        return [{"role": "user", "content": info.prompt if info.prompt is not None
                 else f"({len(info.prompt_ids)} prompt token ids)"}]
    shown = []
    for m in info.messages:
        content = (m.get("content") or "") + _call_tags(m)
        entry = {"role": m["role"], "content": content}
        if m.get("tool_call_id"):
            entry["tool_call_id"] = m["tool_call_id"]
        shown.append(entry)
    return shown


class ApiServer:
    """`tsterm serve`'s app on an engine host's AsyncEngine, served by uvicorn on a daemon thread."""

    def __init__(self, host: Any, options: ServeOptions, observer: ApiObserver):
        from tsterm.server.app import create_app
        from tsterm.server.serve import BackgroundServer, check_bind, server_limits
        from tsterm.server.state import ServerLimits, ServerState

        check_bind(options.host, options.api_key)
        free_port(options.host, options.port)
        self.options, self.observer = options, observer
        observer.chat_format = host.chat_format  # its replies shown as the chat sessions' are
        state = ServerState(engine=host.async_engine, tokenizer=host.tokenizer,
                            model_name=options.model_name or host.profile_name or host.model_name,
                            max_model_len=host.info.max_model_len, defaults=host.sampling,
                            api_key=options.api_key, observer=observer, history_policy=host.thinking_history,
                            limits=ServerLimits(**server_limits(host.server), bound_host=options.host))
        self.state, self.model_name = state, state.model_name
        # log_config None: uvicorn must not configure logging (its handlers would write over the screen)
        self.server = BackgroundServer(create_app(state), options.host, options.port, log_config=None,
                                       timeout_graceful_shutdown=3)

    def start(self) -> ApiServer:
        self.server.start()
        return self

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.server.port}/v1"

    def begin_stop(self) -> None:
        """Take no new connections and tell the screen nothing more; `stop` waits for the thread."""
        self.observer.post = None
        self.server.server.should_exit = True

    def stop(self) -> None:
        """Blocking (joins the server thread; streams still open get a few seconds): call it off the UI thread."""
        self.begin_stop()
        self.server.stop()


def free_port(host: str, port: int) -> None:
    """Fail with a clear error (not a uvicorn log line) when `host:port` cannot be bound; port 0 picks a free one."""
    if port == 0:
        return
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise ConfigError(f"the API server cannot listen on {host}:{port}: {e.strerror or e} (another server may "
                          "hold the port: pick another with --port or the profile's server.port)") from None

"""The engine side of the TUI: load it (profile or injected factory), stream turns, poll its counters.

Nothing here touches a widget: results leave as Messages through a `post` callable (`Screen.post_message`, which
is thread-safe). The engine runs in a process of its own (EngineCoreProcess, the profile's `engine_process: true`,
the default) or on AsyncEngine's thread in this one (an injected factory, `engine_process: false`); either way the
host sees the same client: its EngineInfo, its tokenizer, its streams. A turn is an asyncio consumer of its stream.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from textual.message import Message

from tsterm.agent.harmony import chat_format
from tsterm.chat.chat_format import ChatFormat
from tsterm.chat.history import PRESERVE, check_policy, request_stop_ids
from tsterm.chat.plan import PromptPlan
from tsterm.chat.store import default_data_dir
from tsterm.chat.session import TurnStats
from tsterm.config import SamplingParams
from tsterm.engine.async_engine import AsyncEngine
from tsterm.engine.engine import Engine
from tsterm.engine.info import EngineInfo
from tsterm.launch import load_llm, start_core_process, use_engine_process
from tsterm.profiles import AgentSettings, ServerSettings, UiOptions
from tsterm.tui.messages import StatsUpdate, TurnFinished, TurnProgress
from tsterm.tui.tool_support import renders_tools

ProgressFn = Callable[[int, int, str], None]
EngineFactory = Callable[..., Any]  # (progress) or () -> LLM | Engine | a ready client (AsyncEngine, EngineCoreProcess)
Post = Callable[[Message], Any]
# At most this often (seconds) a streaming reply is re-rendered. Per token, the UI thread's Markdown work holds the
# GIL often enough to halve the decode rate of a small model (measured: 25 -> 55 ms per token on SmolLM2, 2 cores).
PROGRESS_INTERVAL = 1 / 15


@dataclass
class EngineHost:
    # the engine's client: AsyncEngine (the engine in this process) or EngineCoreProcess (in its own); both have
    # generate / abort / pin / unpin / dashboard / stats_and_metrics / shutdown, `info` and `tokenizer`
    async_engine: Any
    sampling: SamplingParams
    system_prompt: str | None = None
    profile_name: str = ""
    ui: UiOptions = field(default_factory=UiOptions)
    agent: AgentSettings = field(default_factory=AgentSettings)  # the profile's `agent:` section
    server: ServerSettings = field(default_factory=ServerSettings)  # the profile's `server:` section
    # the profile's thinking_history (tsterm/chat/history.py): how chat and agent sessions plan a turn after the
    # first, `preserve` (the exact ids of earlier turns, reasoning included) or `template`
    thinking_history: str = PRESERVE
    # What agent sessions generate with: the engine's client, unless a test scripts the model's replies (a
    # stand-in with its generate / abort / pin / unpin and the same tokenizer).
    agent_backend: Any = field(init=False)

    def __post_init__(self) -> None:
        check_policy(self.thinking_history)
        self.agent_backend = self.async_engine
        self._stop_stats = threading.Event()
        self._stats_thread: threading.Thread | None = None

    @property
    def engine(self) -> Engine | None:
        """The Engine object when it runs in this process (tests look inside it), else None."""
        return getattr(self.async_engine, "engine", None)

    @property
    def info(self) -> EngineInfo:
        return self.async_engine.info

    @property
    def tokenizer(self):
        return self.async_engine.tokenizer

    @property
    def model_key(self) -> str:
        """Names the tokenizer that made a session's ids (ids from another model are meaningless)."""
        return str(Path(self.info.model).resolve())

    @property
    def model_name(self) -> str:
        return Path(self.info.model).name

    @property
    def device(self) -> str:
        """The device and dtype for the status bar and the dashboard: "cpu float32" for a configured dtype, with the
        gist of the reason where `dtype: auto` chose it ("cpu bfloat16 (auto: AMX-BF16 granted by the OS)")."""
        gist = auto_gist(self.info.dtype_reason)
        return f"{self.info.device} {self.info.dtype}" + (f" ({gist})" if gist else "")

    @property
    def dtype_line(self) -> str:
        """The dtype and its whole reason (the profile-switched notification)."""
        return self.info.dtype_line

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the model's chat template shows it the tools an agent session offers (see tool_support.py)."""
        return renders_tools(self.tokenizer)

    @cached_property
    def chat_format(self) -> ChatFormat:
        """How the model's chat turns are written and read (tsterm.chat.chat_format): its template, or harmony."""
        return chat_format(self.tokenizer)

    def render(self, messages: list[dict]) -> str:
        """The conversation as prompt text (the session plan tokenises only what is new in it)."""
        return self.chat_format.render(messages)

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end a chat reply generated with `sampling`: what `preserve` checks the kept ids end with."""
        return request_stop_ids(self.info.eos_token_ids, self.sampling)

    # ---- turns
    async def stream_turn(self, session_id: str, plan: PromptPlan, request_id: str, post: Post) -> None:
        """Stream one reply; always ends with a TurnFinished (cancellation = abort: the request is freed)."""
        last, error, aborted = None, None, False
        reader = self.chat_format.reader()  # the reply as shown (a harmony reply's analysis as thinking)
        posted = -math.inf  # the first progress always posts (time.monotonic() may count from a recent boot)
        try:
            async for out in self.async_engine.generate(plan.token_ids, self.sampling, request_id=request_id):
                last = out  # its text and ids are read (copied) only when posted: not once per token
                now = time.monotonic()
                if now - posted >= PROGRESS_INTERVAL:  # the final text comes with TurnFinished
                    posted = now
                    completion = out.outputs[0]
                    reader.read(completion, out.finished)
                    post(TurnProgress(session_id, request_id, reader.shown, completion.token_ids,
                                      out.num_cached_tokens, reader.message()))
        except asyncio.CancelledError:
            aborted = True
            self.async_engine.abort(request_id)  # also covers a cancel that landed before the stream began
        except Exception as e:  # noqa: BLE001 - a failed turn is reported, the session is left intact
            error = f"{type(e).__name__}: {e}"
        token_ids = last.outputs[0].token_ids if last is not None else []
        if last is not None:
            reader.read(last.outputs[0], True)
        text, message = reader.shown, reader.message() if last is not None else None
        stats = None
        if last is not None or aborted:
            m = last.metrics if last is not None else None
            stats = TurnStats.from_plan(plan, last.num_cached_tokens if last else 0, len(token_ids),
                                        ttft=m.ttft if m else None, mean_itl=m.mean_itl if m else None,
                                        finish_reason="abort" if aborted else last.finish_reason)
        post(TurnFinished(session_id, request_id, plan, text, list(token_ids), stats, error, message))

    # ---- counters
    def start_stats(self, post: Post, interval: float | None = None) -> None:
        """Poll the engine's counters, per-expert routing counts, ranks and memory on a daemon thread, in one call
        (`dashboard`): the engine answers between two steps, so decoding is not slowed."""
        if self._stats_thread is not None:
            return
        interval = self.ui.stats_interval if interval is None else interval

        def poll() -> None:
            while not self._stop_stats.wait(interval):
                try:
                    stats, experts, ranks, memory = self.async_engine.dashboard()
                except Exception:  # noqa: BLE001, S112 - a failed poll is skipped, the next one may work
                    continue
                if not self._stop_stats.is_set():
                    post(StatsUpdate(stats, memory, time.monotonic(), experts, ranks))

        self._stats_thread = threading.Thread(target=poll, name="tsterm-stats", daemon=True)
        self._stats_thread.start()

    def stop_stats(self, wait: bool = False) -> None:
        """Stop polling; with `wait`, return once the poller has ended (it posts nothing after that)."""
        self._stop_stats.set()
        if wait and self._stats_thread is not None and self._stats_thread is not threading.current_thread():
            self._stats_thread.join()

    def shutdown(self) -> None:
        """Stop polling and the engine's client: an engine core process ends with it, and so does an in-process
        engine its AsyncEngine owns (load_host's: a multi-rank engine's workers and their memory end now, not when
        the engine is garbage-collected); an engine handed to the host in an AsyncEngine of its own stays its
        owner's."""
        self.stop_stats()
        self.async_engine.shutdown()


def auto_gist(reason: str) -> str:
    """The first clause of a `dtype: auto` reason (tsterm.cpu: "auto: AMX-BF16 granted by the OS, bfloat16 linears on
    AMX tiles (CPU model)" -> "auto: AMX-BF16 granted by the OS"); "" for a configured dtype."""
    if not reason.startswith("auto"):
        return ""
    gist = reason.split(", ", 1)[0]
    return gist.split(" (", 1)[0].strip()


def load_host(profile_name_or_path: str, engine_factory: EngineFactory | None, progress: ProgressFn,
              status: Callable[[str], None] = lambda _: None, overrides: dict[str, Any] | None = None) -> EngineHost:
    """Blocking: run it on a thread. Raises TstermError (bad profile, missing weights) for the UI to show.
    `overrides`: engine options over the profile's (the command line's --tensor-parallel-size, ...)."""
    from tsterm.profiles import load_profile

    status(f"reading profile {profile_name_or_path}")
    profile = load_profile(profile_name_or_path)
    if engine_factory is None and use_engine_process(profile):
        # the core's output (warnings, a traceback) goes to a log file: this process's terminal is the TUI's screen
        client = start_core_process(profile, progress=progress, prepare=progress, status=status,
                                    log_path=str(default_data_dir().parent / "engine.log"), **(overrides or {}))
        try:
            client.tokenizer  # loaded here, on the loading thread, not on the UI thread's first render  # noqa: B018
        except BaseException:
            client.shutdown()  # no host will own it
            raise
    else:
        built = _on_own_thread(lambda: _build_engine(profile, engine_factory, progress, status, overrides or {}))
        client = built if hasattr(built, "info") else AsyncEngine(built, owns_engine=True)
    return EngineHost(client, profile.sampling_params(), profile.system_prompt, profile.name, profile.ui_options(),
                      profile.agent_settings(), profile.server_settings(), thinking_history=profile.thinking_history)


def _on_own_thread(fn: Callable[[], Any]) -> Any:
    """Run `fn` on a new thread that ends with it, and return its result (or raise its error) here.

    Loading runs torch's parallel ops, and the OpenMP thread pool that serves them belongs to the calling thread for
    as long as that thread lives. Called from a pooled worker thread (Textual's thread workers), the loader's pool
    would outlive the load next to the engine thread's own pool; with more pool threads than cores, OpenMP stops
    spin-waiting between parallel regions, and every op of a decode step pays a wake-up (measured on 2 cores:
    SmolLM2 decode in the TUI 19 -> 23+ tok/s once the loader's pool is gone)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=run, name="tsterm-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _build_engine(profile, engine_factory: EngineFactory | None, progress: ProgressFn,
                  status: Callable[[str], None], overrides: dict[str, Any]) -> Any:
    """The Engine to run in this process, or the engine client an injected factory made (used as it is)."""
    if engine_factory is not None:
        status("building the engine")
        wants_progress = bool(inspect.signature(engine_factory).parameters)
        built = engine_factory(progress) if wants_progress else engine_factory()
        if hasattr(built, "generate") and hasattr(built, "info"):  # a client: AsyncEngine, EngineCoreProcess
            return built
        engine = getattr(built, "engine", built)  # an LLM or a bare Engine
    else:
        engine = load_llm(profile, progress=progress, prepare=progress, status=status, **overrides).engine
    return engine

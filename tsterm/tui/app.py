"""TstermApp: load the engine on a worker thread behind a progress screen, then chat."""
from __future__ import annotations

from pathlib import Path

from textual import work
from textual.app import App
from textual.binding import Binding

from tsterm.errors import TstermError
from tsterm.tui.engine_host import EngineFactory, EngineHost, load_host
from tsterm.tui.messages import EngineFailed, EngineReady, LoadProgress
from tsterm.tui.screens.chat import ChatScreen
from tsterm.tui.screens.loading import LoadingScreen
from tsterm.tui.session import SessionStore


class TstermApp(App):
    TITLE = "tsterm"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, profile_name_or_path: str = "default", engine_factory: EngineFactory | None = None, *,
                 sessions_dir: str | Path | None = None):
        """`engine_factory(progress)` (or `()`) -> LLM | Engine replaces the profile's model (tests inject one);
        the profile still gives sampling defaults and the system prompt. `sessions_dir` overrides the data dir."""
        super().__init__()
        self.profile = profile_name_or_path
        self.engine_factory = engine_factory
        self.store = SessionStore(sessions_dir)
        self.host: EngineHost | None = None
        self.loading: LoadingScreen | None = None

    def on_mount(self) -> None:
        self.loading = LoadingScreen(self.profile)
        self.push_screen(self.loading)
        self.retry_load()

    def retry_load(self) -> None:
        self._load()

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self) -> None:
        loading = self.loading

        def progress(done: int, total: int, what: str) -> None:
            loading.post_message(LoadProgress(done, total, what))

        try:
            host = load_host(self.profile, self.engine_factory, progress,
                             status=lambda what: progress(0, 0, what))
        except Exception as e:  # noqa: BLE001 - shown on the loading screen; the app stays up
            user_error = isinstance(e, (TstermError, OSError))  # says what to fix; anything else is a bug
            self.post_message(EngineFailed(str(e) if user_error else f"{type(e).__name__}: {e}"))
            return
        self.post_message(EngineReady(host))

    def on_engine_ready(self, message: EngineReady) -> None:
        if self.host is not None:
            message.host.shutdown()
            return
        self.host = message.host
        self.switch_screen(ChatScreen(self.host, self.store))

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.loading.show_error(message.error)

    def on_unmount(self) -> None:
        if self.host is not None:
            self.host.shutdown()

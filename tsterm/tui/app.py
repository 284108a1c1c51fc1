"""TstermApp: load the engine on a worker thread behind a progress screen, then chat; `/profile` reloads it."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from textual import work
from textual.app import App
from textual.binding import Binding, BindingType

from tsterm.chat.store import SessionStore
from tsterm.errors import TstermError
from tsterm.tui.engine_host import EngineFactory, EngineHost, load_host
from tsterm.tui.messages import EngineFailed, EngineReady, LoadProgress
from tsterm.tui.screens.chat import ChatScreen
from tsterm.tui.screens.loading import LoadingScreen


class TstermApp(App):
    TITLE = "tsterm"
    # The palette's key is listed with the others (screens hide Textual's separate footer entry for it): at 80
    # columns every footer key then fits.
    BINDINGS: ClassVar[list[BindingType]] = [Binding("ctrl+p", "command_palette", "Palette", priority=True),
                                             Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, profile_name_or_path: str = "default", engine_factory: EngineFactory | None = None, *,
                 sessions_dir: str | Path | None = None, auto_approve: bool = False, workspace: str | None = None):
        """`engine_factory(progress)` (or `()`) -> LLM | Engine replaces the profile's model (tests inject one);
        the profile still gives sampling defaults and the system prompt. `sessions_dir` overrides the data dir.
        `auto_approve` (`--auto`) runs agent tools without asking; `workspace` replaces the profile's agent
        workspace."""
        super().__init__()
        self.agent_auto_approve, self.agent_workspace = auto_approve, workspace
        self.profile = profile_name_or_path
        self.engine_factory = engine_factory
        self.store = SessionStore(sessions_dir)
        self.host: EngineHost | None = None
        self.loading: LoadingScreen | None = None  # set while a load is in progress (or failed at start-up)
        self._select_after_switch: str | None = None

    def on_mount(self) -> None:
        self.loading = LoadingScreen(self.profile)
        self.push_screen(self.loading)
        self.retry_load()

    def retry_load(self) -> None:
        self._load(self.profile, self.engine_factory)

    def switch_profile(self, profile: str, current_id: str | None = None) -> None:
        """Load `profile` behind the progress screen while the current engine keeps running; on success the chat
        screen is rebuilt on the new engine (sessions come back from the store) and the old engine is shut down,
        on failure the error is a notification and nothing else changes."""
        if self.loading is not None:
            self.notify("a profile is already loading", severity="warning")
            return
        self._select_after_switch = current_id
        self.loading = LoadingScreen(profile)
        self.push_screen(self.loading)
        self._load(profile, None)  # an injected factory stood for the start-up profile's model only

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, profile: str, engine_factory: EngineFactory | None) -> None:
        loading = self.loading

        def progress(done: int, total: int, what: str) -> None:
            loading.post_message(LoadProgress(done, total, what))

        try:
            host = load_host(profile, engine_factory, progress, status=lambda what: progress(0, 0, what))
        except Exception as e:  # noqa: BLE001 - shown on the loading screen; the app stays up
            user_error = isinstance(e, (TstermError, OSError))  # says what to fix; anything else is a bug
            self.post_message(EngineFailed(str(e) if user_error else f"{type(e).__name__}: {e}", profile))
            return
        self.post_message(EngineReady(host, profile))

    async def on_engine_ready(self, message: EngineReady) -> None:
        if self.loading is None:  # nothing asked for it (a superseded load): do not leak its engine thread
            message.host.shutdown()
            return
        old, self.host, self.profile, self.loading = self.host, message.host, message.profile, None
        self.theme = self.host.ui.theme
        if old is None:
            await self.switch_screen(ChatScreen(self.host, self.store))
            return
        await self.pop_screen()  # the progress screen, back to the old chat screen: replace it
        self.engine_factory = None
        await self.switch_screen(ChatScreen(self.host, self.store, current_id=self._select_after_switch))
        self._shut_down_engine(old)
        self.notify(f"profile {self.host.profile_name}: {self.host.model_name} on {self.host.device}",
                    title="profile switched")

    @work(thread=True, group="shutdown", exit_on_error=False)
    def _shut_down_engine(self, host: EngineHost) -> None:
        host.shutdown()  # joins the engine thread: off the UI thread

    async def on_engine_failed(self, message: EngineFailed) -> None:
        if self.host is None:  # start-up: the progress screen shows the error and offers a retry
            self.loading.show_error(message.error)
            return
        self.loading = None
        await self.pop_screen()
        self.notify(message.error, title=f"profile {message.profile} not loaded", severity="error", timeout=20)

    def on_unmount(self) -> None:
        if self.host is not None:
            self.host.shutdown()

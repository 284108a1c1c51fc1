"""TstermApp: load the engine on a worker thread behind a progress screen, then chat; `/profile` reloads it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from textual import work
from textual.app import App
from textual.binding import Binding, BindingType

from tsterm.chat.store import SessionStore
from tsterm.errors import TstermError
from tsterm.tui.api_server import ApiObserver, ApiServer, ServeOptions
from tsterm.tui.engine_host import EngineFactory, EngineHost, load_host
from tsterm.tui.messages import ApiServerChanged, EngineFailed, EngineReady, LoadProgress
from tsterm.tui.screens.chat import ChatScreen
from tsterm.tui.screens.loading import LoadingScreen


class TstermApp(App):
    TITLE = "tsterm"
    # The palette's key is listed with the others (screens hide Textual's separate footer entry for it): at 80
    # columns every footer key then fits.
    BINDINGS: ClassVar[list[BindingType]] = [Binding("ctrl+p", "command_palette", "Palette", priority=True),
                                             Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, profile_name_or_path: str = "default", engine_factory: EngineFactory | None = None, *,
                 sessions_dir: str | Path | None = None, auto_approve: bool = False, workspace: str | None = None,
                 serve: dict[str, Any] | None = None, engine_options: dict[str, Any] | None = None):
        """`engine_factory(progress)` (or `()`) -> LLM | Engine replaces the profile's model (tests inject one);
        the profile still gives sampling defaults and the system prompt. `sessions_dir` overrides the data dir.
        `auto_approve` (`--auto`) runs agent tools without asking; `workspace` replaces the profile's agent
        workspace. `serve` (`--serve`): start the API server with the engine, its `host` / `port` / `api_key`
        replacing the profile's `server:` settings; None starts it only if the profile's `server.enabled`.
        `engine_options` (`--tensor-parallel-size`, ...) override the start-up profile's engine options."""
        super().__init__()
        self.engine_options = {k: v for k, v in (engine_options or {}).items() if v is not None}
        self.serve_overrides = serve
        self.api_server: ApiServer | None = None
        self.api_observer = ApiObserver()
        self._server_busy = False  # a start or stop is under way (on a thread)
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
        self._load(self.profile, self.engine_factory, self.engine_options)

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
        self._load(profile, None)  # an injected factory and the command line stood for the start-up profile only

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load(self, profile: str, engine_factory: EngineFactory | None,
              engine_options: dict[str, Any] | None = None) -> None:
        loading = self.loading

        def progress(done: int, total: int, what: str) -> None:
            loading.post_message(LoadProgress(done, total, what))

        try:
            host = load_host(profile, engine_factory, progress, status=lambda what: progress(0, 0, what),
                             overrides=engine_options)
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
            await self.switch_screen(self._chat_screen(self._new_chat_screen()))
            if self.serve_overrides is not None or self.host.server.enabled:
                self.start_api_server()
            return
        await self.pop_screen()  # the progress screen, back to the old chat screen: replace it
        self.engine_factory = None
        await self.switch_screen(self._chat_screen(self._new_chat_screen(self._select_after_switch)))
        if self.api_server is not None and not self._server_busy:  # serve the new engine on the same address
            old_server, self.api_server, self._server_busy = self.api_server, None, True
            self._run_server(old_server, self.serve_options(old_server.options.port), old)
        else:
            self._shut_down_engine(old)
        self.notify(f"profile {self.host.profile_name}: {self.host.model_name} on {self.host.info.device} "
                    f"{self.host.dtype_line}", title="profile switched")

    def _new_chat_screen(self, current_id: str | None = None) -> ChatScreen:
        return ChatScreen(self.host, self.store, current_id, agent_workspace=self.agent_workspace,
                          auto_approve=self.agent_auto_approve)

    def _chat_screen(self, screen: ChatScreen) -> ChatScreen:
        self.api_observer.post = screen.post_message  # API clients' requests show on this screen from now on
        return screen

    @work(thread=True, group="shutdown", exit_on_error=False)
    def _shut_down_engine(self, host: EngineHost) -> None:
        host.shutdown()  # joins the engine thread: off the UI thread

    # ---- the API server
    def serve_options(self, port: int | None = None) -> ServeOptions:
        """The profile's `server:` settings, `--serve`'s flags over them, then `port` (`/serve PORT`)."""
        from tsterm.server.serve import API_KEY_ENV

        settings, flags = self.host.server, self.serve_overrides or {}
        if port is None:
            port = flags["port"] if flags.get("port") is not None else settings.port
        return ServeOptions(host=flags.get("host") or settings.host, port=port,
                            api_key=flags.get("api_key") or os.environ.get(API_KEY_ENV) or None,
                            model_name=settings.model_name)

    def start_api_server(self, port: int | None = None) -> None:
        if self.host is None or self._server_busy:
            self.notify("the API server is starting or stopping: try again in a moment", severity="warning")
            return
        if self.api_server is not None:
            self.notify(f"the API server already runs at {self.api_server.url} (/serve stop stops it)")
            return
        self._server_busy = True
        self._run_server(None, self.serve_options(port), None)

    def stop_api_server(self) -> None:
        if self.api_server is None or self._server_busy:
            self.notify("the API server is not running" if self.api_server is None
                        else "the API server is starting or stopping: try again in a moment", severity="warning")
            return
        old, self.api_server, self._server_busy = self.api_server, None, True
        self._run_server(old, None, None)

    @work(thread=True, group="api-server", exit_on_error=False)
    def _run_server(self, old: ApiServer | None, options: ServeOptions | None, old_host: EngineHost | None) -> None:
        """Stop `old` (then shut down `old_host`, the engine it served), then start a server with `options` on the
        current engine; the outcome comes back as an ApiServerChanged."""
        if old is not None:
            old.stop()
        if old_host is not None:
            old_host.shutdown()
        if options is None:
            self.post_message(ApiServerChanged(None))
            return
        try:
            server = ApiServer(self.host, options, self.api_observer).start()
        except (TstermError, OSError, RuntimeError) as e:  # a refused bind, a port in use, uvicorn not starting
            self.post_message(ApiServerChanged(None, error=str(e)))
            return
        self.post_message(ApiServerChanged(server))

    def on_api_server_changed(self, message: ApiServerChanged) -> None:
        self._server_busy = False
        self.api_server = message.server
        if message.error is not None:
            self.notify(message.error, title="API server not started", severity="error", timeout=15)
        elif message.server is not None:
            self.notify(f"{message.server.url} serves {message.server.model_name} (OpenAI and Anthropic APIs)",
                        title="API server started")
        else:
            self.notify("the API server stopped")
        screen = next((s for s in self.screen_stack if isinstance(s, ChatScreen)), None)
        if screen is not None and screen.is_mounted:
            screen.refresh_sessions_count()
            screen.refresh_status()

    async def on_engine_failed(self, message: EngineFailed) -> None:
        if self.host is None:  # start-up: the progress screen shows the error and offers a retry
            self.loading.show_error(message.error)
            return
        self.loading = None
        await self.pop_screen()
        self.notify(message.error, title=f"profile {message.profile} not loaded", severity="error", timeout=20)

    async def action_quit(self) -> None:
        """Quitting a start-up that failed (no engine ever ran) exits non-zero, with the error on the terminal."""
        error = self.loading.error if self.host is None and self.loading is not None else None
        if error is not None:
            self.exit(return_code=1, message=f"tsterm: error: {error}")
        else:
            self.exit()

    def on_unmount(self) -> None:
        server, self.api_server = self.api_server, None
        if server is not None:
            server.begin_stop()  # no new requests; the engine's shutdown ends the open ones
        if self.host is not None:
            self.host.shutdown()
        if server is not None:
            server.stop()

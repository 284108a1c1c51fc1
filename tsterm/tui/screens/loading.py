"""Shown while the model loads on a worker thread: a progress bar, the current step, or what went wrong."""
from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, ProgressBar, Static

from tsterm.tui.messages import LoadProgress


class LoadingScreen(Screen):
    CSS_PATH = "loading.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("r", "retry", "Retry")]

    def __init__(self, profile: str):
        super().__init__()
        self.profile = profile
        self.error: str | None = None  # why the engine could not start (shown; the exit message if the user quits)

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Label("tsterm", id="loading-title")
            yield Label(f"profile: {self.profile}", id="loading-profile")
            yield ProgressBar(total=None, show_eta=False, id="loading-bar")
            yield Static("starting", id="loading-status", markup=False)
            yield Static("", id="loading-error", markup=False)
        yield Footer(show_command_palette=False)

    def on_load_progress(self, message: LoadProgress) -> None:
        bar = self.query_one(ProgressBar)
        if message.total > 0:
            bar.update(total=message.total, progress=message.done)
            self.query_one("#loading-status", Static).update(
                f"{message.what}  {message.done / 1e6:.1f} / {message.total / 1e6:.1f} MB")
        else:
            self.query_one("#loading-status", Static).update(message.what)

    def show_error(self, error: str) -> None:
        self.error = error
        self.query_one(ProgressBar).display = False
        self.query_one("#loading-status", Static).update("could not start the engine")
        self.query_one("#loading-error", Static).update(f"{error}\n\nFix the profile or model, then press r to retry "
                                                        "(ctrl+q quits).")
        self.add_class("-failed")
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return self.has_class("-failed") if action == "retry" else True

    def action_retry(self) -> None:
        self.reset()
        self.app.retry_load()

    def reset(self) -> None:
        self.error = None
        self.remove_class("-failed")
        self.query_one(ProgressBar).display = True
        self.query_one("#loading-error", Static).update("")
        self.refresh_bindings()

"""The message input: Enter sends, Up/Down walk the prompt history (kept in the data dir)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.widgets import Input

from tsterm.chat.store import atomic_write

MAX_HISTORY = 500


class PromptHistory:
    def __init__(self, path: Path | None = None):
        self.path = path
        self.entries: list[str] = []
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                self.entries = [e for e in loaded if isinstance(e, str)][-MAX_HISTORY:]
            except (OSError, ValueError, TypeError):
                self.entries = []  # a broken history file costs only the history

    def add(self, text: str) -> None:
        if not text.strip() or (self.entries and self.entries[-1] == text):
            return
        self.entries.append(text)
        del self.entries[:-MAX_HISTORY]
        if self.path is not None:
            try:
                atomic_write(self.path, json.dumps(self.entries, ensure_ascii=False))
            except OSError:
                pass


class PromptInput(Input):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "history(-1)", "Previous prompt", show=False),
        Binding("down", "history(1)", "Next prompt", show=False),
    ]

    def __init__(self, history: PromptHistory, **kwargs):
        super().__init__(**kwargs)
        self.history = history
        self._index: int | None = None  # position in history while browsing; None: editing a fresh draft
        self._draft = ""

    def remember(self, text: str) -> None:
        self.history.add(text)
        self._index = None

    def action_history(self, step: int) -> None:
        entries = self.history.entries
        if not entries:
            return
        if self._index is None:
            if step > 0:
                return
            self._draft, self._index = self.value, len(entries)
        self._index = max(0, self._index + step)
        if self._index >= len(entries):
            self._index, self.value = None, self._draft
        else:
            self.value = entries[self._index]
        self.cursor_position = len(self.value)

"""Small modal dialogs: ask for a line of text, confirm, or allow an agent's tool call. Each dismisses with its
answer (None: cancelled)."""
from __future__ import annotations

import json
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static


class TextPrompt(ModalScreen[str | None]):
    CSS_PATH = "dialogs.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, question: str, value: str = ""):
        super().__init__()
        self.question, self.value = question, value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            yield Input(self.value, id="dialog-input")
            yield Label("enter: ok · esc: cancel", classes="dialog-hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)


class Confirm(ModalScreen[bool]):
    CSS_PATH = "dialogs.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(False)", "Cancel"),
                                             Binding("y", "dismiss(True)", "Yes")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Yes", variant="error", id="yes")
                yield Button("No", id="no")
            yield Label("y: yes · esc: no", classes="dialog-hint")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ContextFull(ModalScreen[str | None]):
    """A message that does not fit the context: drop the oldest exchanges ("drop"), continue in a new chat carrying
    the last ones ("new"), or cancel (None; the message stays in the prompt). `choices` explains each option."""

    CSS_PATH = "dialogs.tcss"
    AUTO_FOCUS = "#drop"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss(None)", "Cancel"),
                                             Binding("d", "dismiss('drop')", "Drop oldest"),
                                             Binding("n", "dismiss('new')", "New chat")]

    def __init__(self, summary: str, drop: str, new: str):
        super().__init__()
        self.summary, self.drop, self.new = summary, drop, new

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog context-full"):
            yield Static(self.summary, classes="approve-title", markup=False)
            yield Static(self.drop, id="context-drop", classes="context-option", markup=False)
            yield Static(self.new, id="context-new", classes="context-option", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Drop oldest", variant="warning", id="drop")
                yield Button("New chat", variant="primary", id="new")
                yield Button("Cancel", id="cancel")
            yield Label("d: drop oldest · n: new chat · esc: cancel (your message stays in the prompt)",
                        classes="dialog-hint")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None if event.button.id == "cancel" else event.button.id)


class ApproveTool(ModalScreen[bool]):
    """An agent wants to run a tool that needs approval (writes, commands, MCP tools that may change things):
    the tool, its arguments and the directory it works in. Allow (y) or deny (n, esc); the focus starts on Deny."""

    CSS_PATH = "dialogs.tcss"
    AUTO_FOCUS = "#deny"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,n", "dismiss(False)", "Deny"),
                                             Binding("y", "dismiss(True)", "Allow")]

    def __init__(self, tool: str, arguments: dict[str, Any], cwd: str, description: str = "", session: str = ""):
        super().__init__()
        self.tool, self.arguments, self.cwd = tool, arguments, cwd
        self.description, self.session = description, session

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog approve"):
            where = f" ({self.session})" if self.session else ""
            yield Label(f"The agent{where} asks to run {self.tool}", classes="approve-title", markup=False)
            if self.description:
                yield Static(self.description.strip().splitlines()[0], classes="dialog-hint", markup=False)
            yield Static(json.dumps(self.arguments, ensure_ascii=False, indent=2), id="approve-args", markup=False)
            yield Static(f"in {self.cwd}", id="approve-cwd", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Allow", variant="success", id="allow")
                yield Button("Deny", variant="error", id="deny")
            yield Label("y: allow · n / esc: deny", classes="dialog-hint")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "allow")

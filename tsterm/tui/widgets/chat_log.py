"""The conversation: one MessageView per message; a ReplyView streams an assistant reply (with its thinking).

A message of the session (not a notice) carries its index in `Session.messages` and the number shown next to its
role; it can take the focus (shift+tab or ctrl+up from the prompt), then up/down walk the log and the screen's fork
and copy actions apply to it.
"""
from __future__ import annotations

import contextlib
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.widget import Widget
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from tsterm.chat.session import TurnStats
from tsterm.tui.thinking import split_thinking

ROLE_LABELS = {"user": "you", "assistant": "assistant", "system": "system", "notice": "tsterm", "error": "error"}


# The reasons history.py / Session.plan give for planning a `preserve` turn as `template`, in a few words (the first
# fragment found in the reason names it); any other reason is shown cut to SHORT_REASON characters.
SHORT_REASONS = (
    ("did not end with a stop token", "last reply cut short"),
    ("changed since they were recorded", "history edited"),
    ("does not know which messages", "ids without their messages"),
    ("another context", "tools or system block changed"),
    ("rejected the probe", "template rejected the probe"),
    ("do not end with an assistant reply", "no reply kept"),
    ("no new messages", "no new message"),
    ("does not render the reply's content", "template rewrites replies"),
    ("does not end the reply with", "template has no reply end"),
    ("after the first new message", "template has no reply end"),
    ("renders differently with the new messages", "history depends on the new messages"),
)
SHORT_REASON = 40


def short_reason(reason: str) -> str:
    """Why `preserve` fell back, in a few words (the session file and the log keep the whole reason)."""
    for fragment, short in SHORT_REASONS:
        if fragment in reason:
            return short
    return reason if len(reason) <= SHORT_REASON else reason[:SHORT_REASON - 1].rstrip() + "…"


def policy_summary(stats: TurnStats) -> str | None:
    """Which thinking-history policy planned the turn or agent step (`policy preserve`, `policy template`), and on
    a fallback why preserve could not apply; None for a turn recorded before policies (or an API request the server
    rendered as sent)."""
    if stats.fallback_reason:
        why = short_reason(stats.fallback_reason)
        return f"policy {stats.policy_applied or 'template'} (preserve fell back: {why})"
    return f"policy {stats.policy_applied}" if stats.policy_applied else None


def turn_summary(stats: TurnStats) -> str:
    """One line under a reply: what the turn prefilled, reused and generated."""
    parts = [f"prompt {stats.prompt_tokens}", f"cached {stats.cached_tokens}", f"new {stats.new_tokens}",
             f"gen {stats.generated_tokens}"]
    if stats.ttft is not None:
        parts.append(f"ttft {stats.ttft * 1e3:.0f} ms")
    if stats.mean_itl:
        parts.append(f"{1 / stats.mean_itl:.1f} tok/s")
    if stats.finish_reason and stats.finish_reason != "stop":
        parts.append(stats.finish_reason)
    policy = policy_summary(stats)
    if policy:
        parts.append(policy)
    if stats.miss:
        parts.append(f"less reuse: history rewritten from token {stats.diverged_at}")
    return " · ".join(parts)


def miss_notice(diverged_at: int | None, lost_tokens: int) -> str:
    """A template miss in plain words: what it costs and why (the dashboard keeps the exact position)."""
    lost = f"{lost_tokens} tokens the model had already read are" if lost_tokens > 0 else "part of it is"
    return (f"The chat template wrote the earlier conversation differently this time (from token {diverged_at} on), "
            f"so {lost} computed again instead of reused. The reply is not affected; it only costs time.")


def reply_note(stats: TurnStats | None) -> str | None:
    """What a reply's role label adds in parentheses: "aborted" for a reply stopped mid-way (esc, quitting)."""
    return "aborted" if stats is not None and stats.finish_reason == "abort" else None


def role_label(role: str, number: int | None, note: str | None = None) -> Content:
    return Content.assemble(ROLE_LABELS.get(role, role) + (f" ({note})" if note else ""),
                            (f"  #{number}" if number is not None else "", "not bold $foreground-muted"))


class Selectable(Vertical):
    """A message of the session, focusable once it has an index. Its keys (move, fork here, copy, back to the
    prompt) stay out of the footer, which keeps room for the screen's; /help and the README list them."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "step(-1)", "Previous message", show=False),
        Binding("down,j", "step(1)", "Next message", show=False),
        Binding("f", "screen.fork_session", "Fork here", show=False),
        Binding("c,y", "screen.copy_message", "Copy", show=False),
        Binding("enter,i", "screen.focus_prompt", "Back to prompt", show=False),
    ]

    def __init__(self, role: str, classes: str, index: int | None = None, number: int | None = None):
        super().__init__(classes=classes)
        self.role, self.index, self.number = role, index, number
        self.can_focus = index is not None

    def set_index(self, index: int, number: int | None) -> None:
        self.index, self.number, self.can_focus = index, number, True

    async def action_step(self, step: int) -> None:
        """Move the focus to the previous/next message; past the last one, back to the prompt."""
        views = [v for v in self.parent.query_children(Selectable) if v.can_focus] if self.parent else []
        at = views.index(self) + step if self in views else -1
        if at >= len(views):
            await self.screen.run_action("focus_prompt")
        elif at >= 0:
            views[at].focus()


class MessageView(Selectable):
    """A finished message: role label + Markdown. `role` also names the CSS class (-user, -assistant, ...)."""

    def __init__(self, role: str, text: str, footer: str = "", miss: bool = False, index: int | None = None,
                 number: int | None = None, collapse_thinking: bool = True, note: str | None = None):
        super().__init__(role, f"message -{role}", index, number)
        self.text, self.footer, self.miss, self.note = text, footer, miss, note
        self.collapse_thinking = collapse_thinking

    def compose(self) -> ComposeResult:
        yield Label(role_label(self.role, self.number, self.note), classes="role")
        if self.role == "assistant":
            split = split_thinking(self.text)
            if split.thinking:
                with Collapsible(title="thinking", collapsed=self.collapse_thinking, classes="thinking"):
                    yield Markdown(split.thinking)
            yield Markdown(split.answer or ("*(empty reply)*" if not split.thinking else ""), classes="answer")
        else:
            yield Markdown(self.text, classes="answer")
        if self.footer:
            yield Static(self.footer, classes="turn-stats -miss" if self.miss else "turn-stats", markup=False)


class ReplyView(Selectable):
    """An assistant reply while it streams. `show(text)` takes the whole text so far (messages may coalesce).
    It becomes selectable when it finishes and the screen gives it its index."""

    def __init__(self, collapse_thinking: bool = True) -> None:
        """`collapse_thinking`: fold the thinking block once the model has finished thinking."""
        super().__init__("assistant", "message -assistant -live")
        self.collapse_thinking = collapse_thinking
        self._written = {"thinking": "", "answer": ""}
        self._streams: dict[str, MarkdownStream] = {}
        self.num_updates = 0

    def compose(self) -> ComposeResult:
        yield Label("assistant ▍", classes="role")
        with Collapsible(title="thinking…", collapsed=False, classes="thinking"):
            yield Markdown(id="thinking-md")
        yield Markdown(classes="answer", id="answer-md")
        yield Static("", classes="turn-stats", markup=False)

    def on_mount(self) -> None:
        self.query_one(Collapsible).display = False

    @property
    def text(self) -> str:
        return self._written["answer"]

    async def show(self, text: str) -> None:
        if not self.is_attached:
            return
        self.num_updates += 1
        split = split_thinking(text)
        if split.thinking is not None:
            box = self.query_one(Collapsible)
            box.display = True
            if not split.thinking_open and box.title == "thinking…":
                box.title, box.collapsed = "thinking", self.collapse_thinking
            await self._put("thinking", split.thinking)
        await self._put("answer", split.answer)

    async def _put(self, part: str, new: str) -> None:
        markdown = self.query_one(f"#{part}-md", Markdown)
        old = self._written[part]
        self._written[part] = new
        if new.startswith(old):
            if new == old:  # nothing to add: a stream started now would be stopped before its task ever ran, and
                return  # stopping such a task raises CancelledError in the caller (an agent step of calls only)
            if part not in self._streams:
                self._streams[part] = Markdown.get_stream(markdown)
            await self._streams[part].write(new[len(old):])
            return
        # The split moved (a late `</think>`): re-render this part from scratch.
        if part in self._streams:
            await self._streams.pop(part).stop()
        await markdown.update(new)

    async def finish(self, footer: str, miss: bool = False, note: str | None = None, index: int | None = None,
                     number: int | None = None) -> None:
        if index is not None:
            self.set_index(index, number)
        if not self.is_attached:
            return
        for stream in self._streams.values():
            await stream.stop()
        self._streams.clear()
        self.remove_class("-live")
        self.query_one(".role", Label).update(role_label("assistant", self.number, note))
        stats = self.query_one(".turn-stats", Static)
        stats.update(footer)
        stats.set_class(miss, "-miss")

    async def on_unmount(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:  # removed mid-reply (session switch, quit): end the background appenders
            with contextlib.suppress(Exception):  # nothing is left to render into
                await stream.stop()


class ChatLog(VerticalScroll):
    """Scrolls with the stream (anchored to the bottom) until the user scrolls up."""

    can_focus = False

    async def show_messages(self, views: list[Widget]) -> None:
        await self.remove_children()
        if views:
            await self.mount_all(views)
        self.anchor()

    async def add(self, view: Widget) -> None:
        await self.query(".welcome").remove()
        await self.mount(view)
        self.anchor()

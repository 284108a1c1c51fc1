"""The conversation: one MessageView per message; a ReplyView streams an assistant reply (with its thinking)."""
from __future__ import annotations

import contextlib

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from tsterm.tui.session import TurnStats
from tsterm.tui.thinking import split_thinking

ROLE_LABELS = {"user": "you", "assistant": "assistant", "system": "system", "notice": "tsterm", "error": "error"}


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
    if stats.miss:
        parts.append(f"template miss at token {stats.diverged_at}")
    return " · ".join(parts)


class MessageView(Vertical):
    """A finished message: role label + Markdown. `role` also names the CSS class (-user, -assistant, ...)."""

    def __init__(self, role: str, text: str, footer: str = "", miss: bool = False):
        super().__init__(classes=f"message -{role}")
        self.role, self.text, self.footer, self.miss = role, text, footer, miss

    def compose(self) -> ComposeResult:
        yield Label(ROLE_LABELS.get(self.role, self.role), classes="role")
        if self.role == "assistant":
            split = split_thinking(self.text)
            if split.thinking:
                with Collapsible(title="thinking", collapsed=True, classes="thinking"):
                    yield Markdown(split.thinking)
            yield Markdown(split.answer or ("*(empty reply)*" if not split.thinking else ""), classes="answer")
        else:
            yield Markdown(self.text, classes="answer")
        if self.footer:
            yield Static(self.footer, classes="turn-stats -miss" if self.miss else "turn-stats", markup=False)


class ReplyView(Vertical):
    """An assistant reply while it streams. `show(text)` takes the whole text so far (messages may coalesce)."""

    def __init__(self) -> None:
        super().__init__(classes="message -assistant -live")
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
                box.title, box.collapsed = "thinking", True
            await self._put("thinking", split.thinking)
        await self._put("answer", split.answer)

    async def _put(self, part: str, new: str) -> None:
        markdown = self.query_one(f"#{part}-md", Markdown)
        old = self._written[part]
        self._written[part] = new
        if new.startswith(old):
            if part not in self._streams:
                self._streams[part] = Markdown.get_stream(markdown)
            await self._streams[part].write(new[len(old):])
            return
        # The split moved (a late `</think>`): re-render this part from scratch.
        if part in self._streams:
            await self._streams.pop(part).stop()
        await markdown.update(new)

    async def finish(self, footer: str, miss: bool = False, note: str | None = None) -> None:
        if not self.is_attached:
            return
        for stream in self._streams.values():
            await stream.stop()
        self._streams.clear()
        self.remove_class("-live")
        self.query_one(".role", Label).update("assistant" + (f" ({note})" if note else ""))
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

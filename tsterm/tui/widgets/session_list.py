"""The sessions sidebar: one option per session, a marker on those generating right now, `◆` on agent sessions, `⇄`
on API clients' conversations."""
from __future__ import annotations

from collections.abc import Iterable

from textual.content import Content
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from tsterm.chat.session import Session


class SessionList(OptionList):
    def show(self, sessions: Iterable[Session], current_id: str | None, busy: set[str]) -> None:
        options, highlight = [], None
        for i, s in enumerate(sessions):
            label = Content.assemble(("● " if s.id in busy else "  ", "bold $success"),
                                     ({"agent": "◆ ", "api": "⇄ "}.get(s.kind, ""), "bold $accent"),
                                     (s.title or "untitled", "bold" if s.id == current_id else ""),
                                     (" ⑂" if s.parent_id else "", "dim"))
            options.append(Option(label, id=s.id))
            if s.id == current_id:
                highlight = i
        self.clear_options()
        self.add_options(options)
        if highlight is not None:
            self.highlighted = highlight

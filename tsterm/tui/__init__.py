"""The Textual front end. Importing it pulls in textual; nothing outside `tsterm.tui` imports it."""
from __future__ import annotations

from tsterm.tui.app import TstermApp

__all__ = ["TstermApp", "main"]


def main(profile: str = "default") -> int:
    """`tsterm` / `tsterm --profile X`: run the TUI until the user quits."""
    TstermApp(profile).run()
    return 0

"""The Textual front end. Importing it pulls in textual; nothing outside `tsterm.tui` imports it."""
from __future__ import annotations

from tsterm.tui.app import TstermApp

__all__ = ["TstermApp", "main"]


def main(profile: str = "default", auto_approve: bool = False, workspace: str | None = None,
         serve: dict | None = None, engine_options: dict | None = None) -> int:
    """`tsterm` / `tsterm --profile X`: run the TUI until the user quits. `auto_approve`: agent sessions run tools
    that need approval without asking; `workspace`: their tools' directory instead of the profile's; `serve`
    (`--serve`): start the API server, {host, port, api_key} over the profile's `server:` settings;
    `engine_options`: the command line's engine options over the profile's (`--tensor-parallel-size`, ...)."""
    app = TstermApp(profile, auto_approve=auto_approve, workspace=workspace, serve=serve,
                    engine_options=engine_options)
    app.run()
    return app.return_code or 0  # 1 when the user quits a start-up that failed


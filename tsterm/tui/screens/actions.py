"""Slash commands and session actions of the chat screen (new, agent, fork, copy, rename, delete, system, profile,
clear, save, export, dashboard, help).

A mixin only to keep chat.py about the conversation itself; it relies on the ChatScreen attributes
(`sessions`, `current_id`, `turns`, `store`, `host`, `show_session`, `notice`, ...).
"""
from __future__ import annotations

import json
from pathlib import Path

from tsterm.chat.session import Session, new_session_id
from tsterm.chat.store import atomic_write
from tsterm.tui.commands import Command, help_text
from tsterm.tui.screens.dialogs import Confirm, TextPrompt
from tsterm.tui.thinking import split_thinking


class SessionActions:
    async def run_command(self, command: Command) -> None:
        arg = command.arg
        if command.name == "new":
            await self.action_new_session(arg or None)
        elif command.name == "agent":
            await self.action_new_agent_session(arg or None)
        elif command.name in ("fork", "copy") and arg:
            try:
                index = self.session.index_of(int(arg))
            except ValueError as e:
                await self.notice(str(e), "error")
                return
            await (self.action_fork_session(index) if command.name == "fork" else self.action_copy_message(index))
        elif command.name == "profile":
            self.switch_profile(arg)
        elif command.name == "rename":
            self.rename(arg)
        elif command.name == "system" and arg:
            await self.set_system(arg)
        elif command.name == "system":
            await self.notice(f"system prompt: {self.session.system_prompt or '(none)'}")
        elif command.name == "serve":
            self.serve_command(arg)
        elif command.name == "export":
            fmt, _, path = arg.partition(" ")
            self.action_export(fmt, path.strip())
        elif command.name == "help":
            await self.action_help()
        else:
            action = {"fork": "fork_session", "copy": "copy_message", "delete": "delete_session",
                      "clear": "clear_session", "save": "save", "stats": "toggle_dashboard"}[command.name]
            await self.run_action(action)

    async def action_help(self) -> None:
        keys = [(b.key, b.description) for b in self.BINDINGS] + [("sidebar click, ctrl+p", "switch sessions"),
            ("up/down", "prompt history"), ("shift+tab", "select a message, like ctrl+up"),
            ("up/down, f, c, enter", "on a selected message: move, fork there, copy it, back to the prompt"),
            ("ctrl+p", "command palette"), ("ctrl+q", "quit")]
        await self.notice(help_text(keys))

    def new_session(self, title: str | None = None) -> Session:
        session = Session(id=new_session_id(), title=title or "new chat", model=self.host.model_key)
        session.set_system_prompt(self.host.system_prompt)
        return session

    def add_session(self, session: Session) -> None:
        self.sessions[session.id] = session
        self.save(session)

    def save(self, session: Session, quiet: bool = False) -> bool:
        try:
            self.store.save(session)
            return True
        except OSError as e:
            if not quiet:
                self.notify(f"could not save {session.title}: {e}", severity="error")
            return False

    def _idle(self, what: str) -> bool:
        if self.current_id in self.busy:
            self.notify(f"wait for the reply (or press esc) before you {what}", severity="warning")
            return False
        return True

    async def action_new_session(self, title: str | None = None) -> None:
        session = self.new_session(title)
        self.add_session(session)
        await self.show_session(session.id)

    async def action_fork_session(self, index: int | None = None) -> None:
        """Branch after message `index` (default: the selected message, else the last one). The branch keeps the
        exact ids of that prefix, so its next turn takes the parent's KV blocks by reference (zero copy)."""
        if index is None:
            index = self.selected_index()
        if index is None and not self._idle("fork"):
            return
        parent = self.session
        child = parent.fork(new_session_id(), index)
        if parent.kind == "api":  # the client's conversation stays the client's; the branch is yours to type into
            child.kind = "chat"
        titles = {s.title for s in self.sessions.values()}
        child.title = next(t for n in range(1, len(titles) + 2)
                           if (t := f"{parent.title} (fork{f' {n}' if n > 1 else ''})") not in titles)
        self.add_session(child)
        await self.show_session(child.id)
        self.query_one("#prompt").focus()
        at = "" if index is None else f" after #{parent.number_of(index) or 0}"
        if child.token_ids:
            self.notify(f"forked{at}: the branch starts from the parent's {len(child.token_ids)} tokens, taken from "
                        "the cache by reference (nothing is copied or computed again)")
        else:
            self.notify(f"forked{at}: the branch's next turn takes what it shares with the parent from the cache "
                        "(nothing is copied) and computes only the rest")

    async def action_copy_message(self, index: int | None = None) -> None:
        """Copy message `index` (default: the selected message, else the last reply): a reply without its
        thinking block, through the terminal's clipboard (OSC 52)."""
        messages = self.session.messages
        if index is None:
            index = self.selected_index()
        if index is None:
            index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "assistant"), None)
        if index is None:
            self.notify("no reply to copy yet: select a message (shift+tab) or use /copy N", severity="warning")
            return
        message = messages[index]
        text = message["content"]
        if message["role"] == "assistant":
            text = split_thinking(text).answer or text
        self.app.copy_to_clipboard(text)
        number = self.session.number_of(index)
        self.notify(f"copied {'the system prompt' if number is None else f'message #{number}'} ({len(text)} chars)")

    def action_pick_profile(self) -> None:
        self.app.push_screen(TextPrompt("profile name or YAML path", self.host.profile_name),
                             lambda profile: self.switch_profile(profile) if profile else None)

    def switch_profile(self, profile: str) -> None:
        if self.busy:
            self.notify("wait for the replies and agent tasks to finish (or press esc in each) before switching "
                        "profiles", severity="warning")
            return
        for session in self.sessions.values():
            self.save(session)
        self.app.switch_profile(profile, self.current_id)

    def action_rename_session(self) -> None:
        self.app.push_screen(TextPrompt("rename session", self.session.title),
                             lambda title: self.rename(title) if title else None)

    def rename(self, title: str) -> None:
        self.session.title = title
        self.session.touch()
        self.save(self.session)
        self.refresh_sidebar()
        self.refresh_status()

    def action_delete_session(self) -> None:
        session_id = self.current_id

        async def done(yes: bool | None) -> None:
            if yes:
                await self.delete(session_id)

        self.app.push_screen(Confirm(f"delete session {self.session.title!r}?"), done)

    async def delete(self, session_id: str) -> None:
        if session_id in self.turns:
            self.turns.pop(session_id).worker.cancel()
        await self.close_agent(session_id)  # stops its task, releases its pin, stops its MCP servers
        self.sessions.pop(session_id, None)
        try:
            self.store.delete(session_id)
        except OSError as e:
            self.notify(f"could not delete the session file: {e}", severity="error")
        if not self.sessions:
            self.add_session(self.new_session())
        if session_id == self.current_id or self.current_id not in self.sessions:
            await self.show_session(max(self.sessions.values(), key=lambda s: s.updated).id)
        else:
            self.refresh_sidebar()

    def action_edit_system(self) -> None:
        async def done(text: str | None) -> None:
            if text is not None:
                await self.set_system(text)

        self.app.push_screen(TextPrompt("system prompt", self.session.system_prompt or ""), done)

    async def set_system(self, text: str) -> None:
        if not self._idle("change the system prompt"):
            return
        self.session.set_system_prompt(text)
        self.save(self.session)
        await self.show_session(self.current_id)

    async def action_clear_session(self) -> None:
        if not self._idle("clear"):
            return
        self.session.clear()
        self.save(self.session)
        await self.show_session(self.current_id)

    def action_save(self) -> None:
        saved = sum(self.save(s) for s in self.sessions.values())
        self.notify(f"saved {saved} session(s) to {self.store.directory}")

    def action_export(self, fmt: str, path: str = "") -> None:
        session = self.session
        suffix = {"md": "md", "json": "json", "trace": "trace.json"}[fmt]
        target = Path(path).expanduser() if path else self.store.directory.parent / "exports" / f"{session.id}.{suffix}"
        if fmt == "md":
            text = session.to_markdown()
        elif fmt == "json":
            text = json.dumps(session.to_dict(), ensure_ascii=False, indent=1)
        else:  # token counts per turn (agent step) and its tools' latencies, for `tsterm bench --trace`
            if not session.turns:
                self.notify("this session has no turns yet: nothing to trace", severity="warning")
                return
            run = getattr(self, "agent_runs", {}).get(session.id)
            agent = getattr(run, "agent", None)
            trace = agent.trace(self.host.model_name) if agent is not None else session.trace(self.host.model_name)
            text = json.dumps(trace, indent=1)
        try:
            atomic_write(target, text)
        except OSError as e:
            self.notify(f"could not export to {target}: {e}", severity="error")
            return
        self.notify(f"exported {session.title!r} to {target}")

    def serve_command(self, arg: str) -> None:
        """`/serve` (the profile's port), `/serve PORT`, `/serve stop`."""
        if arg == "stop":
            self.app.stop_api_server()
        elif not arg:
            self.app.start_api_server()
        elif arg.isdigit() and 0 < int(arg) < 65536:
            self.app.start_api_server(int(arg))
        else:
            self.notify(f"usage: /serve [PORT|stop] (got {arg!r})", severity="error")

    def action_start_server(self) -> None:
        self.app.start_api_server()

    def action_stop_server(self) -> None:
        self.app.stop_api_server()

    def action_toggle_dashboard(self) -> None:
        self.toggle_class("-dashboard")
        self.dashboard.redraw()
        self.dashboard.show_turns(self.session)

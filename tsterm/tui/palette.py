"""Command palette entries for the chat screen: the same actions as the slash commands and keys."""
from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (title, chat-screen action, help)
ACTIONS = (
    ("New session", "new_session", "start an empty conversation  (/new, ctrl+n)"),
    ("New agent session", "new_agent_session", ("tasks run tools (files, calculator, commands) in the profile's "
                                                "agent workspace  (/agent, ctrl+g)")),
    ("Fork session", "fork_session", ("branch after the selected (or last) message, sharing its KV blocks  "
                                      "(/fork [N], ctrl+b)")),
    ("Select message", "select_message", "pick a message to fork from or copy: up/down, f, c, enter  (ctrl+up)"),
    ("Copy message", "copy_message", "copy the selected message, or the last reply  (/copy [N], ctrl+y)"),
    ("Switch profile", "pick_profile", "reload the engine with another profile  (/profile NAME|PATH)"),
    ("Rename session", "rename_session", "give this session a title  (/rename, ctrl+r)"),
    ("Delete session", "delete_session", "delete this session  (/delete, f8)"),
    ("Clear conversation", "clear_session", "forget the messages, keep the system prompt  (/clear)"),
    ("Set system prompt", "edit_system", "change this session's system prompt  (/system TEXT)"),
    ("Abort generation", "abort", "stop this session's reply or agent task and free its KV blocks  (esc)"),
    ("Start API server", "start_server", ("serve this engine over the OpenAI and Anthropic APIs; clients' "
                                          "conversations show as sessions  (/serve [PORT])")),
    ("Stop API server", "stop_server", "stop serving the API  (/serve stop)"),
    ("Toggle dashboard", "toggle_dashboard", "tokens/s, latency, KV blocks, prefix reuse  (/stats, ctrl+t)"),
    ("Save sessions", "save", "write every session to the data dir  (/save)"),
    ("Export as Markdown", "export('md')", "write this session to the exports folder  (/export md [PATH])"),
    ("Export as JSON", "export('json')", "write this session with its token ids  (/export json [PATH])"),
    ("Help", "help", "list commands and keys  (/help)"),
)


def plain(text: str) -> str:
    """`text` as the palette's markup shows it literally (`[N]`, `[PATH]` are not tags)."""
    return text.replace("[", "\\[")


class ChatCommands(Provider):
    async def _run(self, action: str) -> None:
        await self.screen.run_action(action)

    def _entries(self) -> list[tuple[str, object, str]]:
        """The actions, then one "Switch to" entry per session (most recent first)."""
        entries = [(title, partial(self._run, action), plain(help_text)) for title, action, help_text in ACTIONS]
        sessions = sorted(getattr(self.screen, "sessions", {}).values(), key=lambda s: s.updated, reverse=True)
        for session in sessions:
            if session.id != self.screen.current_id:
                kind = {"agent": "agent session", "api": "API client's conversation"}.get(session.kind, "chat")
                entries.append((f"Switch to: {session.title}", partial(self.screen.show_session, session.id),
                                plain(f"{kind}, {len(session.turns)} turn(s)  (the sidebar; ctrl+pageup/pagedown)")))
        return entries

    async def discover(self) -> Hits:
        for title, run, help_text in self._entries():
            yield DiscoveryHit(title, run, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, run, help_text in self._entries():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), run, help=help_text)

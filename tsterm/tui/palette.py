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


class ChatCommands(Provider):
    async def _run(self, action: str) -> None:
        await self.screen.run_action(action)

    async def discover(self) -> Hits:
        for title, action, help_text in ACTIONS:
            yield DiscoveryHit(title, partial(self._run, action), help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, action, help_text in ACTIONS:
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self._run, action), help=help_text)

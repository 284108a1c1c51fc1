"""Slash commands typed in the prompt, parsed without any UI (the chat screen executes them)."""
from __future__ import annotations

from dataclasses import dataclass


class CommandError(ValueError):
    """A slash command the user mistyped; the message says what would be accepted."""


@dataclass(frozen=True)
class CommandSpec:
    name: str
    usage: str
    help: str
    needs_arg: bool = False
    number_arg: bool = False  # the optional argument is a message number (shown as #N next to each message)


COMMANDS: dict[str, CommandSpec] = {spec.name: spec for spec in (
    CommandSpec("new", "/new [TITLE]", "start a new session"),
    CommandSpec("agent", "/agent [TITLE]", "start a new agent session: its tasks run tools in the profile's "
                "agent workspace"),
    CommandSpec("fork", "/fork [N]", "branch this session after message #N (default: the last one); the branch "
                "shares its KV blocks", number_arg=True),
    CommandSpec("copy", "/copy [N]", "copy message #N (default: the last reply) to the clipboard", number_arg=True),
    CommandSpec("rename", "/rename TITLE", "rename this session", needs_arg=True),
    CommandSpec("delete", "/delete", "delete this session"),
    CommandSpec("system", "/system [TEXT]", "set this session's system prompt (empty: show it)"),
    CommandSpec("profile", "/profile NAME|PATH", "reload the engine with another profile (sessions are kept)",
                needs_arg=True),
    CommandSpec("clear", "/clear", "clear this session's conversation (keeps the system prompt)"),
    CommandSpec("save", "/save", "save every session now"),
    CommandSpec("export", "/export md|json|trace [PATH]", "export this session as Markdown, JSON or a trace for "
                "`tsterm bench --trace` (default: the exports folder of the data dir)", needs_arg=True),
    CommandSpec("serve", "/serve [PORT|stop]", "serve this engine over the OpenAI and Anthropic APIs (default: the "
                "profile's server port); API clients' conversations show as sessions marked ⇄"),
    CommandSpec("stats", "/stats", "show or hide the dashboard"),
    CommandSpec("help", "/help", "list commands and keys"),
)}

EXPORT_FORMATS = ("md", "json", "trace")


@dataclass(frozen=True)
class Command:
    name: str
    arg: str = ""


def parse_command(text: str) -> Command | None:
    """`/name arg...` -> Command; plain text -> None; `//text` sends "/text" as a message."""
    text = text.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name, arg = name.lower(), arg.strip()
    spec = COMMANDS.get(name)
    if spec is None:
        matches = [n for n in COMMANDS if n.startswith(name)] if name else []
        if len(matches) == 1:
            spec = COMMANDS[matches[0]]
        else:
            raise CommandError(f"unknown command /{name}; try /help (commands: "
                               + ", ".join(f"/{n}" for n in COMMANDS) + ")")
    if spec.needs_arg and not arg:
        raise CommandError(f"usage: {spec.usage}")
    if spec.name == "export" and arg.partition(" ")[0] not in EXPORT_FORMATS:
        raise CommandError(f"usage: {spec.usage} (got {arg!r})")
    if spec.number_arg and arg and not (arg.isdigit() and int(arg) > 0):
        raise CommandError(f"usage: {spec.usage}: N is a message number, as shown next to its role (got {arg!r})")
    return Command(spec.name, arg)


def unescape_message(text: str) -> str:
    """A message starting with `//` is sent with one slash."""
    return text[1:] if text.lstrip().startswith("//") else text


def help_text(keys: list[tuple[str, str]]) -> str:
    """Markdown help: the commands, then (key, what) pairs."""
    lines = ["**commands**", ""] + [f"- `{spec.usage}` {spec.help}" for spec in COMMANDS.values()]
    lines += ["", "**keys**", ""] + [f"- `{key}` {what}" for key, what in keys]
    return "\n".join(lines) + "\n\nStart a message with `//` to send a literal `/`."

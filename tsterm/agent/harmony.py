"""gpt-oss's harmony format, read from an assistant turn's streamed text: its messages, their channels and its tool
calls.

A turn (what the model writes after the prompt's `<|start|>assistant`) is one or more messages:

    [<|start|>assistant]HEADER<|message|>CONTENT(<|end|> | <|call|> | <|return|>)

The header holds the channel (`<|channel|>analysis`, `commentary` or `final`), a recipient (`to=functions.NAME`, before
or after the channel) and the content type of a call (`<|constrain|>json`, or a bare `json`). The first message of a
turn has no `<|start|>assistant` (the prompt wrote it). What each message is:

- `analysis`: reasoning (`ReasoningDelta`), streamed as it comes;
- `commentary` to `functions.NAME`: a tool call, its content the JSON arguments, ended by `<|call|>` (`ToolCall`);
- `final`, or `commentary` with no recipient (a preamble the user may see): text (`TextDelta`), streamed.

`HarmonyParser.feed(delta)` returns the events the delta completes; a marker split across deltas is held back until
it is whole. `finish()` ends the turn: a call without its `<|call|>` becomes a call with an error, and text that never
reached a `<|message|>` (a reply that is not harmony at all) is released as text. A call is checked as
`tsterm.agent.tool_calls.ToolCallParser` checks one (a known tool, arguments an object valid against its schema);
a malformed one carries an `error` to hand back to the model.

Not here yet: wiring this parser into the agent loop and the server's streaming (`tsterm.server.tool_stream`), which
pick `ToolCallParser` today, and rendering harmony prompts (the checkpoint's own chat template renders them).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tsterm.agent.schema import ArgumentSchema
from tsterm.agent.tool_calls import TextDelta, ToolCall, _tool_schemas

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN)
FUNCTIONS = "functions."
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the analysis channel (the model's reasoning)."""

    text: str


Event = TextDelta | ReasoningDelta | ToolCall


@dataclass(frozen=True)
class Header:
    """One message's header: its channel ("" when it names none), recipient (None: the user) and content type."""

    channel: str
    recipient: str | None
    content_type: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        rest = text[channel.end():] if channel else ""
        constrained = text.split(CONSTRAIN, 1)[1].split() if CONSTRAIN in text else []
        content_type = constrained[0] if constrained else ("json" if "json" in _RECIPIENT.sub("", rest).split()
                                                           else None)
        return cls(channel.group(1) if channel else "", recipient.group(1) if recipient else None, content_type)

    @property
    def is_call(self) -> bool:
        return self.recipient is not None and self.recipient.startswith(FUNCTIONS)


class HarmonyParser:
    """Splits one assistant turn in harmony into reasoning, text and tool calls. `tools`: OpenAI-style specs as for
    `ToolCallParser` (None: any name and arguments object). Call ids are `{id_prefix}{n}`."""

    def __init__(self, tools: Iterable[Mapping[str, Any]] | None = None, *, id_prefix: str = "call_"):
        self.schemas = None if tools is None else _tool_schemas(tools)
        self._checkers: dict[str, ArgumentSchema] = {}
        self.id_prefix = id_prefix
        self._buffer = ""  # the header so far, or the content not yet released
        self._header: Header | None = None  # in a message's content: its header
        self._raw = ""  # the current message's text so far (its call's `raw`)
        self._content = ""  # a call's content so far
        self._calls = 0
        self._finished = False

    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("HarmonyParser.feed after finish(): use one parser per turn")
        self._buffer += delta
        events: list[Event] = []
        while True:
            if self._header is None:  # reading a header: up to <|message|>
                at = self._buffer.find(MESSAGE)
                if at < 0:
                    return events
                header_text = self._buffer[:at]
                self._raw = self._buffer[:at + len(MESSAGE)]
                self._header = Header.parse(header_text)
                self._buffer, self._content = self._buffer[at + len(MESSAGE):], ""
                continue
            ends = [(self._buffer.find(tag), tag) for tag in ENDS]
            ends = [(at, tag) for at, tag in ends if at >= 0]
            if not ends:  # release all but what may be the start of an end marker
                held = _partial_marker_length(self._buffer)
                self._content_events(events, self._buffer[:len(self._buffer) - held])
                self._buffer = self._buffer[len(self._buffer) - held:]
                return events
            at, tag = min(ends)
            self._content_events(events, self._buffer[:at])
            self._raw += tag
            if self._header.is_call:
                error = None if tag == CALL else f"a tool call's message ends with {CALL}, not {tag}"
                events.append(self._call(error))
            self._buffer = self._buffer[at + len(tag):]  # the next message: <|start|>assistant, its header
            self._header = None

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if not self._finished:
            self._finished = True
            if self._header is None:
                if self._buffer.strip():  # never reached <|message|>: not harmony, or a cut header
                    events.append(TextDelta(self._buffer))
            else:
                self._content_events(events, self._buffer)
                if self._header.is_call:
                    events.append(self._call(f"the output ended before {CALL}: the call is incomplete"))
            self._buffer = ""
        return events

    def _content_events(self, events: list[Event], text: str) -> None:
        if not text:
            return
        self._raw += text
        header = self._header
        if header.is_call:
            self._content += text
        elif header.recipient is not None:  # a message to another recipient (a built-in tool): not shown
            return
        elif header.channel == "analysis":
            events.append(ReasoningDelta(text))
        else:  # final, or a commentary preamble to the user
            events.append(TextDelta(text))

    def _call(self, error: str | None) -> ToolCall:
        name = self._header.recipient[len(FUNCTIONS):]
        arguments: dict[str, Any] = {}
        problem = None
        try:
            value = json.loads(self._content) if self._content.strip() else {}
            if isinstance(value, dict):
                arguments = value
            else:
                problem = f"the arguments of {name!r} must be a JSON object, got {type(value).__name__}"
        except json.JSONDecodeError as e:
            problem = f"the arguments of {name!r} are not valid JSON ({e.msg} at character {e.pos})"
        if problem is None and error is None and self.schemas is not None:
            if name not in self.schemas:
                problem = f"unknown tool {name!r}; available tools: {', '.join(sorted(self.schemas)) or 'none'}"
            else:
                checker = self._checkers.get(name)
                if checker is None:
                    checker = self._checkers[name] = ArgumentSchema(self.schemas[name])
                problems = checker.problems(arguments, "arguments")
                if problems:
                    problem = f"bad arguments for tool {name!r}: " + "; ".join(problems)
        call = ToolCall(f"{self.id_prefix}{self._calls}", name, arguments, self._raw, error or problem)
        self._calls += 1
        return call


def _partial_marker_length(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of an end marker."""
    for n in range(min(len(text), max(map(len, ENDS)) - 1), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in ENDS):
            return n
    return 0


def parse(text: str, tools: Iterable[Mapping[str, Any]] | None = None) -> list[Event]:
    """A whole turn's events, adjacent deltas of one kind merged."""
    parser = HarmonyParser(tools)
    merged: list[Event] = []
    for event in parser.feed(text) + parser.finish():
        if merged and type(event) is type(merged[-1]) and isinstance(event, (TextDelta, ReasoningDelta)):
            merged[-1] = type(event)(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged

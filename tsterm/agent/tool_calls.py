"""Tool calls in a model's streamed output: Qwen/Hermes `<tool_call>{json}</tool_call>` and the Qwen3-Coder XML form
`<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`, several per turn.

One `ToolCallParser` per assistant turn. `feed(delta)` returns the events the delta completes: `TextDelta`s that are
safe to show, and `ToolCall`s. Text that may still become `<tool_call>` is held back until it cannot; the inside of
a call is never text. `finish()` ends the turn: an unterminated call becomes a call with an error (never dropped), and
a held-back partial tag (`<tool_ca` at the very end) was never a tag, so it is released as text.
The text events and the calls' `raw` concatenate back to the input, exactly.

A malformed call (bad JSON, no name, unknown tool, arguments that are not an object or fail the tool's JSON schema)
is a `ToolCall` whose `error` says what to fix; the agent loop hands that back to the model as the call's result.
Known limit: the first `</tool_call>` ends a call and a second `<tool_call>` inside one starts a new call, even
inside a JSON string or a parameter value.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tsterm.agent.schema import ArgumentSchema, json_type

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)
_JSON_TYPES = {"integer", "number", "boolean", "object", "array", "null"}  # parameter values parsed with json


@dataclass(frozen=True)
class TextDelta:
    """Text outside tool calls, safe to display."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it. `error` is None for a call that may run; otherwise it names what is wrong,
    and `name`/`arguments` hold what could be read (possibly "" and {})."""

    id: str
    name: str
    arguments: dict[str, Any]
    raw: str  # the exact text, tags included
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


Event = TextDelta | ToolCall


@dataclass
class _Read:
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class ToolCallParser:
    """Splits one assistant turn's stream into text and tool calls. `tools`: OpenAI-style specs
    (`{"type": "function", "function": {"name", "description", "parameters"}}`, or the inner dict); None accepts
    any name and arguments object. Call ids are `{id_prefix}{n}`, n counting the turn's calls from 0."""

    def __init__(self, tools: Iterable[Mapping[str, Any]] | None = None, *, id_prefix: str = "call_"):
        self.schemas = None if tools is None else _tool_schemas(tools)
        self._checkers: dict[str, ArgumentSchema] = {}  # per tool name, compiled on its first call
        self.id_prefix = id_prefix
        self._buffer = ""  # text state: held-back text (a proper prefix of OPEN_TAG); call state: the call so far
        self._in_call = False
        self._scanned = 0  # in a call: buffer positions already searched for a tag
        self._calls = 0
        self._finished = False

    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("ToolCallParser.feed after finish(): use one parser per turn")
        self._buffer += delta
        events: list[Event] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(OPEN_TAG)
                if start < 0:
                    held = _partial_tag_length(self._buffer)
                    self._emit_text(events, self._buffer[:len(self._buffer) - held])
                    self._buffer = self._buffer[len(self._buffer) - held:]
                    return events
                self._emit_text(events, self._buffer[:start])
                self._buffer, self._in_call, self._scanned = self._buffer[start:], True, len(OPEN_TAG)
                continue
            # a call: it ends at the first close tag; a second open tag first means the model restarted
            search_from = max(len(OPEN_TAG), self._scanned - len(CLOSE_TAG))
            close = self._buffer.find(CLOSE_TAG, search_from)
            reopen = self._buffer.find(OPEN_TAG, search_from)
            if reopen >= 0 and (close < 0 or reopen < close):
                events.append(self._call(self._buffer[:reopen], "a new <tool_call> began before this one's "
                                         f"{CLOSE_TAG}; close each call before the next"))
                self._buffer, self._scanned = self._buffer[reopen:], len(OPEN_TAG)
                continue
            if close < 0:
                self._scanned = len(self._buffer)
                return events
            end = close + len(CLOSE_TAG)
            events.append(self._call(self._buffer[:end]))
            self._buffer, self._in_call = self._buffer[end:], False

    @property
    def pending(self) -> tuple[str, str] | None:
        """The call being read, if any: (the id it will get, its text so far after the open tag). The text only grows
        until the call ends, so a server can stream what it can already read of it."""
        if not self._in_call:
            return None
        return f"{self.id_prefix}{self._calls}", self._buffer[len(OPEN_TAG):]

    def accepts(self, name: str) -> bool:
        """Whether `name` is a tool this parser was given (any name when it was given none)."""
        return self.schemas is None or name in self.schemas

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if not self._finished:
            self._finished = True
            if self._in_call:
                events.append(self._call(self._buffer, f"the output ended before {CLOSE_TAG}: the call is incomplete"))
            else:
                self._emit_text(events, self._buffer)
            self._buffer = ""
        return events

    @staticmethod
    def _emit_text(events: list[Event], text: str) -> None:
        if text:
            events.append(TextDelta(text))

    def _call(self, raw: str, error: str | None = None) -> ToolCall:
        body = raw[len(OPEN_TAG):]
        if body.endswith(CLOSE_TAG):
            body = body[:-len(CLOSE_TAG)]
        read = self._read(body)
        call_id = f"{self.id_prefix}{self._calls}"
        self._calls += 1
        return ToolCall(call_id, read.name, read.arguments, raw, error or read.error)

    def _read(self, body: str) -> _Read:
        stripped = body.strip()
        if not stripped:
            return _Read(error='empty tool call: write {"name": ..., "arguments": {...}} inside <tool_call>')
        if stripped.startswith("<function="):
            read = _read_xml(body, self.schemas)
        else:
            read = _read_json(stripped)
        if read.error or self.schemas is None:
            return read
        if read.name not in self.schemas:
            known = ", ".join(sorted(self.schemas)) or "none"
            return _Read(read.name, read.arguments, f"unknown tool {read.name!r}; available tools: {known}")
        checker = self._checkers.get(read.name)
        if checker is None:
            checker = self._checkers[read.name] = ArgumentSchema(self.schemas[read.name])
        problems = checker.problems(read.arguments, "arguments")
        if problems:
            read.error = f"bad arguments for tool {read.name!r}: " + "; ".join(problems)
        return read


def _partial_tag_length(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN_TAG (0 if none)."""
    for length in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


def _tool_schemas(tools: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    schemas: dict[str, Mapping[str, Any]] = {}
    for index, tool in enumerate(tools):
        spec = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{index}]: expected {{'type': 'function', 'function': {{'name': ..., "
                             f"'parameters': {{...}}}}}}, got {tool!r}")
        if name in schemas:
            raise ValueError(f"tools[{index}]: a tool named {name!r} is given twice")
        parameters = spec.get("parameters", {"type": "object"})
        if not isinstance(parameters, Mapping):
            raise ValueError(f"tools[{index}] ({name}): parameters must be a JSON schema object, got {parameters!r}")
        schemas[name] = parameters
    return schemas


def _read_json(body: str) -> _Read:
    expected = 'expected {"name": <tool name>, "arguments": {...}}'
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return _Read(error=f"tool call is not valid JSON ({error}); {expected}")
    if not isinstance(call, dict):
        return _Read(error=f"tool call JSON is a {json_type(call)}; {expected}")
    name = call.get("name")
    if not isinstance(name, str) or not name.strip():
        return _Read(error=f"tool call has no \"name\" (got {name!r}); {expected}")
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some templates/models encode the arguments object as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return _Read(name, {}, f"\"arguments\" is a string that is not JSON ({error}); pass an object")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return _Read(name, {}, f"\"arguments\" must be an object, got {json_type(arguments)}")
    return _Read(name, arguments)


def _read_xml(body: str, schemas: Mapping[str, Mapping[str, Any]] | None) -> _Read:
    expected = "expected <function=NAME><parameter=P>value</parameter>...</function>"
    function = _FUNCTION.match(body)
    if function is None:
        return _Read(error=f"malformed <function=...> call (is </function> missing?); {expected}")
    name, inner = function.group(1).strip(), function.group(2)
    if not name:
        return _Read(error=f"<function=> has no name; {expected}")
    properties = (schemas or {}).get(name, {}).get("properties", {})
    arguments: dict[str, Any] = {}
    position, problems = 0, []
    for parameter in _PARAMETER.finditer(inner):
        if inner[position:parameter.start()].strip():
            problems.append(f"text outside <parameter=...>: {inner[position:parameter.start()].strip()[:40]!r}")
        position = parameter.end()
        key, value = parameter.group(1).strip(), parameter.group(2)
        value = value[1:] if value.startswith("\n") else value  # the form puts each value on its own lines
        value = value[:-1] if value.endswith("\n") else value
        if key in arguments:
            problems.append(f"parameter {key!r} is given twice")
        try:
            arguments[key] = _convert(value, properties.get(key))
        except ValueError as error:
            problems.append(f"parameter {key!r}: {error}")
            arguments[key] = value
    if inner[position:].strip():
        problems.append(f"text outside <parameter=...>: {inner[position:].strip()[:40]!r} (is </parameter> missing?)")
    return _Read(name, arguments, "; ".join(problems) + f"; {expected}" if problems else None)


def _convert(value: str, schema: Any) -> Any:
    """A raw parameter value as its schema's type: JSON for non-string types, else the text as is."""
    types = schema.get("type") if isinstance(schema, Mapping) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if not types or "string" in types or not set(types) <= _JSON_TYPES:
        return value
    text = value.strip()
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"expected {' or '.join(types)} as JSON, got {text[:40]!r}") from None


def check_schema(value: Any, schema: Any, path: str) -> list[str]:
    """`value` against the JSON schema `schema` (jsonschema, full JSON Schema); one message per problem, each naming
    the field by its path (e.g. `arguments.paths[2]`). See tsterm.agent.schema."""
    return ArgumentSchema(schema).problems(value, path)

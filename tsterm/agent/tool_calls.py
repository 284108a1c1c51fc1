"""Tool calls in a model's streamed output, several per turn, in the forms the supported families' chat templates
write: Qwen/Hermes `<tool_call>{json}</tool_call>`; the Qwen3-Coder XML form
`<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`; GLM-4.5's
`<tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value></tool_call>` (newlines between the pieces); and
MiniMax-M2's block `<minimax:tool_call><invoke name="NAME"><parameter name="P">value</parameter></invoke>...
</minimax:tool_call>`, which holds one call per `<invoke>`. The form is read off each call as it comes (no per-model
setting): the open tag says which block it is, the body's start which form. In the XML-like forms a value is text
for a string parameter (or one whose schema gives no JSON type), else JSON of its schema's type; one newline just
inside each of a value's tags is layout, not value (a model may put the value on its own lines), so a string value
that begins or ends with a newline of its own loses it.

One `ToolCallParser` per assistant turn. `feed(delta)` returns the events the delta completes: `TextDelta`s that are
safe to show, and `ToolCall`s. Text that may still become `<tool_call>` is held back until it cannot; the inside of
a call is never text. `finish()` ends the turn: an unterminated call becomes a call with an error (never dropped), and
a held-back partial tag (`<tool_ca` at the very end) was never a tag, so it is released as text.
The text events and the calls' `raw` concatenate back to the input, exactly (a MiniMax block's calls share it out:
the first call's raw starts at the open tag, the last one's runs to the close tag).

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
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"  # MiniMax-M2's block of <invoke> calls
TAGS = ((OPEN_TAG, CLOSE_TAG), (MINIMAX_OPEN, MINIMAX_CLOSE))  # (open, close) of each kind of call block
_GLM_NAME = re.compile(r"\s*([^\s<>{}\[\]\"]+)\s*(?=<arg_key>|\Z)")  # GLM: the name, then its <arg_key>s
_GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_INVOKE = re.compile(r"<invoke name=\"([^\"]*)\">(.*?)</invoke>", re.S)  # MiniMax: one call
_INVOKE_PARAMETER = re.compile(r"<parameter name=\"([^\"]*)\">(.*?)</parameter>", re.S)
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
        self._buffer = ""  # text state: held-back text (a proper prefix of an open tag); call state: the call so far
        self._in_call = False
        self._tag = TAGS[0]  # in a call: its block's (open, close) tags
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
                found = [(self._buffer.find(tags[0]), tags) for tags in TAGS]
                found = [(start, tags) for start, tags in found if start >= 0]
                if not found:
                    held = _partial_tag_length(self._buffer)
                    self._emit_text(events, self._buffer[:len(self._buffer) - held])
                    self._buffer = self._buffer[len(self._buffer) - held:]
                    return events
                start, self._tag = min(found, key=lambda f: f[0])
                self._emit_text(events, self._buffer[:start])
                self._buffer, self._in_call, self._scanned = self._buffer[start:], True, len(self._tag[0])
                continue
            # a call: it ends at the first close tag; a second open tag first means the model restarted
            open_tag, close_tag = self._tag
            search_from = max(len(open_tag), self._scanned - len(close_tag))
            close = self._buffer.find(close_tag, search_from)
            reopen = self._buffer.find(open_tag, search_from)
            if reopen >= 0 and (close < 0 or reopen < close):
                events += self._calls_of(self._buffer[:reopen], f"a new {open_tag} began before this one's "
                                         f"{close_tag}; close each call before the next")
                self._buffer, self._scanned = self._buffer[reopen:], len(open_tag)
                continue
            if close < 0:
                self._scanned = len(self._buffer)
                return events
            end = close + len(close_tag)
            events += self._calls_of(self._buffer[:end])
            self._buffer, self._in_call = self._buffer[end:], False

    @property
    def pending(self) -> tuple[str, str] | None:
        """The call being read, if any: (the id it will get, its text so far after the open tag). The text only grows
        until the call ends, so a server can stream what it can already read of it."""
        if not self._in_call:
            return None
        return f"{self.id_prefix}{self._calls}", self._buffer[len(self._tag[0]):]

    def accepts(self, name: str) -> bool:
        """Whether `name` is a tool this parser was given (any name when it was given none)."""
        return self.schemas is None or name in self.schemas

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if not self._finished:
            self._finished = True
            if self._in_call:
                events += self._calls_of(self._buffer, f"the output ended before {self._tag[1]}: the call is "
                                         "incomplete")
            else:
                self._emit_text(events, self._buffer)
            self._buffer = ""
        return events

    @staticmethod
    def _emit_text(events: list[Event], text: str) -> None:
        if text:
            events.append(TextDelta(text))

    def _calls_of(self, raw: str, error: str | None = None) -> list[ToolCall]:
        """The calls of one block `raw` (its open tag, and its close tag unless `error` says why there is none)."""
        open_tag, close_tag = self._tag
        body = raw[len(open_tag):]
        if body.endswith(close_tag):
            body = body[:-len(close_tag)]
        if open_tag == MINIMAX_OPEN:
            return self._invokes(raw, body, error)
        return [self._new_call(self._read(body), raw, error)]

    def _new_call(self, read: _Read, raw: str, error: str | None = None) -> ToolCall:
        call_id = f"{self.id_prefix}{self._calls}"
        self._calls += 1
        return ToolCall(call_id, read.name, read.arguments, raw, error or read.error)

    def _invokes(self, raw: str, body: str, error: str | None) -> list[ToolCall]:
        """A MiniMax block: one call per `<invoke>`, its raw the text from the previous call's end to its own (the
        block's open tag with the first, what follows the last invoke with the last)."""
        expected = 'expected <invoke name="NAME"><parameter name="P">value</parameter>...</invoke>'
        invokes = list(_INVOKE.finditer(body))
        if error is not None or not invokes:
            read = self._check(_read_invoke(invokes[0], self.schemas)) if invokes else _Read()
            return [self._new_call(read, raw, error or f"no <invoke> in the {MINIMAX_OPEN} block; {expected}")]
        offset, calls, start = len(MINIMAX_OPEN), [], 0
        for i, invoke in enumerate(invokes):
            gap = body[invokes[i - 1].end() if i else 0:invoke.start()]
            end = len(raw) if i == len(invokes) - 1 else offset + invoke.end()
            read = self._check(_read_invoke(invoke, self.schemas))
            tail = body[invoke.end():] if i == len(invokes) - 1 else ""
            if gap.strip() or tail.strip():
                stray = (gap.strip() or tail.strip())[:40]
                read.error = read.error or f"text outside <invoke>: {stray!r}; {expected}"
            calls.append(self._new_call(read, raw[start:end]))
            start = end
        return calls

    def _read(self, body: str) -> _Read:
        stripped = body.strip()
        if not stripped:
            return _Read(error='empty tool call: write {"name": ..., "arguments": {...}} inside <tool_call>')
        if stripped.startswith("<function="):
            read = _read_xml(body, self.schemas)
        elif not stripped.startswith(("{", "[", '"')) and _GLM_NAME.match(body):
            read = _read_glm(body, self.schemas)
        else:
            read = _read_json(stripped)
        return self._check(read)

    def _check(self, read: _Read) -> _Read:
        """A read call against the offered tools: its name known, its arguments valid against its schema."""
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
    """Length of the longest suffix of `text` that is a proper prefix of an open tag (0 if none)."""
    longest = max(len(open_tag) for open_tag, _ in TAGS)
    for length in range(min(len(text), longest - 1), 0, -1):
        if any(open_tag.startswith(text[-length:]) and length < len(open_tag) for open_tag, _ in TAGS):
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


def _read_pairs(pairs: Iterable[tuple[str, str]], properties: Mapping[str, Any], problems: list[str]) -> dict:
    """(key, raw value) pairs as arguments, each value as its schema's type (`_convert`)."""
    arguments: dict[str, Any] = {}
    for key, value in pairs:
        key = key.strip()
        value = value[1:] if value.startswith("\n") else value  # a value may sit on its own lines
        value = value[:-1] if value.endswith("\n") else value
        if key in arguments:
            problems.append(f"parameter {key!r} is given twice")
        try:
            arguments[key] = _convert(value, properties.get(key))
        except ValueError as error:
            problems.append(f"parameter {key!r}: {error}")
            arguments[key] = value
    return arguments


def _outside(inner: str, matches: list[re.Match], what: str) -> list[str]:
    """Problems for any text between or after the matched pieces (they must be all there is)."""
    problems, position = [], 0
    for match in matches:
        if inner[position:match.start()].strip():
            problems.append(f"text outside {what}: {inner[position:match.start()].strip()[:40]!r}")
        position = match.end()
    if inner[position:].strip():
        problems.append(f"text outside {what}: {inner[position:].strip()[:40]!r} (is a closing tag missing?)")
    return problems


def _read_glm(body: str, schemas: Mapping[str, Mapping[str, Any]] | None) -> _Read:
    """GLM-4.5's form: the name, then `<arg_key>P</arg_key><arg_value>value</arg_value>` pairs."""
    expected = "expected NAME<arg_key>P</arg_key><arg_value>value</arg_value>... inside <tool_call>"
    name_end = body.find("<arg_key>")
    name = (body if name_end < 0 else body[:name_end]).strip()
    inner = "" if name_end < 0 else body[name_end:]
    properties = (schemas or {}).get(name, {}).get("properties", {})
    matches = list(_GLM_ARGUMENT.finditer(inner))
    problems = _outside(inner, matches, "<arg_key>/<arg_value>")
    arguments = _read_pairs(((m.group(1), m.group(2)) for m in matches), properties, problems)
    return _Read(name, arguments, "; ".join(problems) + f"; {expected}" if problems else None)


def _read_invoke(invoke: re.Match, schemas: Mapping[str, Mapping[str, Any]] | None) -> _Read:
    """One MiniMax `<invoke name="NAME">` and its `<parameter name="P">value</parameter>`s."""
    expected = 'expected <invoke name="NAME"><parameter name="P">value</parameter>...</invoke>'
    name, inner = invoke.group(1).strip(), invoke.group(2)
    if not name:
        return _Read(error=f'<invoke name=""> has no name; {expected}')
    properties = (schemas or {}).get(name, {}).get("properties", {})
    matches = list(_INVOKE_PARAMETER.finditer(inner))
    problems = _outside(inner, matches, '<parameter name="...">')
    arguments = _read_pairs(((m.group(1), m.group(2)) for m in matches), properties, problems)
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

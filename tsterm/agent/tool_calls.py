"""Tool calls in a model's streamed output, several per turn, in the forms the supported families' chat templates
write: Qwen/Hermes `<tool_call>{json}</tool_call>`; the Qwen3-Coder XML form
`<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`; GLM-4.5's
`<tool_call>NAME<arg_key>P</arg_key><arg_value>value</arg_value></tool_call>` (newlines between the pieces); and
MiniMax-M2's block `<minimax:tool_call><invoke name="NAME"><parameter name="P">value</parameter></invoke>...
</minimax:tool_call>`, which holds one call per `<invoke>`; and the sections of special-token calls: DeepSeek-V3's
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>...
<｜tool▁calls▁end｜>`, DeepSeek-V3.1's `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` in the same
section, and Kimi-K2's `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{...}<|tool_call_end|>...<|tool_calls_section_end|>`. A section's calls come one by one, each once the marker after
its end (the next call's begin, or the section's end) has arrived; the section's markers and the layout between its
calls are shared out among their raw as in a MiniMax block. The form is read off each call as it comes (no per-model
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

Call ids are `{id_prefix}{n}`, but for Kimi-K2's calls, which carry their own: the id as the model wrote it,
`functions.NAME:IDX` (IDX counting the conversation's calls), which its template writes back in the call and in the
`## Return of ID` heading of the call's result, so the result names the call as the model did (a turn that writes one
id twice gets `{id_prefix}{n}` for the second).

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
# sections of special-token calls: section open -> (section close, call open, call close)
DEEPSEEK_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
DEEPSEEK_CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
DEEPSEEK_SEP = "<｜tool▁sep｜>"
KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
SECTIONS = {DEEPSEEK_SECTION[0]: (DEEPSEEK_SECTION[1], *DEEPSEEK_CALL), KIMI_SECTION[0]: (KIMI_SECTION[1], *KIMI_CALL)}
_DEEPSEEK_V3 = re.compile(r"\s*([^\s`]+)\s*\n```(?:json)?[ \t]*\n(.*)\n[ \t]*```\s*\Z", re.S)  # NAME, fenced JSON
_KIMI_ID = re.compile(r"\s*(?:functions\.)?([^\s:]+):(\d+)\s*\Z")  # functions.NAME:IDX
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
    id: str | None = None  # the call's own id where the form writes one (Kimi-K2's functions.NAME:IDX)


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
        self._section: str | None = None  # in a section of special-token calls: its open tag
        self._prefix = ""  # in a section: its text not yet in a call's raw (the section's open tag, layout)
        self._held: tuple[_Read, str, str | None] | None = None  # a section's read call until the next marker
        self._ids: set[str] = set()  # the ids given so far

    def feed(self, delta: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("ToolCallParser.feed after finish(): use one parser per turn")
        self._buffer += delta
        events: list[Event] = []
        while True:
            if not self._in_call and self._section is not None:
                if not self._section_step(events):
                    return events
                continue
            if not self._in_call:
                found = [(self._buffer.find(tags[0]), tags) for tags in TAGS]
                found += [(self._buffer.find(tag), (tag, "")) for tag in SECTIONS]
                found = [(start, tags) for start, tags in found if start >= 0]
                if not found:
                    held = _partial_tag_length(self._buffer)
                    self._emit_text(events, self._buffer[:len(self._buffer) - held])
                    self._buffer = self._buffer[len(self._buffer) - held:]
                    return events
                start, tags = min(found, key=lambda f: f[0])
                self._emit_text(events, self._buffer[:start])
                if tags[0] in SECTIONS:
                    self._section, self._prefix = tags[0], tags[0]
                    self._buffer = self._buffer[start + len(tags[0]):]
                    continue
                self._tag = tags
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

    def _section_step(self, events: list[Event]) -> bool:
        """In a section, between calls: the next call's begin, or the section's end, settles the held call (its raw
        runs to there). False: the buffer holds neither yet."""
        section_close, call_open, call_close = SECTIONS[self._section]
        begin, end = self._buffer.find(call_open), self._buffer.find(section_close)
        if begin < 0 and end < 0:
            return False
        stop = begin if begin >= 0 and (end < 0 or begin < end) else end + len(section_close)
        gap, self._buffer = self._buffer[:stop], self._buffer[stop:]
        stray = gap[:-len(section_close)] if stop != begin else gap
        if self._held is not None:
            read, raw, error = self._held
            self._held = None
            if stray.strip():
                error = error or f"text between the calls of a {self._section} section: {stray.strip()[:40]!r}"
            events.append(self._new_call(read, raw + gap, error))
        else:
            self._prefix += gap
            if stop != begin:  # the section ends with no call in it
                events.append(self._new_call(_Read(), self._prefix, f"no {call_open} in the {self._section} section; "
                                             f"write {call_open}...{call_close} calls inside it"))
                self._prefix = ""
        if stop != begin:
            self._section = None
        else:
            self._tag, self._in_call, self._scanned = (call_open, call_close), True, len(call_open)
        return True

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
            elif self._held is not None:  # a section not closed after a whole call: the call stands
                read, raw, error = self._held
                whitespace = not self._buffer.strip()
                events.append(self._new_call(read, raw + (self._buffer if whitespace else ""), error))
                if not whitespace:
                    self._emit_text(events, self._buffer)
            elif self._section is not None:
                events.append(self._new_call(_Read(), self._prefix + self._buffer, "the output ended before "
                                             f"{SECTIONS[self._section][0]}: the {self._section} section is "
                                             "incomplete"))
            else:
                self._emit_text(events, self._buffer)
            self._held, self._section = None, None
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
        if self._section is not None:  # a section's call: held until the marker after it arrives
            read = self._check(_read_deepseek(body) if open_tag == DEEPSEEK_CALL[0] else _read_kimi(body))
            gap = self._prefix.removeprefix(self._section)
            if gap.strip():
                read.error = read.error or f"text in a {self._section} section before its call: {gap.strip()[:40]!r}"
            raw, self._prefix = self._prefix + raw, ""
            if error is not None:  # cut short, or a new call began inside it: no marker will settle it
                return [self._new_call(read, raw, error)]
            self._held = (read, raw, None)
            return []
        return [self._new_call(self._read(body), raw, error)]

    def _new_call(self, read: _Read, raw: str, error: str | None = None) -> ToolCall:
        # the call's own id, unless the turn already gave it to an earlier call (ids name one call each)
        call_id = read.id if read.id and read.id not in self._ids else f"{self.id_prefix}{self._calls}"
        self._ids.add(call_id)
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
            return _Read(read.name, read.arguments, f"unknown tool {read.name!r}; available tools: {known}", read.id)
        checker = self._checkers.get(read.name)
        if checker is None:
            checker = self._checkers[read.name] = ArgumentSchema(self.schemas[read.name])
        problems = checker.problems(read.arguments, "arguments")
        if problems:
            read.error = f"bad arguments for tool {read.name!r}: " + "; ".join(problems)
        return read


def _partial_tag_length(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of an open tag (0 if none)."""
    opens = [open_tag for open_tag, _ in TAGS] + list(SECTIONS)
    longest = max(len(open_tag) for open_tag in opens)
    for length in range(min(len(text), longest - 1), 0, -1):
        if any(open_tag.startswith(text[-length:]) and length < len(open_tag) for open_tag in opens):
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
    position, problems, pairs = 0, [], []
    for parameter in _PARAMETER.finditer(inner):
        if inner[position:parameter.start()].strip():
            problems.append(f"text outside <parameter=...>: {inner[position:parameter.start()].strip()[:40]!r}")
        position = parameter.end()
        pairs.append((parameter.group(1), parameter.group(2)))  # (the form puts each value on its own lines)
    arguments = _read_pairs(pairs, properties, problems)
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


def _json_arguments(text: str, name: str, expected: str) -> _Read:
    """A special-token call's arguments: one JSON object."""
    if not text.strip():
        return _Read(name, {})
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as error:
        return _Read(name, {}, f"the arguments are not valid JSON ({error}); {expected}")
    if not isinstance(arguments, dict):
        return _Read(name, {}, f"the arguments must be a JSON object, got {json_type(arguments)}; {expected}")
    return _Read(name, arguments)


def _read_deepseek(body: str) -> _Read:
    """DeepSeek-V3's `function<｜tool▁sep｜>NAME` + fenced JSON, or V3.1's `NAME<｜tool▁sep｜>{...}`."""
    expected = (f"expected function{DEEPSEEK_SEP}NAME\\n```json\\n{{...}}\\n``` (V3) or NAME{DEEPSEEK_SEP}{{...}} "
                "(V3.1)")
    left, sep, right = body.partition(DEEPSEEK_SEP)
    if not sep:
        return _Read(error=f"no {DEEPSEEK_SEP} in the call; {expected}")
    fenced = _DEEPSEEK_V3.match(right)
    if fenced is not None and left.strip() == "function":
        return _json_arguments(fenced.group(2), fenced.group(1), expected)
    name = left.strip()
    if not name or any(c.isspace() for c in name):
        return _Read(error=f"no tool name before {DEEPSEEK_SEP} (got {name[:40]!r}); {expected}")
    return _json_arguments(right, name, expected)


def _read_kimi(body: str) -> _Read:
    """Kimi-K2's `functions.NAME:IDX<|tool_call_argument_begin|>{...}`."""
    expected = f"expected functions.NAME:IDX{KIMI_ARGUMENTS}{{...}}"
    head, sep, arguments = body.partition(KIMI_ARGUMENTS)
    if not sep:
        return _Read(error=f"no {KIMI_ARGUMENTS} in the call; {expected}")
    call_id = _KIMI_ID.match(head)
    if call_id is None:
        return _Read(error=f"the call's id {head.strip()[:40]!r} is not functions.NAME:IDX; {expected}")
    read = _json_arguments(arguments, call_id.group(1), expected)
    read.id = head.strip()  # the id the template writes back, in the call and in its result
    return read


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

"""One choice's reply split into text and tool calls as it streams (`ReplyParser`), with each call's arguments
streamed in pieces: a `CallStart` (id, name) once the call's name is read and is an offered tool, `CallArguments`
fragments whose concatenation is the arguments JSON text the model wrote, and a `CallEnd` carrying the parsed call.

Arguments stream while they arrive only for the JSON form (`{"name": ..., "arguments": {...}}`, read by
`CallScanner`); a call in another form (the Qwen3-Coder XML form, GLM-4.5's `<arg_key>` form, each `<invoke>` of a
MiniMax-M2 block, each call of a DeepSeek-V3 / V3.1 or Kimi-K2 section, which the parser gives once the marker after
it arrives, arguments given as a JSON string) starts when it is complete and carries its arguments in one fragment. The arguments text of a call is the same streamed or not: the object as
the model wrote it when the scanner could read it (and it parses to the call's arguments), else `json.dumps` of them.

A harmony model's reply (gpt-oss; `harmony`) is read by tsterm.agent.harmony's parser from the text of its ids with
their markers (`tokenizer` given: `text`): its analysis channel comes out as `Reasoning` pieces, its final channel and
commentary preambles as text, and each `to=functions.NAME` message as a call whose arguments (the message's content,
the JSON as the model wrote it) stream as they arrive. A tokenizer whose call markers are special tokens (Kimi-K2's)
is read the same way, by the tag parser, the stop token left out.

A call is only started once its name is a tool the request offered; a call that then turns out malformed (bad JSON,
arguments failing the schema, cut short) cannot be taken back: it ends with a `CallEnd` whose call is not `ok`, and
the client keeps what was streamed. A malformed call that was never started is text, as in a non-streamed reply.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tsterm.agent.harmony import HarmonyParser, ReasoningDelta, TurnText, call_arguments
from tsterm.agent.tool_calls import TAGS, TextDelta, ToolCall, ToolCallParser

ARGUMENT_KEYS = ("arguments", "parameters")  # the keys ToolCallParser reads a JSON-form call's arguments from


class CallScanner:
    """Follows a JSON-form call body as it grows (append-only): `name` once its string is complete, and the span of
    the arguments object as far as it has arrived (`arguments_start`, `arguments_end` once closed). Not the JSON
    form, arguments that are not an object, or broken JSON: the scanner stops and leaves what it has not read None."""

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self.arguments_start: int | None = None
        self.arguments_end: int | None = None
        self._depth = 0
        self._in_string = self._escape = False
        self._string_start = 0
        self._expect = "open"  # open -> key -> colon -> value -> (string | literal | nested) -> comma -> key ...
        self._key: str | None = None
        self._nested_key: str | None = None  # the depth-1 key whose object/array value is being read

    def feed(self, more: str) -> None:
        start, self.text = len(self.text), self.text + more
        for i in range(start, len(self.text)):
            if self._expect == "stop":
                return
            self._step(i, self.text[i])

    def arguments_so_far(self) -> str:
        """The arguments object's text read so far ("" before it begins)."""
        if self.arguments_start is None:
            return ""
        end = len(self.text) if self.arguments_end is None else self.arguments_end
        return self.text[self.arguments_start:end]

    def _step(self, i: int, char: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1:
                    self._end_string(json.loads(self.text[self._string_start:i + 1]))
            return
        if char.isspace():
            return
        depth, expect = self._depth, self._expect
        if char == '"':
            self._in_string, self._string_start = True, i
            if depth == 1:
                self._expect = {"key": "key", "value": "string"}.get(expect, "stop")
        elif char in "{[":
            if depth == 0:
                self._expect = "key" if char == "{" and expect == "open" else "stop"
            elif depth == 1:
                if expect != "value":
                    self._expect = "stop"
                    return
                self._expect, self._nested_key = "nested", self._key
                if char == "{" and self._key in ARGUMENT_KEYS and self.arguments_start is None:
                    self.arguments_start = i
            self._depth += 1
        elif char in "}]":
            if depth >= 2:
                self._depth -= 1
                if self._depth == 1:
                    if self._nested_key in ARGUMENT_KEYS and self.arguments_start is not None \
                            and self.arguments_end is None:
                        self.arguments_end = i + 1
                    self._expect = "comma"
            elif depth == 1 and char == "}" and expect in ("comma", "literal", "key"):
                self._depth, self._expect = 0, "done"
            else:
                self._expect = "stop"
        elif depth == 1 and char == ":" and expect == "colon":
            self._expect = "value"
        elif depth == 1 and char == "," and expect in ("comma", "literal"):
            self._expect = "key"
        elif depth == 1 and expect == "value":
            self._expect = "literal"
        elif depth != 1 or expect != "literal":
            self._expect = "stop" if depth <= 1 else expect

    def _end_string(self, value: str) -> None:
        if self._expect == "key":
            self._key, self._expect = value, "colon"
        else:  # a string value
            if self._key == "name" and self.name is None:
                self.name = value
            self._expect = "comma"


def _body(raw: str) -> str:
    """A call's raw text after its block's open tag (a MiniMax block's later calls have none)."""
    open_tag = next((tag for tag, _ in TAGS if raw.startswith(tag)), "")
    return raw[len(open_tag):]


def arguments_text(call: ToolCall) -> str:
    """A complete call's arguments as the client gets them (see the module docstring)."""
    written = call_arguments(call)  # a harmony call: its content is the arguments object
    if not written:
        scanner = CallScanner()
        scanner.feed(_body(call.raw))
        written = scanner.arguments_so_far() if scanner.arguments_end is not None else ""
    return written if _same_arguments(written, call.arguments) else json.dumps(call.arguments, ensure_ascii=False)


def _same_arguments(text: str, arguments: dict) -> bool:
    """Whether `text` is JSON for exactly `arguments` (then the client gets the model's own text)."""
    try:
        return json.loads(text) == arguments
    except json.JSONDecodeError:
        return False


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's position among this reply's calls
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next fragment of the arguments JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int
    call: ToolCall  # `call.ok` False: a started call turned out malformed


@dataclass(frozen=True)
class Reasoning:
    text: str  # the next piece of the reply's reasoning (a harmony reply's analysis channel)


Piece = str | Reasoning | CallStart | CallArguments | CallEnd


@dataclass
class _Streaming:
    id: str
    scanner: CallScanner = field(default_factory=CallScanner)
    index: int | None = None  # set once started
    sent: int = 0  # characters of the arguments object sent


class ReplyParser:
    """One choice's reply as pieces, fed delta by delta. `stop_at`: a stop string that ended the reply at a call's
    close tag (a request for one call), put back so that the call is complete. `tokenizer`: given where the reply is
    read from its ids with their special tokens (`text`); `harmony`: by a HarmonyParser (its channels are always
    split; with `parse` false no call is offered, so a call message stays text)."""

    def __init__(self, offered: list[dict] | None, parse: bool, *, prefix: str = "call", stop_at: str | None = None,
                 tokenizer: Any = None, harmony: bool = False):
        id_prefix = f"{prefix}_{uuid.uuid4().hex[:12]}_"
        self.harmony = harmony
        self.turn = TurnText(tokenizer, keep_stop=harmony) if tokenizer is not None else None
        self.parser: HarmonyParser | ToolCallParser | None
        if harmony:
            self.parser = HarmonyParser(offered if parse else [], id_prefix=id_prefix)
        else:
            self.parser = ToolCallParser(offered, id_prefix=id_prefix) if parse else None
        self.stop_at = stop_at
        self.calls: list[ToolCall] = []  # the valid calls so far
        self.started = 0  # calls streamed so far (valid or not)
        self._current: _Streaming | None = None

    def text(self, output: Any, whole: bool = False) -> str:
        """What to feed for an engine output (a CompletionOutput): its `delta_text` (its `text` when `whole`), or for
        a harmony reply the text its new ids add, markers included."""
        if self.turn is not None:
            stop = output.stop_reason  # the stop token's id where one ended the reply
            return self.turn.feed(output.token_ids, output.finish_reason is not None,
                                  (stop,) if isinstance(stop, int) else ())
        return output.text if whole else output.delta_text

    def feed(self, delta: str, final: bool, stop_reason: Any = None) -> list[Piece]:
        if final and self.stop_at is not None and stop_reason == self.stop_at:
            delta += self.stop_at
        if self.parser is None:
            return [delta] if delta else []
        events = self.parser.feed(delta) if delta else []
        if final:
            events += self.parser.finish()
        pieces: list[Piece] = []
        for event in events:
            if isinstance(event, TextDelta):
                pieces.append(event.text)
            elif isinstance(event, ReasoningDelta):
                pieces.append(Reasoning(event.text))
            else:
                self._end(event, pieces)
        if not final and (pending := self.parser.pending) is not None:
            if self.harmony:
                self._advance_written(*pending, pieces)
            else:
                self._advance(*pending, pieces)
        return _merge_text(pieces)

    def _advance_written(self, call_id: str, name: str, arguments: str, pieces: list[Piece]) -> None:
        """A harmony call being read: started once its name is an offered tool, its arguments (the message's
        content) streamed as they grow."""
        current = self._current
        if current is None or current.id != call_id:
            current = self._current = _Streaming(call_id)
        if current.index is None:
            if not self.parser.accepts(name):
                return
            current.index, self.started = self.started, self.started + 1
            pieces.append(CallStart(current.index, call_id, name))
        if arguments[current.sent:]:
            pieces.append(CallArguments(current.index, arguments[current.sent:]))
            current.sent = len(arguments)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """'tool_calls' when the reply holds a valid call, or streamed one that max_tokens did not cut short."""
        if self.calls or (self.started and engine_reason != "length"):
            return "tool_calls"
        return engine_reason

    def _advance(self, call_id: str, body: str, pieces: list[Piece]) -> None:
        current = self._current
        if current is None or current.id != call_id:
            current = self._current = _Streaming(call_id)
        scanner = current.scanner
        scanner.feed(body[len(scanner.text):])
        if current.index is None:
            if scanner.name is None or not self.parser.accepts(scanner.name):
                return
            current.index, self.started = self.started, self.started + 1
            pieces.append(CallStart(current.index, call_id, scanner.name))
        fragment = scanner.arguments_so_far()[current.sent:]
        if fragment:
            current.sent += len(fragment)
            pieces.append(CallArguments(current.index, fragment))

    def _end(self, call: ToolCall, pieces: list[Piece]) -> None:
        current, self._current = self._current, None
        if current is None or current.id != call.id or current.index is None:  # never started: whole, or text
            if not call.ok:
                pieces.append(call.raw)  # a malformed call is not a call: the client sees what the model wrote
                return
            index, self.started = self.started, self.started + 1
            pieces += [CallStart(index, call.id, call.name), CallArguments(index, arguments_text(call))]
        elif self.harmony:  # a harmony call: the rest of its content
            index = current.index
            if rest := call_arguments(call)[current.sent:]:
                pieces.append(CallArguments(index, rest))
        else:
            index, scanner = current.index, current.scanner
            scanner.feed(_body(call.raw)[len(scanner.text):])
            if scanner.arguments_start is None:  # arguments not readable while streaming: sent whole now
                if call.ok:
                    pieces.append(CallArguments(index, arguments_text(call)))
            elif fragment := scanner.arguments_so_far()[current.sent:]:
                pieces.append(CallArguments(index, fragment))
        if call.ok:
            self.calls.append(call)
        pieces.append(CallEnd(index, call))


def _merge_text(pieces: list[Piece]) -> list[Piece]:
    merged: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        elif isinstance(piece, Reasoning) and merged and isinstance(merged[-1], Reasoning):
            merged[-1] = Reasoning(merged[-1].text + piece.text)
        elif piece != "" and piece != Reasoning(""):
            merged.append(piece)
    return merged

"""gpt-oss's harmony format in the agent loop, the server and the chat paths: a turn's tool calls read and checked, the
grammar of a turn, the choice of parser, and the chat views' reader. The format itself (rendering, the messages of a
turn, `is_harmony`, `TurnText`) is `tsterm.harmony`, below the agent so that the offline API (`LLM.chat`) renders and
reads it too; its names are re-exported here, so `from tsterm.agent.harmony import render` keeps working.

What each message of a turn is, as `HarmonyParser` gives it (on `tsterm.harmony.HarmonyStream`):

- `analysis`: reasoning (`ReasoningDelta`), streamed as it comes;
- `commentary` to `functions.NAME`: a tool call, its content the JSON arguments, ended by `<|call|>` (`ToolCall`);
- `final`, or `commentary` with no recipient (a preamble the user may see): text (`TextDelta`), streamed.

`HarmonyParser.feed(delta)` returns the events the delta completes; a marker split across deltas is held back until
it is whole. `finish()` ends the turn: a call without its `<|call|>` becomes a call with an error, and text that never
reached a `<|message|>` (a reply that is not harmony at all) is released as text. A call is checked as
`tsterm.agent.tool_calls.ToolCallParser` checks one (a known tool, arguments an object valid against its schema);
a malformed one carries an `error` to hand back to the model.

`pending` is the call being read (its id, name and arguments text so far), so a server streams a call's arguments
as they arrive.

Which parser a model's replies need is `turn_parser`'s choice (`is_harmony`), the one choice the agent loop and the
server both make. A harmony turn's markers are special tokens, which the engine's text leaves out: `TurnText` decodes
the turn's ids with them. So do the call markers of Kimi-K2's and DeepSeek's tokenizers where they are special tokens
(Kimi-K2's are): `reads_special_tokens` says when a turn is read that way (then without the stop token that ended
it, which harmony's parser alone reads).

Prompts are rendered by `render` (`HarmonyChat`, `chat_tokenizer`): see `tsterm.harmony`.

The chat paths (the TUI's chat and API sessions, the line chat) ask `chat_format` (tsterm.chat.chat_format's seam):
for harmony, `HarmonyFormat` renders with `render` and reads a reply with `HarmonyReply` (analysis shown as a `<think>`
block, final as the reply, recorded as content + reasoning_content).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tsterm.agent.schema import ArgumentSchema
from tsterm.agent.tool_calls import SECTIONS, TextDelta, ToolCall, ToolCallParser, _tool_schemas
from tsterm.chat.chat_format import TemplateFormat, shown_reply
from tsterm.errors import RequestError
from tsterm.harmony import (CALL, CHANNEL, CHANNELS, CONSTRAIN, END, ENDS, EFFORTS, FUNCTIONS, FUNCTIONS_RULE,
                            HARMONY_TOKENS, KNOWLEDGE_CUTOFF, MESSAGE, MODEL_IDENTITY, REASONING_KEYS, RETURN, START,
                            Ended, HarmonyChat, HarmonyStream, Header, Loose, ReasoningDelta, TurnText,
                            chat_tokenizer, is_harmony, render, typescript)

__all__ = ["CALL", "CHANNEL", "CHANNELS", "CONSTRAIN", "EFFORTS", "END", "ENDS", "Event", "FUNCTIONS",
           "FUNCTIONS_RULE", "HARMONY_TOKENS", "HarmonyChat", "HarmonyFormat", "HarmonyParser", "HarmonyReply",
           "Header", "KNOWLEDGE_CUTOFF", "MESSAGE", "MODEL_IDENTITY", "REASONING_KEYS", "RETURN", "START",
           "ReasoningDelta", "TurnText", "call_arguments", "chat_format", "chat_tokenizer", "is_harmony", "parse",
           "reads_special_tokens", "render", "turn_grammar", "turn_parser", "typescript"]

Event = TextDelta | ReasoningDelta | ToolCall


class HarmonyParser:
    """Splits one assistant turn in harmony into reasoning, text and tool calls. `tools`: OpenAI-style specs as for
    `ToolCallParser` (None: any name and arguments object). Call ids are `{id_prefix}{n}`."""

    def __init__(self, tools: Iterable[Mapping[str, Any]] | None = None, *, id_prefix: str = "call_"):
        self.schemas = None if tools is None else _tool_schemas(tools)
        self._checkers: dict[str, ArgumentSchema] = {}
        self.id_prefix = id_prefix
        self._stream = HarmonyStream()
        self._calls = 0

    def feed(self, delta: str) -> list[Event]:
        if self._stream.finished:
            raise RuntimeError("HarmonyParser.feed after finish(): use one parser per turn")
        return self._events(self._stream.feed(delta))

    @property
    def pending(self) -> tuple[str, str, str] | None:
        """The call being read, if any: (the id it will get, the tool's name, its arguments text so far). The text
        only grows until the call ends."""
        header = self._stream.header
        if header is None or not header.is_call or self._stream.finished:
            return None
        return f"{self.id_prefix}{self._calls}", header.recipient[len(FUNCTIONS):], self._stream.content

    def accepts(self, name: str) -> bool:
        """Whether `name` is a tool this parser was given (any name when it was given none)."""
        return self.schemas is None or name in self.schemas

    def finish(self) -> list[Event]:
        return self._events(self._stream.finish())

    def _events(self, pieces: list) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, Loose):
                events.append(TextDelta(piece.text))
            elif isinstance(piece, Ended):
                if piece.header.is_call:
                    error = None
                    if piece.tag is None:
                        error = f"the output ended before {CALL}: the call is incomplete"
                    elif piece.tag != CALL:
                        error = f"a tool call's message ends with {CALL}, not {piece.tag}"
                    events.append(self._call(piece, error))
            elif piece.header.is_call or piece.header.recipient is not None:
                continue  # a call's arguments (read whole at its end), or a message to a built-in tool: not shown
            elif piece.header.channel == "analysis":
                events.append(ReasoningDelta(piece.text))
            else:  # final, or a commentary preamble to the user
                events.append(TextDelta(piece.text))
        return events

    def _call(self, piece: Ended, error: str | None) -> ToolCall:
        name = piece.header.recipient[len(FUNCTIONS):]
        arguments: dict[str, Any] = {}
        problem = None
        try:
            value = json.loads(piece.content) if piece.content.strip() else {}
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
        call = ToolCall(f"{self.id_prefix}{self._calls}", name, arguments, piece.raw, error or problem)
        self._calls += 1
        return call


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


def call_arguments(call: ToolCall) -> str:
    """A harmony call's arguments as the model wrote them (its message's content), or "" for another form."""
    head, sep, content = call.raw.partition(MESSAGE)
    return content.removesuffix(CALL) if sep and FUNCTIONS in head else ""


# ---- which format a model writes


def turn_parser(tokenizer: Any, tools: Iterable[Mapping[str, Any]] | None, *, id_prefix: str = "call_",
                model_type: str | None = None) -> HarmonyParser | ToolCallParser:
    """The parser of one assistant turn of this model: `HarmonyParser` for harmony, else `ToolCallParser` (which
    reads every tag and token form of the other families)."""
    if is_harmony(tokenizer, model_type):
        return HarmonyParser(tools, id_prefix=id_prefix)
    return ToolCallParser(tools, id_prefix=id_prefix)


def reads_special_tokens(tokenizer: Any, model_type: str | None = None) -> bool:
    """Whether this model's turns are read with their special tokens (`TurnText`): harmony's, or a tokenizer that
    holds a family's tool-call markers (Kimi-K2's, DeepSeek's sections) as special tokens, which the engine's text
    leaves out (a marker whose id decodes to nothing without special tokens)."""
    if is_harmony(tokenizer, model_type):
        return True
    token_to_id = getattr(tokenizer, "token_to_id", None)
    if token_to_id is None:
        return False
    markers = [marker for section, (close, call_open, call_close) in SECTIONS.items()
               for marker in (section, close, call_open, call_close)]
    ids = [token_id for token_id in map(token_to_id, markers) if token_id is not None]
    return any(tokenizer.decode([token_id], skip_special_tokens=True) == "" for token_id in ids)


# ---- the grammar of a harmony turn


def turn_grammar(tokens: Any, parameters: Mapping[str, Mapping[str, Any]], *, required: bool) -> str:
    """The Lark grammar (llguidance's; `tokens` as tsterm.agent.tool_grammar's `TemplateTokens`) of one harmony
    turn: any analysis messages and commentary preambles, then a final answer, or a call of a tool named in
    `parameters` (`required`: a call only) whose arguments are held to the schema given for it. A call is written as
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}` (the form of the format's own
    examples); the turn ends on the engine's stop tokens (`<|call|>`, `<|return|>`), which it allows where the grammar
    is complete. Text cannot hold a marker (they are special tokens)."""
    from tsterm.agent.tool_grammar import lark

    def special(marker: str) -> str:
        piece = lark(tokens, marker)
        if not (piece.startswith("<[") and " " not in piece):
            raise RequestError(f"the tokenizer does not hold harmony's {marker} as one special token")
        return piece

    start, channel, message, end, constrain = (special(m) for m in (START, CHANNEL, MESSAGE, END, CONSTRAIN))
    lines = ["start: (other next)* last",
             f'next: {start} "assistant"',
             f'other: {channel} "analysis" {message} TEXT {end} | {channel} "commentary" {message} TEXT {end}',
             "last: call" if required else f'last: {channel} "final" {message} TEXT | call',
             "TEXT: /(?s:.*)/",
             "call: " + " | ".join(f"fn_{i}" for i in range(len(parameters)))]
    for i, (name, schema) in enumerate(parameters.items()):
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ",",
                                           "key_separator": ":"}}
        lines.append(f'fn_{i}: {channel} {json.dumps(f"commentary to={FUNCTIONS}{name} ")} {constrain} "json" '
                     f"{message} args_{i}")
        lines.append(f"args_{i}: %json " + json.dumps(schema))
    return "\n".join(lines)


# ---- the chat paths' format (tsterm.chat.chat_format)


class HarmonyReply:
    """One harmony reply read for a chat view (tsterm.chat.chat_format's ReplyReader): its ids with their markers
    (`TurnText`) through `HarmonyParser`; the analysis channel shown as reasoning, the final channel (and commentary
    preambles) as the answer; a `to=functions.NAME` message (an API client's tools) is one of `calls`, not shown."""

    def __init__(self, tokenizer: Any):
        self._turn = TurnText(tokenizer)
        self._parser = HarmonyParser(None)
        self.reasoning = self.text = self.shown = ""
        self.calls: list[ToolCall] = []
        self._done = False

    def read(self, completion: Any, final: bool = False) -> str:
        if self._done:
            return ""
        self._done = final
        events = self._parser.feed(self._turn.feed(completion.token_ids, final))
        if final:
            events += self._parser.finish()
        for event in events:
            if isinstance(event, ReasoningDelta):
                self.reasoning += event.text
            elif isinstance(event, TextDelta):
                self.text += event.text
            else:
                self.calls.append(event)
        shown = shown_reply(self.reasoning, self.text, thinking_done=final)
        delta = shown[len(self.shown):] if shown.startswith(self.shown) else shown
        self.shown = shown
        return delta

    def message(self) -> dict:
        message = {"role": "assistant", "content": self.text}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": call_arguments(call)}} for call in self.calls]
        return message


class HarmonyFormat:
    """gpt-oss's chat format for the chat paths: prompts rendered by `render`, replies read by `HarmonyReply`."""

    name = "harmony"

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
        return render(messages, None, True, **template_kwargs)

    def reader(self) -> HarmonyReply:
        return HarmonyReply(self.tokenizer)


def chat_format(tokenizer: Any, model_type: str | None = None) -> Any:
    """The format of this model's chat turns (tsterm.chat.chat_format): `HarmonyFormat` for harmony (`is_harmony`,
    the agent loop's and the server's choice), else the checkpoint's template (`TemplateFormat`)."""
    if is_harmony(tokenizer, model_type):
        return HarmonyFormat(tokenizer.tokenizer if isinstance(tokenizer, HarmonyChat) else tokenizer)
    return TemplateFormat(tokenizer)

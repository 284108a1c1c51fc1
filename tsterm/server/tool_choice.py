"""What a request's tools and tool_choice ask of generation (`ToolUse`), and the grammar that enforces it.

tool_choice "required" (Anthropic "any") and a named tool constrain generation with a grammar (`call_grammar`, a Lark
grammar the engine's llguidance masks by; the prompt is the template's, as for "auto"): the reply is one or more
calls, each written as the model's chat template writes an assistant tool call (the Hermes form: the open tag, the
JSON object `{"name": ..., "arguments": ...}` whose name is an allowed tool's and whose arguments follow that tool's
`parameters` schema, the close tag), separated as the template separates them. A named tool (and `parallel_tool_calls:
false`, Anthropic `disable_parallel_tool_use`) allows exactly one call: the grammar ends after it and the reply
finishes with "stop". Reasoning: where the generation prompt leaves a `<think>` block open, the reply finishes it
before its calls; where the request sets `enable_thinking: true` (chat_template_kwargs, or Anthropic `thinking`), a
reply may open with a `<think>...</think>` block; otherwise the calls come first (a model that reasons on its own,
unasked, is not let to under a required call). So a reply is a valid call by construction; what is left for the 422
(`tool_choice_unsatisfied`) is a reply cut short by max_tokens before its first call was whole. A template that
renders no tool call tsterm's parser reads gets a 400 (`tool_choice_unsupported`): the choice cannot be enforced. With
tool_choice "auto" and a function marked `strict: true`, the reply is free text then any calls, the strict functions'
arguments held to their schemas (the others' to any object); this needs a template whose open tag is a special token
(text cannot hold it, so text and calls are told apart): with a text open tag, "auto" is not constrained. Otherwise
"auto" constrains nothing, and `parallel_tool_calls: false` stops the reply at its first call's close tag.
"""
from __future__ import annotations

import dataclasses
import json

from tsterm.agent.tool_calls import CLOSE_TAG, OPEN_TAG, TextDelta, ToolCall, ToolCallParser
from tsterm.config import SamplingParams, StructuredOutputs
from tsterm.errors import TstermError
from tsterm.server.errors import APIError
from tsterm.server.state import ServerState
from tsterm.server.tool_stream import ReplyParser


@dataclasses.dataclass
class ToolUse:
    """What a request's tools and tool_choice ask of generation."""

    offered: list[dict] | None  # rendered by the template; None: no tools in the prompt
    parse: bool  # split the reply into content and tool_calls
    required: bool  # tool_choice required/any or a named tool: the reply is calls (`call_grammar`)
    name: str | None = None  # tool_choice named this tool
    single: bool = False  # at most one call (the grammar's, or under "auto" a stop at the first call's close tag)
    strict: bool = False  # "auto" with a `strict: true` function: text, then any calls, those functions' held to schema

    @property
    def stop_at(self) -> str | None:
        """Under tool_choice "auto" with one call allowed: the stop string that ends the reply after its first call
        (a required call's grammar ends there by itself)."""
        return CLOSE_TAG if self.single and self.parse and not self.required else None


_PROBE = [{"role": "user", "content": "?"}]


def call_grammar(state: ServerState, tools: ToolUse, prompt_ids: list[int],
                 thinking: bool) -> StructuredOutputs | None:
    """The grammar of the replies `tools` allows (tool_choice required / any / a named tool, or "auto" with a strict
    function: None where the template's open tag is text, which free text could not be told from): see the module's
    docstring. `prompt_ids`: the request's prompt (a generation prompt that leaves a `<think>` block open makes the
    reply finish it before its calls); `thinking`: the request asked for reasoning (`enable_thinking`), so a reply may
    open with a reasoning block. A 400 where the template does not render tool calls in a form the grammar follows."""
    try:
        form = call_form(state)
    except APIError:
        if tools.required:
            raise
        return None  # "auto": a template whose calls the grammar cannot follow leaves the reply unconstrained
    if not tools.required and not form.open.startswith("<["):
        return None
    names = [tools.name] if tools.name else [t["function"]["name"] for t in tools.offered or []]
    specs = {t["function"]["name"]: t["function"] for t in tools.offered or []}
    schemas = []
    for name in names:
        parameters = specs[name].get("parameters") or {"type": "object"}
        if not tools.required and not specs[name].get("strict"):
            parameters = {"type": "object"}  # "auto": only a strict function's arguments are held to its schema
        properties = {"name": {"const": name}, "arguments": parameters}
        schemas.append({"type": "object", "properties": {k: properties[k] for k in form.keys},
                        "required": list(form.keys), "additionalProperties": False})
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if form.separators is not None:  # the JSON spaced as the template writes it (what the model learned)
        schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": form.separators[0],
                                "key_separator": form.separators[1]}
    tail = state.tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
    opened = tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)  # the generation prompt opened the reasoning
    think = _think_rules(state, opened) if opened or thinking else ()
    calls = "tc" if tools.single else f"tc ({form.separator} tc)*"
    if not tools.required:  # text (which cannot hold the open tag: a special token), then any calls
        calls = f"text ({calls})?"
    lines = [f"start: think {calls}" if think else f"start: {calls}",
             f"tc: {form.open} call {form.close}",
             "call: %json " + json.dumps(schema), *think]
    if not tools.required:
        lines.append("text: /(?s:.*)/")
    return StructuredOutputs(grammar="\n".join(lines))


def _think_rules(state: ServerState, opened: bool) -> tuple[str, ...]:
    """Lark rules of `think`: a reasoning block before the calls; where the prompt `opened` it, its rest (required),
    otherwise an optional `<think>...</think>`."""
    opening = "" if opened else _lark(state, THINK_OPEN) + " "
    closing = _lark(state, THINK_CLOSE)
    optional = "" if opened else "?"
    if closing.startswith("<[") and " " not in closing:  # one special token: no text holds it, any text precedes it
        return (f"think: ({opening}/(?s:.*)/ {closing} /\\n{{0,2}}/){optional}",)
    # text: the reasoning ends at the close tag's first occurrence (llguidance's stop, which consumes it)
    return (f"think: ({opening}think_text /\\n{{0,2}}/){optional}",
            f"think_text[stop={json.dumps(THINK_CLOSE)}]: /(?s:.*)/")


@dataclasses.dataclass(frozen=True)
class CallForm:
    """How the chat template writes an assistant's tool calls, as Lark pieces: `open` (the open tag and what precedes
    the JSON), `close` (what follows it, up to the close tag), `separator` (between two calls), `keys` (the JSON
    object's keys in the template's order), `separators` (the JSON's item and key separators where the template
    writes them as json.dumps does, spaced or compact; None: any whitespace)."""

    open: str
    close: str
    separator: str
    keys: tuple[str, ...]
    separators: tuple[str, str] | None


def call_form(state: ServerState) -> CallForm:
    """Read off the template: the reply of one call and of two, rendered after a probe."""
    tokenizer = state.tokenizer

    def reply(message: dict) -> str:
        head = list(tokenizer.apply_chat_template(_PROBE, tools=[], add_generation_prompt=True, tokenize=True))
        ids = list(tokenizer.apply_chat_template(_PROBE + [{"role": "assistant", "content": "", **message}], tools=[],
                                                 add_generation_prompt=False, tokenize=True))
        if ids[:len(head)] != head:
            raise _cannot_force("the chat template renders an assistant reply that does not continue its "
                                "generation prompt")
        return tokenizer.decode(ids[len(head):], skip_special_tokens=False)

    def call(name: str) -> dict:
        return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": {"a": "x"}}}

    try:
        one, two = reply({"tool_calls": [call("a")]}), reply({"tool_calls": [call("a"), call("b")]})
    except TstermError as e:
        raise _cannot_force(f"the chat template failed to render a tool call ({e})") from e
    if not _renders_call(one, "a", {"a": "x"}):
        raise _cannot_force("the chat template does not render an assistant tool call as a reply that begins with a "
                            "<tool_call> tsterm's parser reads")
    start = one.index(OPEN_TAG)
    stop = one.index(CLOSE_TAG, start)
    inner = one[start + len(OPEN_TAG):stop]
    first, last = inner.find("{"), inner.rfind("}") + 1
    try:
        written = json.loads(inner[first:last])
    except ValueError:
        written = {}
    keys = tuple(written)
    separators = next((pair for pair in ((", ", ": "), (",", ":"))
                       if json.dumps(written, separators=pair) == inner[first:last]), None)
    if first < 0 or set(keys) != {"name", "arguments"}:
        raise _cannot_force("the chat template does not write a call as the JSON object {\"name\", \"arguments\"}")
    head, tail = one[start:start + len(OPEN_TAG) + first], inner[last:] + CLOSE_TAG
    block = one[start:stop + len(CLOSE_TAG)]
    separator = "\n"
    if two.count(OPEN_TAG) == 2:
        after = two.index(block) + len(block)
        separator = two[after:two.index(OPEN_TAG, after)]
    return CallForm(_lark(state, head), _lark(state, tail), _lark(state, separator) if separator else '""', keys,
                    separators)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def _lark(state: ServerState, text: str) -> str:
    """`text` as a Lark sequence: its special tokens as llguidance's token references (`<[id]>`; a literal would
    never match them), the rest as string literals."""
    tokenizer, special = state.tokenizer, state.special_token
    pieces, run = [], []
    for token_id in tokenizer.encode(text):
        if special(token_id):
            if run:
                pieces.append(json.dumps(tokenizer.decode(run, skip_special_tokens=False)))
                run = []
            pieces.append(f"<[{token_id}]>")
        else:
            run.append(token_id)
    if run:
        pieces.append(json.dumps(tokenizer.decode(run, skip_special_tokens=False)))
    return " ".join(pieces) or '""'


def _renders_call(reply: str, name: str, arguments: dict) -> bool:
    parser = ToolCallParser(None)
    events = parser.feed(reply) + parser.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    before = events[:events.index(calls[0])] if calls else []
    return bool(calls) and calls[0].ok and calls[0].name == name and calls[0].arguments == arguments and \
        not "".join(e.text for e in before if isinstance(e, TextDelta)).strip()


def _cannot_force(why: str) -> APIError:
    return APIError(400, f"tool_choice \"required\" or a named tool cannot be enforced with this model: {why}; use "
                    "tool_choice \"auto\"", param="tool_choice", code="tool_choice_unsupported")


def reply_parser(tools: ToolUse, prefix: str = "call") -> ReplyParser:
    """A parser for one choice's reply (a one-call stop is put back)."""
    return ReplyParser(tools.offered, tools.parse, prefix=prefix, stop_at=tools.stop_at)


def stop_at_call_end(params: SamplingParams, tools: ToolUse) -> SamplingParams:
    """`params` stopping at the first call's close tag where "auto" allows one call."""
    if tools.stop_at is None:
        return params
    return dataclasses.replace(params, stop=[*(params.stop or []), tools.stop_at])


def unsatisfied() -> APIError:
    return APIError(422, "tool_choice required a tool call and the reply was held to one, but it was cut short by "
                    "max_tokens before its first call was whole; retry with a larger max_tokens, or use tool_choice "
                    "\"auto\"", code="tool_choice_unsatisfied", param="tool_choice")

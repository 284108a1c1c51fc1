"""What a request's tools and tool_choice ask of generation (`ToolUse`), and the grammar that enforces it.

tool_choice "required" (Anthropic "any") and a named tool constrain generation with a grammar (`call_grammar`, a Lark
grammar the engine's llguidance masks by; the prompt is the template's, as for "auto"): the reply is one or more
calls, each written as the model's chat template writes an assistant tool call (the Hermes form: the open tag, the
JSON object `{"name": ..., "arguments": ...}` whose name is an allowed tool's and whose arguments follow that tool's
`parameters` schema, the close tag; or the Qwen3-Coder XML form: the open tag, `<function=NAME>` of an allowed tool,
its parameters in its schema's order, the required ones required, each `<parameter=P>` + a value + `</parameter>`,
a string's value any text without `</parameter>`, another type's JSON of its schema, then `</function>` and the
close tag), separated as the template separates them. A named tool (and `parallel_tool_calls:
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
import re
from typing import Any

from tsterm.agent.tool_calls import _JSON_TYPES, CLOSE_TAG, OPEN_TAG, TextDelta, ToolCall, ToolCallParser
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
    parameters = {}
    for name in names:
        parameters[name] = specs[name].get("parameters") or {"type": "object"}
        if not tools.required and not specs[name].get("strict"):
            parameters[name] = {"type": "object"}  # "auto": only a strict function's arguments are held to its schema
    call_rules = _xml_call_rules(form.xml, parameters) if form.xml else _json_call_rules(form, parameters)
    tail = state.tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False)
    opened = tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)  # the generation prompt opened the reasoning
    think = _think_rules(state, opened) if opened or thinking else ()
    calls = "tc" if tools.single else f"tc ({form.separator} tc)*"
    if not tools.required:  # text (which cannot hold the open tag: a special token), then any calls
        calls = f"text ({calls})?"
    lines = [f"start: think {calls}" if think else f"start: {calls}",
             f"tc: {form.open} call {form.close}", *call_rules, *think]
    if not tools.required:
        lines.append("text: /(?s:.*)/")
    return StructuredOutputs(grammar="\n".join(lines))


def _json_call_rules(form: CallForm, parameters: dict[str, dict]) -> list[str]:
    """Lark rules of `call` in the JSON form: one object {"name", "arguments"} per allowed tool, its arguments held to
    the tool's `parameters`."""
    schemas = []
    for name, schema in parameters.items():
        properties = {"name": {"const": name}, "arguments": schema}
        schemas.append({"type": "object", "properties": {k: properties[k] for k in form.keys},
                        "required": list(form.keys), "additionalProperties": False})
    whole = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if form.separators is not None:  # the JSON spaced as the template writes it (what the model learned)
        whole["x-guidance"] = {"whitespace_flexible": False, "item_separator": form.separators[0],
                               "key_separator": form.separators[1]}
    return ["call: %json " + json.dumps(whole)]


def _xml_call_rules(xml: XmlForm, parameters: dict[str, dict]) -> list[str]:
    """Lark rules of `call` in the XML form: per allowed tool, `<function=NAME>` then its parameters in the schema's
    order (the required ones required), each `<parameter=P>` + its value + `</parameter>`, laid out as the template
    writes them. A string parameter's value is any text without `</parameter>` (the parser ends it at the first);
    another type's is JSON of its schema (the parser reads such values as JSON). A tool whose schema declares no
    properties takes any parameters, each a free value."""
    free = "/(?s:.*)" + _regex(xml.value_close + "</parameter>") + "/ & ~/(?s:.*)<\\/parameter>(?s:.+)/"
    rules = ["call: " + " | ".join(f"fn_{i}" for i in range(len(parameters))),
             f"FREE_VALUE: {free}"]
    for i, (name, schema) in enumerate(parameters.items()):
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = set(schema.get("required") or [])
        parts = []
        for j, (key, sub) in enumerate(properties.items()):
            head = json.dumps(f"<parameter={key}>" + xml.value_open)
            after = json.dumps(xml.after_parameter)
            if _free_text(sub):
                rules.append(f"p_{i}_{j}: {head} FREE_VALUE {after}")
            else:
                rules.append(f"p_{i}_{j}: {head} v_{i}_{j} " + json.dumps(xml.value_close + "</parameter>")
                             + f" {after}")
                rules.append(f"v_{i}_{j}: %json " + json.dumps(sub))
            parts.append(f"p_{i}_{j}" if key in required else f"p_{i}_{j}?")
        if not properties:
            parts.append(f'("<parameter=" /[^>\\n]+/ ">" {json.dumps(xml.value_open)} FREE_VALUE '
                         f"{json.dumps(xml.after_parameter)})*")
        rules.append(f"fn_{i}: " + json.dumps(f"<function={name}>" + xml.after_name) + " " + " ".join(parts))
    return rules


def _free_text(schema: Any) -> bool:
    """A parameter whose value the parser takes as text (tsterm/agent/tool_calls.py `_convert`): a string, or no
    single JSON type."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    return not types or "string" in types or not set(types) <= _JSON_TYPES


def _regex(text: str) -> str:
    """`text` as a literal inside a Lark /regex/."""
    return "".join("\\n" if c == "\n" else "\\/" if c == "/" else re.escape(c) for c in text)


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
    writes them as json.dumps does, spaced or compact; None: any whitespace); `xml`: where the template writes the
    Qwen3-Coder XML form instead of JSON, its layout (`open` then ends before `<function=`, `close` starts at
    `</function>`; `keys` and `separators` are unused)."""

    open: str
    close: str
    separator: str
    keys: tuple[str, ...]
    separators: tuple[str, str] | None
    xml: XmlForm | None = None


@dataclasses.dataclass(frozen=True)
class XmlForm:
    """The whitespace the template writes around the XML form's pieces: after `<function=NAME>`, after
    `<parameter=P>` (before the value), after the value (before `</parameter>`), after `</parameter>`."""

    after_name: str
    value_open: str
    value_close: str
    after_parameter: str


# the probe's call `a(a="x")` in the XML form, each layout gap captured
_XML_PROBE = re.compile(r"(\s*)<function=a>(\s*)<parameter=a>(\s*)x(\s*)</parameter>(\s*)(</function>\s*)")


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
    block = one[start:stop + len(CLOSE_TAG)]
    separator = "\n"
    if two.count(OPEN_TAG) == 2:
        after = two.index(block) + len(block)
        separator = two[after:two.index(OPEN_TAG, after)]
    separator_lark = _lark(state, separator) if separator else '""'
    xml = _XML_PROBE.fullmatch(inner)
    if xml is not None:  # the Qwen3-Coder XML form
        return CallForm(_lark(state, OPEN_TAG + xml.group(1)), _lark(state, xml.group(6) + CLOSE_TAG), separator_lark,
                        (), None, XmlForm(*xml.group(2, 3, 4, 5)))
    first, last = inner.find("{"), inner.rfind("}") + 1
    try:
        written = json.loads(inner[first:last])
    except ValueError:
        written = {}
    keys = tuple(written)
    separators = next((pair for pair in ((", ", ": "), (",", ":"))
                       if json.dumps(written, separators=pair) == inner[first:last]), None)
    if first < 0 or set(keys) != {"name", "arguments"}:
        raise _cannot_force("the chat template writes a call neither as the JSON object {\"name\", \"arguments\"} "
                            "nor in the XML form <function=NAME><parameter=P>")
    head, tail = one[start:start + len(OPEN_TAG) + first], inner[last:] + CLOSE_TAG
    return CallForm(_lark(state, head), _lark(state, tail), separator_lark, keys, separators)


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

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
before its calls; where the request sets `enable_thinking: true` (chat_template_kwargs, or Anthropic `thinking`), or
under "auto", a reply may open with a `<think>...</think>` block; otherwise the calls come first (a model that reasons
on its own, unasked, is not let to under a required call). So a reply is a valid call by construction; what is left for the 422
(`tool_choice_unsatisfied`) is a reply cut short by max_tokens before its first call was whole. A template that
renders no tool call tsterm's parser reads gets a 400 (`tool_choice_unsupported`): the choice cannot be enforced. With
tool_choice "auto" and a function marked `strict: true`, the reply is free text then any calls, the strict functions'
arguments held to their schemas (the others' to any object); this needs a template whose open tag is a special token
(text cannot hold it, so text and calls are told apart): with a text open tag, "auto" is not constrained. Otherwise
"auto" constrains nothing, and `parallel_tool_calls: false` stops the reply at its first call's close tag.
The call form and the Lark rules of a call are built in tsterm/agent/tool_grammar.py (agent sessions use them too).
A harmony model (gpt-oss, tsterm.agent.harmony) is held to `harmony.turn_grammar` instead: reasoning and preambles,
then the call of an allowed tool as a `to=functions.NAME` commentary message, its arguments held to the schema (under
"auto" with strict functions, a final answer or such a call); a harmony reply holds one call (`<|call|>` ends it), so
a one-call request needs no stop string there.
"""
from __future__ import annotations

import dataclasses

from typing import Any

from tsterm.agent.harmony import is_harmony, reads_special_tokens, turn_grammar
from tsterm.agent.tool_calls import CLOSE_TAG
from tsterm.agent.tool_grammar import CallForm, CallFormError, call_rules, prompt_opens_reasoning, think_rules
from tsterm.agent.tool_grammar import call_form as template_call_form
from tsterm.config import SamplingParams, StructuredOutputs
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


def call_grammar(state: ServerState, tools: ToolUse, prompt_ids: list[int],
                 thinking: bool) -> StructuredOutputs | None:
    """The grammar of the replies `tools` allows (tool_choice required / any / a named tool, or "auto" with a strict
    function: None where the template's open tag is text, which free text could not be told from): see the module's
    docstring. `prompt_ids`: the request's prompt (a generation prompt that leaves a `<think>` block open makes the
    reply finish it before its calls); `thinking`: the request asked for reasoning (`enable_thinking`), so a reply may
    open with a reasoning block. A 400 where the template does not render tool calls in a form the grammar follows."""
    if is_harmony(state.tokenizer):
        return StructuredOutputs(grammar=turn_grammar(state, _allowed(tools), required=tools.required))
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
    opened = prompt_opens_reasoning(state, prompt_ids)  # the generation prompt opened the reasoning
    # "auto" leaves the reply free but for the strict functions' calls: a model that reasons on its own may (text
    # cannot hold a special `<think>`, which would end such a model's reply at once); a required call may reason
    # only where asked
    think = think_rules(state, opened) if opened or thinking or not tools.required else ()
    calls = "tc" if tools.single else f"tc ({form.separator} tc)*"
    if not tools.required:  # text (which cannot hold the open tag: a special token), then any calls
        calls = f"text ({calls})?"
    lines = [f"start: think {calls}" if think else f"start: {calls}",
             f"tc: {form.open} call {form.close}", *call_rules(form, parameters), *think]
    if not tools.required:
        lines.append("text: /(?s:.*)/")
    return StructuredOutputs(grammar="\n".join(lines))


def _allowed(tools: ToolUse) -> dict[str, dict]:
    """Each tool a reply may call -> the schema its arguments are held to (under "auto", a strict function's own,
    any object for the others)."""
    specs = {t["function"]["name"]: t["function"] for t in tools.offered or []}
    names = [tools.name] if tools.name else list(specs)
    return {name: (specs[name].get("parameters") or {"type": "object"}) if tools.required or specs[name].get("strict")
            else {"type": "object"} for name in names}


def call_form(state: ServerState) -> CallForm:
    """How the served model's template writes a tool call (tsterm.agent.tool_grammar.call_form); a 400
    (`tool_choice_unsupported`) where it writes none the grammar can follow."""
    try:
        return template_call_form(state)
    except CallFormError as e:
        raise _cannot_force(str(e)) from e


def _cannot_force(why: str) -> APIError:
    return APIError(400, f"tool_choice \"required\" or a named tool cannot be enforced with this model: {why}; use "
                    "tool_choice \"auto\"", param="tool_choice", code="tool_choice_unsupported")


def reply_parser(tools: ToolUse, prefix: str = "call", state: Any = None) -> ReplyParser:
    """A parser for one choice's reply (a one-call stop is put back); a harmony model's (`state`'s tokenizer), or one
    whose call markers are special tokens, reads the reply's ids with their markers."""
    if state is not None and is_harmony(state.tokenizer):
        return ReplyParser(tools.offered, tools.parse, prefix=prefix, tokenizer=state.tokenizer, harmony=True)
    if state is not None and tools.parse and reads_special_tokens(state.tokenizer):  # Kimi-K2's special markers
        return ReplyParser(tools.offered, True, prefix=prefix, stop_at=tools.stop_at, tokenizer=state.tokenizer)
    return ReplyParser(tools.offered, tools.parse, prefix=prefix, stop_at=tools.stop_at)


def stop_at_call_end(params: SamplingParams, tools: ToolUse, state: Any = None) -> SamplingParams:
    """`params` stopping at the first call's close tag where "auto" allows one call (not for a harmony model,
    `state`'s: its replies hold one call)."""
    if tools.stop_at is None or (state is not None and is_harmony(state.tokenizer)):
        return params
    return dataclasses.replace(params, stop=[*(params.stop or []), tools.stop_at])


def unsatisfied() -> APIError:
    return APIError(422, "tool_choice required a tool call and the reply was held to one, but it was cut short by "
                    "max_tokens before its first call was whole; retry with a larger max_tokens, or use tool_choice "
                    "\"auto\"", code="tool_choice_unsatisfied", param="tool_choice")

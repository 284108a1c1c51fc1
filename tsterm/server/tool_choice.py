"""What a request's tools and tool_choice ask of generation (`ToolUse`).

tool_choice "required" (Anthropic "any") and a named tool constrain generation with a forced prefix: the prompt ends
with the opening every allowed call shares, as the model's chat template renders an assistant tool call
(`open_call`; a template that renders none gets a 400), and the reply is that opening + what the model generated,
so it is a call by construction. A named tool (and `parallel_tool_calls: false`, Anthropic
`disable_parallel_tool_use`) also stops generation at the first call's close tag: exactly one call, as OpenAI
documents for a forced function. The forced ids are prompt ids for the engine and count as prompt tokens in `usage`
(and in the metrics): the engine prefilled them, it did not sample them; completion tokens are the sampled ones. A
422 (`tool_choice_unsatisfied`) is left only for a constrained reply that still is not a valid call (bad JSON,
arguments failing the tool's schema, cut short by max_tokens).
"""
from __future__ import annotations

import dataclasses

from tsterm.agent.tool_calls import CLOSE_TAG, OPEN_TAG, TextDelta, ToolCall, ToolCallParser
from tsterm.config import SamplingParams
from tsterm.errors import TstermError
from tsterm.server.errors import APIError
from tsterm.server.state import ServerState
from tsterm.server.tool_stream import ReplyParser


@dataclasses.dataclass
class ToolUse:
    """What a request's tools and tool_choice ask of generation."""

    offered: list[dict] | None  # rendered by the template; None: no tools in the prompt
    parse: bool  # split the reply into content and tool_calls
    required: bool  # tool_choice required/any or a named tool: the reply opens with a call (`open_call`)
    name: str | None = None  # tool_choice named this tool
    single: bool = False  # at most one call: generation stops at the first call's close tag

    @property
    def stop_at(self) -> str | None:
        return CLOSE_TAG if self.single and self.parse else None


_PROBE = [{"role": "user", "content": "?"}]
_SENTINEL_NAMES = ("a", "b")  # stand-ins for "any tool": they differ in their first character


def open_call(state: ServerState, tools: ToolUse) -> list[int]:
    """The token ids every call the request allows begins with, as this model's chat template renders an assistant
    tool call: the common prefix of the rendered replies calling each allowed name (the named tool, the only tool,
    or two stand-in names for several) with no arguments and with one. For the Hermes form that is the opening
    `<tool_call>` and newline, then `{"name": "` and, for one name, the name and `"arguments":`. A template that
    does not render tool calls in a form ToolCallParser reads gets a 400: the choice cannot be enforced."""
    tokenizer, offered = state.tokenizer, tools.offered or []
    names = [tools.name] if tools.name else [t["function"]["name"] for t in offered]
    names = names if len(names) == 1 else list(_SENTINEL_NAMES)
    try:
        head = list(tokenizer.apply_chat_template(_PROBE, tools=offered, add_generation_prompt=True, tokenize=True))
        replies = []
        for name in names:
            for arguments in ({}, {"a": "x"}):  # a string value reads back the same from any form
                call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}
                ids = list(tokenizer.apply_chat_template(
                    _PROBE + [{"role": "assistant", "content": "", "tool_calls": [call]}], tools=offered,
                    add_generation_prompt=False, tokenize=True))
                if ids[:len(head)] != head or not _renders_call(tokenizer.decode(ids[len(head):]), name, arguments):
                    raise _cannot_force("the chat template does not render an assistant tool call as a reply that "
                                        "begins with a <tool_call> tsterm's parser reads")
                replies.append(ids[len(head):])
    except TstermError as e:
        raise _cannot_force(f"the chat template failed to render a tool call ({e})") from e
    common = replies[0]
    for reply in replies[1:]:
        common = common[:next((i for i, (a, b) in enumerate(zip(common, reply)) if a != b), min(len(common),
                                                                                                 len(reply)))]
    if OPEN_TAG not in tokenizer.decode(common, skip_special_tokens=False):
        raise _cannot_force("the rendered tool calls share no opening <tool_call> to begin the reply with")
    return common


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


def reply_parser(tools: ToolUse, forced: str, prefix: str = "call") -> ReplyParser:
    """A parser for one choice's reply: the forced opening is read first, a one-call stop is put back."""
    return ReplyParser(tools.offered, tools.parse, prefix=prefix, forced=forced, stop_at=tools.stop_at)


def stop_at_call_end(params: SamplingParams, tools: ToolUse) -> SamplingParams:
    """`params` stopping at the first call's close tag when the request allows one call."""
    if tools.stop_at is None:
        return params
    return dataclasses.replace(params, stop=[*(params.stop or []), tools.stop_at])


def unsatisfied() -> APIError:
    return APIError(422, "tool_choice required a tool call; the reply was made to open one, but the model did not "
                    "write a valid call (bad JSON, arguments failing the tool's schema, or cut short by max_tokens); retry, "
                    "or use tool_choice \"auto\"", code="tool_choice_unsatisfied", param="tool_choice")

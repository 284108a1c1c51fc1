"""The history policy: how a turn treats what the engine already computed for earlier turns.

`template` renders the whole conversation through the chat template and keeps the kept ids only as far as the
rendering still starts with their text (plan.py). Reasoning templates drop the reasoning of earlier assistant turns
(Qwen3 / Qwen3.5, GLM-4.5, gpt-oss harmony's analysis channel, MiniMax-M2: of those before the last user message;
DeepSeek-R1: of every earlier turn), so after a tool loop a new user message re-renders the loop's first assistant turn
differently: a miss there, and the whole loop is computed again.

`preserve` continues from the exact kept ids, reasoning included, and appends only the text the template renders for
the new messages (those after the `covered` messages the kept ids stand for). That text is found without trusting the
template to render the covered messages as the engine saw them:

0. The kept ids were recorded with the messages they stand for (a digest of both) and the template's context (tools,
   its own system block: `render_context`); if either changed since, the turn renders as the template says.
1. The probe conversation is the covered messages without their reasoning (nothing for the template to drop; and
   gpt-oss's template refuses a tool call carrying both content and thinking), the last one's content replaced by a
   sentinel S, then the new messages with the first one's content replaced by a second sentinel T.
2. The kept ids end with the model's stop token (else: fall back, see below). Its text as history renders it (the
   stop's own text, e.g. `<|im_end|>`, `<｜end▁of▁sentence｜>`, `[e~[`; GLM's `<|observation|>` / `<|user|>`, which
   open the next message; harmony's `<|return|>` becomes `<|end|>`, HISTORY_END) is looked for after S: its first
   occurrence there ends the covered messages. It must come before T (the boundary lies between the last covered
   message and the first new one), the text before it must be the same when the new messages render with their real
   contents, and S and T must each occur once.
3. The new text is everything after that end marker in the rendering of the covered messages (reasoning stripped,
   last content S) followed by the real new messages: the new messages as the template renders them after such a
   history, generation prompt included.
4. The prompt is the kept ids + the encoding of the new text. For harmony the stop `<|return|>` is itself replaced by
   `<|end|>` (the format's rule for a reply kept in history), so all kept ids but the last are kept.

Kimi-K2's template writes each call's id into the call (`<|tool_call_begin|>ID`) and into its result's heading
(`## Return of ID`), and the model writes its ids as `functions.NAME:IDX` (IDX counting the conversation's calls):
`kimi_call_ids` gives a conversation's calls whose ids are in another form (an API client's `call_...`, `toolu_...`)
that form, and the results that answer them the same id, before such a template renders them (`writes_call_ids`).

When any of this fails (no stop token at the end of the kept ids: a reply cut by max_tokens or a stop string; the
kept ids or the messages they stand for changed since they were recorded; the template rejects the probe; a sentinel
or the end marker is missing or in the wrong place) the turn falls back to `template`, and the plan says why.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
from array import array
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tsterm.chat.plan import PromptPlan, TextCodec, plan_prompt

PRESERVE, TEMPLATE = "preserve", "template"
POLICIES = (PRESERVE, TEMPLATE)
# Fields a message's reasoning arrives under (the names tsterm's tokenizer hands to templates).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# A stop token's text -> the text the chat template writes in its place once the reply is history. gpt-oss (harmony)
# ends a final answer with <|return|>, which history holds as <|end|>; its <|call|> stays <|call|>.
HISTORY_END: Mapping[str, str] = {"<|return|>": "<|end|>"}
THINK_END = "</think>"
CONTEXT_PROBE = "tsterm-context-probe"

Render = Callable[[list[dict]], str]  # messages -> prompt text (chat template + generation prompt)
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"  # in Kimi-K2's template, which writes each call's id
_KIMI_ID = re.compile(r"functions\.[^\s:]+:\d+\Z")


def writes_call_ids(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes Kimi-K2's calls (whose ids the template writes, in their form)."""
    templates = getattr(tokenizer, "chat_templates", None) or {}
    return any(isinstance(t, str) and KIMI_ARGUMENTS in t for t in templates.values())


def kimi_call_ids(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The messages with every tool call's id in Kimi-K2's form `functions.NAME:IDX`, IDX the call's index among the
    conversation's calls: a call whose id is in another form gets that id, and each tool result whose `tool_call_id`
    named it names the new id. Ids already in the form are kept (the model's own)."""
    renamed: dict[str, str] = {}
    count, out = 0, []
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                call_id = call.get("id") if isinstance(call, Mapping) else None
                if isinstance(call, Mapping) and not (isinstance(call_id, str) and _KIMI_ID.match(call_id)):
                    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
                    new = f"functions.{function.get('name')}:{count}"
                    if isinstance(call_id, str):
                        renamed[call_id] = new
                    call = {**call, "id": new}
                calls.append(call)
                count += 1
            message["tool_calls"] = calls
        elif message.get("role") == "tool" and message.get("tool_call_id") in renamed:
            message["tool_call_id"] = renamed[message["tool_call_id"]]
        out.append(message)
    return out


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"thinking history policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def strip_reasoning(message: Mapping[str, Any]) -> dict:
    """`message` without its reasoning: no reasoning field, and an assistant's string content keeps only what follows
    its last `</think>` (leading newlines dropped), as the reasoning templates render an earlier turn."""
    out = {k: v for k, v in message.items() if k not in REASONING_FIELDS}
    content = out.get("content")
    if out.get("role") == "assistant" and isinstance(content, str) and THINK_END in content:
        out["content"] = content.rsplit(THINK_END, 1)[1].lstrip("\n")
    return out


def stop_ids_of(tokenizer: Any) -> frozenset[int]:
    """The ids that end a reply: tsterm's Tokenizer.eos_token_ids, or a transformers tokenizer's eos_token_id."""
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [one] if isinstance(one, int) else one or []
    return frozenset(ids)


def request_stop_ids(eos_token_ids: Collection[int], params: Any = None) -> frozenset[int]:
    """The ids that end one request's reply, as the engine decides it: the engine's eos ids (Engine.eos_token_ids:
    the tokenizer's and the model config's), unless the request sets `ignore_eos`, and the request's own
    `stop_token_ids`. What `plan_turn`'s `stop_ids` should be for a turn whose kept ids that request made."""
    ignore = bool(getattr(params, "ignore_eos", False))
    return frozenset(() if ignore else eos_token_ids) | frozenset(getattr(params, "stop_token_ids", None) or ())


def kept_digest(messages: Sequence[Mapping[str, Any]], token_ids: Sequence[int]) -> str:
    """A fingerprint of kept ids together with the messages they stand for: a session records it with its ids, and
    `preserve` applies only while both are as recorded."""
    h = hashlib.sha256(json.dumps(list(messages), sort_keys=True, ensure_ascii=False, default=str).encode())
    h.update(b"\0")
    h.update(array("q", token_ids).tobytes())
    return h.hexdigest()


def render_context(render: Render) -> str:
    """A fingerprint of what the template writes before a conversation's first message: the tool list, a default
    system prompt, a date. The messages are not in it (a session's digest covers those) and neither is the generation
    prompt (a switch such as enable_thinking changes only the next reply). If it changes, the kept ids were made with
    another context, which `preserve` cannot append to: the turn renders as the template says."""
    try:
        text = render([{"role": "user", "content": CONTEXT_PROBE}])
    except Exception as e:  # noqa: BLE001 - a template that cannot render a lone user message: its error is the context
        text = f"{type(e).__name__}: {e}"
    return hashlib.sha256(text.partition(CONTEXT_PROBE)[0].encode()).hexdigest()[:32]


class Fallback(Exception):
    """`preserve` cannot apply to this turn; the message says why."""


@dataclass(frozen=True)
class NewText:
    """Where the new messages' text starts: `end` is the history text of the kept ids' stop token (what the prompt
    holds in its place), `text` the rendering after it."""

    end: str
    text: str


def new_messages_text(kept: Sequence[int], covered: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]],
                      render: Render, tokenizer: TextCodec, stop_ids: Collection[int],
                      history_end: Mapping[str, str] = HISTORY_END) -> NewText:
    """The text the chat template renders for `new` after `covered` (see the module docstring); Fallback if any
    assumption fails."""
    if not kept:
        raise Fallback("no kept ids")
    if not covered or covered[-1].get("role") != "assistant":
        raise Fallback("the kept ids do not end with an assistant reply")
    if not new:
        raise Fallback("no new messages")
    if kept[-1] not in stop_ids:
        raise Fallback("the last reply did not end with a stop token (cut by max_tokens or a stop string)")
    stop = tokenizer.decode([kept[-1]], skip_special_tokens=False)
    end = history_end.get(stop, stop)
    if not end:
        raise Fallback("the stop token has no text")
    everything = json.dumps([*covered, *new], ensure_ascii=False, default=str)
    s, t = _sentinel(everything), _sentinel(everything)
    history = [strip_reasoning(m) for m in covered]
    history[-1] = {**history[-1], "content": s}
    try:
        probe = render([*history, {**new[0], "content": t}, *new[1:]])
        real = render([*history, *new])
    except Exception as e:  # noqa: BLE001 - whatever the template raised: the turn renders as the template says
        raise Fallback(f"the template rejected the probe conversation ({type(e).__name__}: {e})") from None
    if probe.count(s) != 1 or probe.count(t) != 1 or real.count(s) != 1:
        raise Fallback("the template does not render the reply's content once, verbatim")
    at = probe.find(end, probe.index(s) + len(s))
    if at < 0:
        raise Fallback(f"the template does not end the reply with {end!r}")
    boundary = at + len(end)
    if boundary > probe.index(t):
        raise Fallback(f"the first {end!r} after the reply comes after the first new message's content")
    if real[:boundary] != probe[:boundary]:
        raise Fallback("the history renders differently with the new messages' contents")
    return NewText(end, real[boundary:])


def plan_preserve(kept: Sequence[int], messages: Sequence[Mapping[str, Any]], covered: int, render: Render,
                  tokenizer: TextCodec, stop_ids: Collection[int] | None = None,
                  history_end: Mapping[str, str] = HISTORY_END) -> PromptPlan:
    """The kept ids + the tokens of the new messages' text (`messages[covered:]`); Fallback when it cannot apply."""
    kept = list(kept)
    if not kept:
        return replace(plan_prompt(kept, render(list(messages)), tokenizer), policy_applied=PRESERVE)
    if not 0 < covered <= len(messages):
        raise Fallback("the session does not know which messages its kept ids stand for")
    stops = stop_ids_of(tokenizer) if stop_ids is None else frozenset(stop_ids)
    found = new_messages_text(kept, messages[:covered], messages[covered:], render, tokenizer, stops, history_end)
    stop = tokenizer.decode([kept[-1]], skip_special_tokens=False)
    if found.end == stop:
        return PromptPlan(kept + _encode(tokenizer, found.text), len(kept), policy_applied=PRESERVE)
    # harmony: the stop is rewritten as history holds it; every id before it is kept
    return PromptPlan(kept[:-1] + _encode(tokenizer, found.end + found.text), len(kept) - 1, policy_applied=PRESERVE)


def plan_turn(kept: Sequence[int], messages: Sequence[Mapping[str, Any]], render: Render, tokenizer: TextCodec,
              policy: str = TEMPLATE, covered: int = 0, stop_ids: Collection[int] | None = None,
              history_end: Mapping[str, str] = HISTORY_END) -> PromptPlan:
    """A turn's prompt under `policy`. `preserve` falls back to `template` (the plan says why) when it cannot
    apply; `template` is plan.py's plan of the template's own rendering."""
    check_policy(policy)
    if policy == PRESERVE:
        try:
            return plan_preserve(kept, messages, covered, render, tokenizer, stop_ids, history_end)
        except Fallback as why:
            return replace(plan_prompt(kept, render(list(messages)), tokenizer), fallback_reason=str(why))
    return plan_prompt(kept, render(list(messages)), tokenizer)


def _sentinel(avoid: str) -> str:
    while True:
        s = f"TSTERM{secrets.token_hex(8)}"
        if s not in avoid:
            return s


def _encode(tokenizer: TextCodec, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

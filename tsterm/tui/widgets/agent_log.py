"""Agent sessions in the log: each tool call as a Collapsible (name + arguments, status and time in its title; the
arguments, then the result or the error inside), the per-step token line, and a saved agent session's history
rebuilt as the same views (assistant messages hold the model's raw text, `<tool_call>` tags included: those become
tool blocks, never raw text)."""
from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from textual.app import ComposeResult
from textual.content import Content
from textual.timer import Timer
from textual.widget import Widget
from textual.widgets import Collapsible, Static

from tsterm.agent.loop import NO_APPROVER, REFUSED, AgentStep, ToolCallRecord
from tsterm.agent.tool_calls import TextDelta, ToolCallParser
from tsterm.chat.chat_format import REASONING_FIELDS, shown_reply
from tsterm.chat.session import Session, TurnStats
from tsterm.tui.widgets.chat_log import MessageView, policy_summary

STATUS_MARKS = {"parsed": "·", "waiting": "?", "running": "…", "done": "✓", "error": "✗", "refused": "⊘",
                "handed": "↩"}
STATUS_WORDS = {"handed": "handed back"}  # a call an API client got to run itself (its result comes in its next turn)
HANDED_BACK = "(handed back to the API client: it runs the tool and sends the result in its next request)"
ARGS_IN_TITLE = 60  # characters of the arguments shown in a block's title (all of them are inside)


def short_arguments(arguments: dict[str, Any], limit: int = ARGS_IN_TITLE) -> str:
    text = json.dumps(arguments, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def call_title(name: str, arguments: dict[str, Any], status: str, duration_s: float | None = None) -> str:
    """`✓ calculator {"expression": "6*7"} · done · 3 ms`: what a collapsed block says."""
    parts = [f"{STATUS_MARKS.get(status, '·')} {name or '(no name)'} {short_arguments(arguments)}",
             STATUS_WORDS.get(status, status)]
    if duration_s:
        parts.append(f"{duration_s * 1e3:.0f} ms" if duration_s < 1 else f"{duration_s:.1f} s")
    return " · ".join(parts)


def step_summary(number: int, stats: TurnStats | AgentStep, lost_tokens: int | None = None) -> str:
    """The line under a step: what its prompt reused and cost. A template miss says, in words, what it cost."""
    line = (f"step {number} · prompt {stats.prompt_tokens} · cached {stats.cached_tokens} · new {stats.new_tokens}"
            f" · gen {stats.generated_tokens}")
    if stats.finish_reason and stats.finish_reason != "stop":
        line += f" · {stats.finish_reason}"
    policy = policy_summary(stats)
    if policy:
        line += f" · {policy}"
    if stats.miss:
        line += (f" · less reuse: the chat template wrote the history differently from token "
                 f"{stats.diverged_at} on, so reuse stopped there")
        if lost_tokens:
            line += f" and {lost_tokens} tokens the model had already seen were computed again"
    return line


@dataclass
class CallState:
    """What a tool block shows (a live ToolCallRecord, or one rebuilt from a saved history)."""

    id: str
    name: str
    arguments: dict[str, Any]
    status: str
    result: str | None = None
    error: str | None = None
    duration_s: float | None = None

    @classmethod
    def of(cls, call: ToolCallRecord, status: str | None = None) -> CallState:
        return cls(call.id, call.name, dict(call.arguments), status or call.status, call.result, call.error,
                   call.duration_s or None)


class ToolCallView(Collapsible):
    """One tool call. `show(state)` updates it as the call moves parsed -> waiting -> running -> done/error/refused;
    while it runs, its title counts the seconds."""

    def __init__(self, state: CallState, collapsed: bool = True):
        self.body = Static(body_text(state), classes="tool-body", markup=False)
        super().__init__(self.body, title=self._make_title(state), collapsed=collapsed,
                         classes=f"tool-call -{state.status}")
        self.state = state
        self._started: float | None = None
        self._clock: Timer | None = None

    @staticmethod
    def _make_title(state: CallState, elapsed: float | None = None) -> Content:
        return Content(call_title(state.name, state.arguments, state.status, elapsed or state.duration_s))

    def on_mount(self) -> None:
        self._follow_clock()

    def show(self, state: CallState) -> None:
        self.remove_class(f"-{self.state.status}")
        self.state = state
        self.add_class(f"-{state.status}")
        self.title = self._make_title(state)
        self.body.update(body_text(state))
        if self.is_mounted:
            self._follow_clock()

    def _follow_clock(self) -> None:
        if self.state.status == "running" and self._clock is None:
            self._started = time.monotonic()
            self._clock = self.set_interval(1.0, self._tick)
        elif self.state.status != "running" and self._clock is not None:
            self._clock.stop()
            self._clock = self._started = None

    def _tick(self) -> None:
        if self._started is not None:
            self.title = self._make_title(self.state, time.monotonic() - self._started)


def body_text(state: CallState) -> str:
    """Inside a tool block: all the arguments, then the error and/or the result."""
    lines = [f"arguments: {json.dumps(state.arguments, ensure_ascii=False, indent=2)}"]
    if state.error:
        lines.append(f"error: {state.error}")
    if state.result:
        lines.append(f"result:\n{state.result}")
    elif state.status in ("parsed", "waiting", "running"):
        lines.append(f"({state.status})")
    elif state.status == "handed":
        lines.append(HANDED_BACK)
    elif not state.error:
        lines.append("result: (empty)")
    return "\n".join(lines)


def status_of_tool_message(content: str) -> tuple[str, str | None, str]:
    """(status, error, result) of a saved tool message (the loop writes an error as `error: ...`)."""
    if not content.startswith("error: "):
        return "done", None, content
    error, _, result = content[len("error: "):].partition("\n")
    return ("refused" if error in (REFUSED, NO_APPROVER) else "error"), error, result


def split_reply(raw: str) -> tuple[str, list[tuple[str, dict[str, Any], str | None]]]:
    """An assistant message's raw text -> (its visible text, [(tool name, arguments, parse error)])."""
    parser = ToolCallParser(None)
    events = parser.feed(raw) + parser.finish()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [(e.name, dict(e.arguments), e.error) for e in events if not isinstance(e, TextDelta)]
    return text, calls


def _recorded_call(call: Any) -> tuple[str, dict[str, Any], str | None]:
    """(name, arguments, parse error) of a call recorded as a message's `tool_calls` entry."""
    function = call.get("function", call) if isinstance(call, dict) else {}
    name, arguments = function.get("name") or "", function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return name, {}, f"the arguments are not valid JSON ({e.msg})"
    return (name, arguments, None) if isinstance(arguments, dict) else (name, {}, "the arguments are not an object")


def agent_history_views(session: Session, collapse_thinking: bool = True,
                        pending: Sequence[ToolCallRecord] = ()) -> tuple[list[Widget], dict[str, ToolCallView]]:
    """The views of an agent session's saved history, and its tool blocks by call id. `pending`: the live records
    of the last step's calls while they run (their tool messages are not in the history yet)."""
    views: list[Widget] = []
    by_id: dict[str, ToolCallView] = {}
    messages = session.messages
    stats = iter(session.reply_stats())
    step = 0
    for index, m in enumerate(messages):
        role, number = m["role"], session.number_of(index)
        if role == "tool":
            continue  # shown inside the call it answers
        if role != "assistant":
            views.append(MessageView(role, m["content"], index=index, number=number))
            continue
        step += 1
        turn = next(stats, None)
        text, calls = split_reply(m["content"])
        if not calls and m.get("tool_calls"):  # a harmony step: its calls and reasoning kept as fields
            calls = [_recorded_call(call) for call in m["tool_calls"]]
        reasoning = next((m[key] for key in REASONING_FIELDS if isinstance(m.get(key), str)), "")
        text = shown_reply(reasoning, text)
        if text.strip() or not calls:
            views.append(MessageView("assistant", text, step_summary(step, turn) if turn else "",
                                     miss=bool(turn and turn.miss), index=index, number=number,
                                     collapse_thinking=collapse_thinking))
        elif turn is not None:
            views.append(Static(step_summary(step, turn), classes="turn-stats step-line" + (" -miss" * turn.miss),
                                markup=False))
        answers = []
        for later in messages[index + 1:]:
            if later["role"] != "tool":
                break
            answers.append(later)
        live = list(pending) if index == len(messages) - 1 and not answers else []
        for n, (name, arguments, error) in enumerate(calls):
            if n < len(live):
                state = CallState.of(live[n])
            elif n < len(answers):
                status, err, result = status_of_tool_message(answers[n]["content"])
                state = CallState(answers[n].get("tool_call_id") or f"saved_{index}_{n}", name, arguments, status,
                                  result, err)
            elif session.kind == "api" and error is None:  # the server returned it: the client runs its tools
                state = CallState(f"saved_{index}_{n}", name, arguments, "handed")
            else:  # no result recorded (the task was cut off before the call ran)
                state = CallState(f"saved_{index}_{n}", name, arguments, "error", None,
                                  error or "no result was recorded for this call")
            view = ToolCallView(state)
            by_id[state.id] = view
            views.append(view)
    return views, by_id

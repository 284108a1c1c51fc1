"""Split a (possibly still streaming) reply into its `<think>...</think>` part and the answer."""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class SplitReply:
    thinking: str | None  # None: the reply has no thinking block (yet)
    answer: str
    thinking_open: bool = False  # `</think>` not seen yet: the model is still thinking


def _hold_partial(text: str, tag: str) -> str:
    """Drop a trailing prefix of `tag` (e.g. "</thi") that the next delta may complete."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text


def split_thinking(text: str) -> SplitReply:
    stripped = text.lstrip()
    if stripped.startswith(OPEN):
        body = stripped[len(OPEN):]
        if CLOSE in body:
            thinking, answer = body.split(CLOSE, 1)
            return SplitReply(thinking.strip(), answer.lstrip())
        return SplitReply(_hold_partial(body, CLOSE).strip(), "", thinking_open=True)
    if CLOSE in text:  # the chat template opened the block inside the prompt (Qwen3-style)
        thinking, answer = text.split(CLOSE, 1)
        return SplitReply(thinking.strip(), answer.lstrip())
    if stripped and OPEN.startswith(stripped):  # "<thi": wait for the next delta to decide
        return SplitReply(None, "")
    return SplitReply(None, text)

"""How one model's chat turns are written and read: the seam every chat path asks (the TUI's chat sessions, the line
chat, the agent view), so a model whose format is not its checkpoint's Jinja template (gpt-oss's harmony) is chosen
once, by one function, and never special-cased where a reply is shown.

A `ChatFormat` renders a conversation to prompt text (`render`) and reads one reply (`reader()`): a `ReplyReader` is
handed the engine's growing output (`read(completion, final)`) and gives back the text to show, in the one form every
chat view already shows a reasoning model's reply in: its reasoning inside `<think>...</think>`, then the answer
(`shown_reply`, defined with the harmony format in `tsterm.harmony`, below the offline API, which gives a harmony
reply in that form too); `message()` is the assistant message the session records for it.

`TemplateFormat` is the checkpoint's chat template, its reply the engine's text as it is (a reasoning family's
`<think>` block is part of that text). gpt-oss's harmony (rendered by tsterm, its channels read from the reply's ids)
is `tsterm.agent.harmony.HarmonyFormat`; `tsterm.agent.harmony.chat_format(tokenizer)` picks between them with the
same choice the agent loop and the server make (`is_harmony`). The chat layer holds no harmony code (it sits below the
agent layer): a chat path that cannot import the choice is handed its format by the caller that can.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tsterm.harmony import THINK_CLOSE, THINK_OPEN, shown_reply  # the form LLM.chat gives a harmony reply in too

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # as tsterm.chat.history names them


def shown_message(message: Mapping[str, Any]) -> str:
    """A recorded assistant message as the chat views show it: a reasoning field (harmony's analysis, an API
    client's `reasoning_content`) before its content, as `shown_reply` writes it."""
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    reasoning = next((message[key] for key in REASONING_FIELDS if isinstance(message.get(key), str)), "")
    return shown_reply(reasoning, text)


class ReplyReader(Protocol):
    shown: str  # the reply so far as shown (see `shown_reply`)

    def read(self, completion: Any, final: bool = False) -> str:
        """Take the reply so far (a CompletionOutput: its cumulative `text` / `token_ids`; `final` once it ended,
        or was cut); returns what it adds to `shown`. May be called for every output or only now and then."""

    def message(self) -> dict:
        """The assistant message the session records for the reply."""


class ChatFormat(Protocol):
    name: str

    def render(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
        """The conversation as prompt text, the generation prompt included."""

    def reader(self) -> ReplyReader:
        """A reader of one reply."""


class TextReply:
    """A reply read as the engine's text (a `<think>` block, if any, is part of it)."""

    def __init__(self) -> None:
        self.shown = ""

    def read(self, completion: Any, final: bool = False) -> str:
        text = completion.text
        delta = text[len(self.shown):] if text.startswith(self.shown) else text
        self.shown = text
        return delta

    def message(self) -> dict:
        return {"role": "assistant", "content": self.shown}


class TemplateFormat:
    """The checkpoint's chat template (the tokenizer's `apply_chat_template`)."""

    name = "template"

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                                  **template_kwargs)

    def reader(self) -> TextReply:
        return TextReply()


__all__ = ["THINK_CLOSE", "THINK_OPEN", "ChatFormat", "ReplyReader", "TemplateFormat", "TextReply", "shown_message",
           "shown_reply"]

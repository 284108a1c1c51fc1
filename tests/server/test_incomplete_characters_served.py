"""A reply cut by max_tokens inside a multi-byte character, through the server with the official `openai` client:
agent-demo writes a CJK character as three byte tokens, and a grammar (vLLM's `structured_outputs`) makes it write
some; whatever max_tokens cuts, no text (streamed or whole) holds U+FFFD: a streamed character comes once it is whole,
and the bytes of one the reply was cut inside are dropped."""
from __future__ import annotations

import pytest

from tests.server.conftest import MODEL

FORCED = "日本語🙂"


def _forced_tokens(llm) -> int:
    tokens = len(llm.tokenizer.encode(FORCED))
    assert tokens == len(FORCED.encode())  # one token per byte: most cuts fall inside a character
    return tokens


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_no_reply_ends_in_a_replacement_character(client, llm, route):
    tokens = _forced_tokens(llm)
    extra = {"structured_outputs": {"regex": FORCED}}
    for max_tokens in range(1, tokens + 1):
        if route == "completions":
            kwargs = dict(model=MODEL, prompt="Japanese:", max_tokens=max_tokens, temperature=0, extra_body=extra)
            whole = client.completions.create(**kwargs)
            text, usage = whole.choices[0].text, whole.usage
            streamed = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices]
        else:
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Write some Japanese."}],
                          max_tokens=max_tokens, temperature=0, extra_body=extra)
            whole = client.chat.completions.create(**kwargs)
            text, usage = whole.choices[0].message.content, whole.usage
            streamed = [c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                        if c.choices]
        assert usage.completion_tokens == max_tokens
        # the whole characters among the bytes written: 3 bytes each, the emoji 4
        chars = sum(1 for i in range(1, len(FORCED) + 1) if len(FORCED[:i].encode()) <= max_tokens)
        assert text == "".join(streamed) == FORCED[:chars], (max_tokens, text, streamed)
        assert not any("\ufffd" in piece for piece in streamed)

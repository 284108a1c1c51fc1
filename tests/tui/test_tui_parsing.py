"""Slash-command parsing and the thinking-block split (no Textual needed)."""
from __future__ import annotations

import pytest

from tsterm.tui.commands import Command, CommandError, parse_command, unescape_message
from tsterm.tui.thinking import SplitReply, split_thinking


def test_parse_commands():
    assert parse_command("hello") is None
    assert parse_command("//not a command") is None and unescape_message("//x") == "/x"
    assert parse_command("/new") == Command("new")
    assert parse_command("/agent fix the tests") == Command("agent", "fix the tests")  # a new agent session
    assert parse_command("  /system  be brief ") == Command("system", "be brief")
    assert parse_command("/export md /tmp/x.md") == Command("export", "md /tmp/x.md")
    assert parse_command("/he") == Command("help")  # an unambiguous prefix
    with pytest.raises(CommandError, match="unknown command /nope"):
        parse_command("/nope")
    assert parse_command("/export trace") == Command("export", "trace")
    with pytest.raises(CommandError, match=r"usage: /export md\|json\|trace \[PATH\]"):
        parse_command("/export pdf x")
    with pytest.raises(CommandError, match="usage: /rename TITLE"):
        parse_command("/rename")


@pytest.mark.parametrize("text, expected", [
    ("plain answer", SplitReply(None, "plain answer")),
    ("<thi", SplitReply(None, "")),
    ("<think>\nhmm", SplitReply("hmm", "", thinking_open=True)),
    ("<think>hmm</thi", SplitReply("hmm", "", thinking_open=True)),
    ("<think>hmm</think>\n\nyes", SplitReply("hmm", "yes")),
    ("template opened it</think>done", SplitReply("template opened it", "done")),
])
def test_split_thinking(text, expected):
    assert split_thinking(text) == expected

"""The copy-heavy agent trace (`tsterm bench --trace copy-heavy`): the session where drafting tokens pays most.

A coding agent reads a source file (a tool result holding the file's text), writes it back whole with a small edit,
runs the tests and quotes their failure back, fixes the file and writes it back whole again, then quotes the passing
run's summary. Each turn appends its messages to the conversation the previous turns left (prompt and generated
reply, kept as they are: the prefix cache serves them, as in the synthetic trace), rendered by the model's own chat
template, and asks for a reply of a fixed length: room for the text the turn asks to be copied (`CopyTurn.expected`,
in the model's tokens) plus some slack. Everything here is fixed text: the trace is the same ids on every run for a
given tokenizer. The replies themselves are the model's (greedy): how much of them repeats the prompt is the
model's doing; `expected` is what a model that follows the instructions writes.
"""
from __future__ import annotations

from dataclasses import dataclass

from tsterm.bench.trace import Trace, TraceTurn
from tsterm.errors import ConfigError

NAME = "copy-heavy"

SOURCE_FILE = '''"""Key = value configuration files: read, merge, write."""
from __future__ import annotations


def parse_config(path):
    """Read a key = value file into a dict; lines starting with # are comments."""
    config = {}
    with open(path) as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"{path}:{number}: expected key = value, got {line!r}")
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    """A new dict: base's keys, then override's on top."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged


def write_config(path, config):
    """Write a dict as key = value lines, sorted by key."""
    with open(path, "w") as handle:
        for key in sorted(config):
            handle.write(f"{key} = {config[key]}\\n")
'''

RENAMED_FILE = SOURCE_FILE.replace("parse_config", "load_config")
# the fix the failing test asks for: an override's empty values leave base's
FIXED_FILE = RENAMED_FILE.replace(
    """    \"\"\"A new dict: base's keys, then override's on top.\"\"\"
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
""", """    \"\"\"A new dict: base's keys, then override's non-empty values on top.\"\"\"
    merged = dict(base)
    for key, value in override.items():
        if value:
            merged[key] = value
""")

TEST_FAILURE = """=================================== FAILURES ===================================
_________________________ test_merge_skips_empty_values _________________________
    def test_merge_skips_empty_values():
        merged = merge_configs({"a": "1", "b": "2"}, {"b": ""})
>       assert merged == {"a": "1", "b": "2"}
E       AssertionError: assert {'a': '1', 'b': ''} == {'a': '1', 'b': '2'}
tests/test_config.py:14: AssertionError"""
TEST_RUN = f"""$ pytest -q tests/test_config.py
..F.
{TEST_FAILURE}
1 failed, 3 passed in 0.02s"""
TEST_PASS = """$ pytest -q tests/test_config.py
....
4 passed in 0.02s"""

SYSTEM = ("You are a coding agent working in a Python repository. Tools: read_file(path) returns a file's text; "
          "write_file(path, text) replaces a file with the text you give, so you always write a file back whole; "
          "run(command) runs a shell command and returns its output. Quote tool output exactly when asked.")


@dataclass(frozen=True)
class CopyTurn:
    """One turn: the message it appends, and the reply a model following it writes (what a draft source can copy
    from the conversation). The reply is given `expected`'s length in tokens plus `slack`."""

    message: str
    expected: str
    slack: int = 24


def copy_turns(file_name: str = "config.py") -> list[CopyTurn]:
    fence = "```python\n"
    return [
        CopyTurn(f"In {file_name}, rename parse_config to load_config. Read the file first, then write it back "
                 "whole.", f'read_file("{file_name}")'),
        CopyTurn(f"Tool result (read_file {file_name}):\n{fence}{SOURCE_FILE}```\nWrite the whole file back with "
                 "parse_config renamed to load_config, unchanged otherwise, in one python code block.",
                 f"{fence}{RENAMED_FILE}```"),
        CopyTurn(f"Tool result (write_file {file_name}): ok. Tool result (run):\n{TEST_RUN}\nQuote the failure "
                 "section of the tool result exactly, then say in one sentence what is wrong.", TEST_FAILURE),
        CopyTurn("Make merge_configs leave base's value where the override's is empty, so that the test passes, and "
                 "write the whole file back again, in one python code block.", f"{fence}{FIXED_FILE}```"),
        CopyTurn(f"Tool result (write_file {file_name}): ok. Tool result (run):\n{TEST_PASS}\nQuote the summary "
                 "line of the tool result exactly, then say in one sentence what you changed.",
                 "4 passed in 0.02s"),
    ]


def _split_at_replies(tokenizer, messages: list[dict]) -> list[str]:
    """The chat template's text of a conversation cut at each assistant reply's content: [text before reply 1,
    text between reply 1 and the next reply, ...]. Raises ConfigError when the template does not render each reply
    verbatim (the trace could not put the generated ids where the reply goes)."""
    marks = [f"\x00TSTERM-REPLY-{i}\x00" for i in range(sum(m["role"] == "assistant" for m in messages))]
    numbered, i = [], 0
    for message in messages:
        if message["role"] == "assistant":
            message, i = {**message, "content": marks[i]}, i + 1
        numbered.append(message)
    text = tokenizer.apply_chat_template(numbered, add_generation_prompt=False)
    pieces = []
    for mark in marks:
        before, found, text = text.partition(mark)
        if not found or mark in text:
            raise ConfigError(f"--trace {NAME}: the model's chat template does not render an assistant reply "
                              "verbatim, once; this trace needs one that does")
        pieces.append(before)
    return pieces


def copy_heavy_trace(tokenizer, sessions: int = 1) -> tuple[Trace, list[list[CopyTurn]]]:
    """(trace[session][turn], the turns each session's trace was made of). Sessions differ in the file's name only
    (their conversations share the system prompt, as the synthetic trace's do)."""
    if sessions < 1:
        raise ConfigError(f"--sessions must be >= 1, got {sessions}")
    trace: Trace = []
    all_turns = []
    for session in range(sessions):
        turns = copy_turns("config.py" if session == 0 else f"config_{session}.py")
        messages: list[dict] = [{"role": "system", "content": SYSTEM}]
        for turn in turns:
            messages += [{"role": "user", "content": turn.message}, {"role": "assistant", "content": "-"}]
        pieces = _split_at_replies(tokenizer, messages)
        first = tokenizer.apply_chat_template(messages[:2], add_generation_prompt=True)
        if pieces[0] != first:  # the text before a reply must be what a generation prompt renders
            raise ConfigError(f"--trace {NAME}: the chat template renders a conversation's reply header unlike its "
                              "generation prompt; this trace needs one that does not")
        trace.append([TraceTurn(tokenizer.encode(piece), len(tokenizer.encode(turn.expected)) + turn.slack)
                      for piece, turn in zip(pieces, turns)])
        all_turns.append(turns)
    return trace, all_turns

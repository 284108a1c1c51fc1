"""Kimi-K2's tool-call ids: the model writes each call's id as `functions.NAME:IDX`, and its template writes the id
back into the call and into the result's `## Return of ID` heading. The parser gives a call the id the model wrote,
so an agent's tool result names the call as the model did; a history whose calls carry ids of another form (an API
client's `call_...`) is given Kimi's form, the results that answer them following, before the template renders it.
Kimi-K2's tokenizer holds its call markers as special tokens, which the engine's text leaves out: the agent and the
server read such a reply from its ids (the stop token left out)."""
from __future__ import annotations

import json

import pytest

from tests.agent.chat_formats import KIMI_K2, assistant_reply, render
from tests.agent.scripted import ScriptedBackend
from tests.helpers.tokenizers import make_tokenizer_dir
from tsterm.agent.loop import Agent, ToolCallParsed
from tsterm.agent.tool_calls import ToolCall, ToolCallParser
from tsterm.agent.tools import Tool
from tsterm.chat.history import kimi_call_ids, writes_call_ids
from tsterm.config import SamplingParams
from tsterm.server.generation import render_messages
from tsterm.server.state import ServerState
from tsterm.server.tool_choice import ToolUse
from tsterm.tokenizer import Tokenizer

READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


class ReadFile(Tool):
    name = "read_file"
    description = "Read a file."
    parameters = READ["function"]["parameters"]

    def run(self, arguments: dict) -> str:
        return f"contents of {arguments['path']}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = make_tokenizer_dir(tmp_path_factory.mktemp("kimi") / "kimi_k2")
    (directory / "chat_template.jinja").write_text(KIMI_K2)
    return Tokenizer.from_dir(directory)


def kimi_turn(*calls: tuple[str, dict, int]) -> str:
    message = {"content": "", "tool_calls": [{"id": f"functions.{n}:{i}", "type": "function",
                                              "function": {"name": n, "arguments": json.dumps(a)}}
                                             for n, a, i in calls]}
    return assistant_reply(KIMI_K2, message, [READ])


def test_a_call_keeps_the_id_the_model_wrote():
    parser = ToolCallParser([READ], id_prefix="call_")
    text = kimi_turn(("read_file", {"path": "a"}, 3), ("read_file", {"path": "b"}, 4), ("read_file", {"path": "c"}, 4))
    calls = [e for e in parser.feed(text) + parser.finish() if isinstance(e, ToolCall)]
    # the third wrote an id the turn had given already: it gets the parser's own
    assert [c.id for c in calls] == ["functions.read_file:3", "functions.read_file:4", "call_2"]
    assert all(c.ok for c in calls)


async def test_an_agent_s_tool_result_names_the_call_as_the_model_did(tokenizer):
    reply = kimi_turn(("read_file", {"path": "notes.txt"}, 0))
    backend = ScriptedBackend(tokenizer, [reply, "Done."])
    agent = Agent(backend, tokenizer, [ReadFile()], SamplingParams(temperature=0))
    events = [e async for e in agent.run("Read notes.txt")]
    [parsed] = [e.call for e in events if isinstance(e, ToolCallParsed)]
    assert parsed.id == "functions.read_file:0"
    second = tokenizer.decode(backend.prompts[1], skip_special_tokens=False)
    assert "## Return of functions.read_file:0\ncontents of notes.txt" in second


def test_a_history_with_other_ids_is_given_kimi_s_form(tokenizer):
    history = [{"role": "user", "content": "Read a and b."},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_x", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a"}}},
                   {"id": "functions.read_file:1", "type": "function",
                    "function": {"name": "read_file", "arguments": {"path": "b"}}}]},
               {"role": "tool", "tool_call_id": "call_x", "content": "A"},
               {"role": "tool", "tool_call_id": "functions.read_file:1", "content": "B"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "toolu_9", "type": "function",
                    "function": {"name": "read_file", "arguments": {"path": "c"}}}]},
               {"role": "tool", "tool_call_id": "toolu_9", "content": "C"}]
    fixed = kimi_call_ids(history)
    assert [c["id"] for c in fixed[1]["tool_calls"]] == ["functions.read_file:0", "functions.read_file:1"]
    assert [m.get("tool_call_id") for m in fixed[2:4]] == ["functions.read_file:0", "functions.read_file:1"]
    assert fixed[4]["tool_calls"][0]["id"] == "functions.read_file:2" and fixed[5]["tool_call_id"] == \
        "functions.read_file:2"
    assert history[1]["tool_calls"][0]["id"] == "call_x"  # the caller's messages are left as they are
    assert writes_call_ids(tokenizer)
    # the server renders them so: each call and its result under the same id, in the model's form
    state = ServerState(engine=None, tokenizer=tokenizer, model_name="kimi", max_model_len=4096)
    ids = render_messages(state, history, ToolUse([READ], True, False)).ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == render(KIMI_K2, fixed, [READ], add_generation_prompt=True)
    for i, result in enumerate("ABC"):
        assert f"<|tool_call_begin|>functions.read_file:{i}<|tool_call_argument_begin|>" in text
        assert f"## Return of functions.read_file:{i}\n{result}" in text
    assert "call_x" not in text and "toolu_9" not in text


KIMI_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_end|>", "<|tool_call_argument_begin|>")


@pytest.fixture(scope="module")
def special_tokenizer(tmp_path_factory):
    """Kimi-K2's call markers as special tokens, as its tokenizer holds them: the engine's text leaves them out."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    directory = make_tokenizer_dir(tmp_path_factory.mktemp("kimi") / "kimi_k2_special")
    (directory / "chat_template.jinja").write_text(KIMI_K2)
    backend = Backend.from_file(str(directory / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in KIMI_MARKERS])
    backend.save(str(directory / "tokenizer.json"))
    return Tokenizer.from_dir(directory)


async def test_special_token_markers_are_read_from_the_ids(special_tokenizer):
    tokenizer = special_tokenizer
    reply = "Let me look." + kimi_turn(("read_file", {"path": "notes.txt"}, 0))
    ids = tokenizer.encode(reply)
    assert all(tokenizer.token_to_id(m) in ids for m in KIMI_MARKERS)
    assert "tool_call" not in tokenizer.decode(ids)  # the engine's text: the markers are gone
    backend = ScriptedBackend(tokenizer, [reply, "Done."])
    agent = Agent(backend, tokenizer, [ReadFile()], SamplingParams(temperature=0))
    events = [e async for e in agent.run("Read notes.txt")]
    [parsed] = [e.call for e in events if isinstance(e, ToolCallParsed)]
    assert (parsed.id, parsed.name, parsed.arguments) == ("functions.read_file:0", "read_file", {"path": "notes.txt"})
    assert agent.steps[0].text == "Let me look." and agent.steps[0].raw == reply  # the stop token is no text
    assert "## Return of functions.read_file:0\ncontents of notes.txt" in tokenizer.decode(
        backend.prompts[1], skip_special_tokens=False)


def test_the_server_reads_special_token_markers_from_the_ids(special_tokenizer):
    from tsterm.outputs import CompletionOutput
    from tsterm.server.tool_choice import reply_parser
    from tsterm.server.tool_stream import CallArguments, CallStart

    tokenizer = special_tokenizer
    state = ServerState(engine=None, tokenizer=tokenizer, model_name="kimi", max_model_len=4096)
    parser = reply_parser(ToolUse([READ], True, False), state=state)
    ids = tokenizer.encode("Let me look." + kimi_turn(("read_file", {"path": "a b"}, 7))) + [tokenizer.eos_token_ids[0]]
    pieces, shown = [], ""
    for n in range(1, len(ids) + 1):
        text, done = tokenizer.decode(ids[:n]), n == len(ids)
        output = CompletionOutput(0, ids[:n], text, "stop" if done else None, ids[-1] if done else None,
                                  delta_text=text[len(shown):])
        pieces += parser.feed(parser.text(output), done, output.stop_reason)
        shown = text
    assert "".join(p for p in pieces if isinstance(p, str)) == "Let me look."
    assert [(p.id, p.name) for p in pieces if isinstance(p, CallStart)] == [("functions.read_file:7", "read_file")]
    assert json.loads("".join(p.text for p in pieces if isinstance(p, CallArguments))) == {"path": "a b"}
    assert parser.finish_reason("stop") == "tool_calls"

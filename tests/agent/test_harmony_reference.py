"""tsterm's harmony prompts against the `openai-harmony` package's own rendering (OpenAI's reference renderer for
gpt-oss), and harmony's rendered completions read back by tsterm's HarmonyParser.

openai-harmony loads the o200k_base vocabulary, which it would download; offline, its `TIKTOKEN_ENCODINGS_BASE` names a
directory holding `o200k_base.tiktoken`, whose sha256 it checks. The file is rebuilt here from the o200k vocabulary the
`quicktok-v1` package ships (its own binary layout: a count, then per token its length, bytes and rank) as tiktoken's
text form (base64 token, space, rank), and its sha256 is checked against the one openai-harmony expects. So the ids
compared are the real o200k_harmony ids: tsterm's rendered text encoded by harmony's own tokenizer must be the ids
harmony renders."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import struct
from pathlib import Path

import pytest

from tsterm.agent.harmony import HarmonyParser, ReasoningDelta, render
from tsterm.agent.tool_calls import TextDelta, ToolCall

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # what openai-harmony checks
DATE = "2025-06-28"


def o200k_base(directory: Path) -> Path:
    """`directory`/o200k_base.tiktoken, rebuilt from quicktok-v1's o200k vocabulary (see the module docstring)."""
    spec = importlib.util.find_spec("quicktok")  # its data only: the package itself is not imported
    assert spec is not None and spec.submodule_search_locations, "quicktok-v1 (a test dependency) is not installed"
    data = (Path(spec.submodule_search_locations[0]) / "data" / "o200k.vocab").read_bytes()
    (count,), at, ranks = struct.unpack_from("<I", data), 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, at)
        token = data[at + 2:at + 2 + length]
        (rank,) = struct.unpack_from("<I", data, at + 2 + length)
        ranks.append((rank, token))
        at += 6 + length
    assert at == len(data)
    text = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in sorted(ranks)).encode()
    assert hashlib.sha256(text).hexdigest() == O200K_SHA256
    (directory / "o200k_base.tiktoken").write_bytes(text)
    return directory


@pytest.fixture(scope="module")
def encoding(tmp_path_factory):
    import openai_harmony as h

    directory = o200k_base(tmp_path_factory.mktemp("tiktoken"))
    saved = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(directory)
    try:
        yield h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = saved


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Gets the weather.\nUse it for current conditions.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "integer", "default": 1}, "hourly": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "description": "A place", "properties": {
            "lat": {"type": "number"}, "lon": {"type": ["number", "string"]}}, "required": ["lat"]},
        "note": {"type": "string", "nullable": True, "title": "Note", "examples": ["dry", "wet"]},
        "mode": {"description": "How", "oneOf": [{"type": "string", "description": "How"},
                                                  {"type": "number", "default": 2, "description": "a level"}]}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the notes.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                                          "required": ["q"]}}}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}
TOOLS = [WEATHER, SEARCH, NOW]


def harmony_conversation(h, messages: list[dict], tools: list[dict] | None, effort: str, identity: str | None,
                         date: str | None):
    """The same conversation in openai-harmony's types, as vLLM builds it for gpt-oss."""
    system = h.SystemContent.new().with_reasoning_effort(h.ReasoningEffort(effort.capitalize()))
    if identity:
        system = system.with_model_identity(identity)
    if date:
        system = system.with_conversation_start_date(date)
    out = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    rest = messages
    instructions = None
    if messages[0]["role"] in ("system", "developer"):
        instructions, rest = messages[0]["content"], messages[1:]
    if instructions or tools:
        developer = h.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools([h.ToolDescription.new(
                t["function"]["name"], t["function"]["description"], parameters=t["function"].get("parameters"))
                for t in tools])
        out.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    names = {}
    for message in rest:
        role = message["role"]
        if role == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, message["content"]))
        elif role == "assistant":
            if message.get("reasoning_content"):
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, message["reasoning_content"])
                           .with_channel("analysis"))
            calls = message.get("tool_calls") or []
            if not calls:
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, message["content"]).with_channel("final"))
                continue
            if message.get("content"):
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, message["content"])
                           .with_channel("commentary"))
            for call in calls:
                names[call["id"]] = call["function"]["name"]
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, call["function"]["arguments"])
                           .with_channel("commentary").with_recipient(f"functions.{call['function']['name']}")
                           .with_content_type("<|constrain|>json"))
        elif role == "tool":
            author = h.Author.new(h.Role.TOOL, f"functions.{names[message['tool_call_id']]}")
            out.append(h.Message.from_author_and_content(author, message["content"]).with_channel("commentary")
                       .with_recipient("assistant"))
    return h.Conversation.from_messages(out)


def call(i: int, name: str, arguments: dict) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}}


ASK = {"role": "user", "content": "What's the weather in Oslo, and what do my notes say about it?"}
CALLING = {"role": "assistant", "content": "", "reasoning_content": "Need the weather first.",
           "tool_calls": [call(0, "get_weather", {"city": "Oslo", "unit": "celsius"})]}
RESULT = {"role": "tool", "tool_call_id": "call_0", "content": '{"celsius": 21, "sky": "clear"}'}
TWO_CALLS = {"role": "assistant", "content": "Checking both.", "reasoning_content": "Search too.",
             "tool_calls": [call(1, "search", {"q": "Oslo"}), call(2, "now", {})]}
RESULTS = [{"role": "tool", "tool_call_id": "call_1", "content": "no notes"},
           {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
ANSWER = {"role": "assistant", "content": "21 °C and clear; your notes say nothing.", "reasoning_content": "Done."}
CASES = {
    "plain": ([{"role": "user", "content": "Hi"}], None, "low", None, DATE),
    "instructions, no date": ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
                              None, "high", "You are a test model.", ""),
    "tools": ([{"role": "developer", "content": "Be brief."}, ASK], TOOLS, "medium", None, DATE),
    "a call and its result": ([ASK, CALLING, RESULT], TOOLS, "medium", None, DATE),
    "a preamble and two calls": ([ASK, CALLING, RESULT, TWO_CALLS, *RESULTS], TOOLS, "medium", None, DATE),
    "after the answer": ([ASK, CALLING, RESULT, TWO_CALLS, *RESULTS, ANSWER,
                          {"role": "user", "content": "Thanks!"}], TOOLS, "low", None, DATE),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tsterm_renders_what_openai_harmony_renders(encoding, case):
    import openai_harmony as h

    messages, tools, effort, identity, date = CASES[case]
    ours = render(messages, tools, reasoning_effort=effort, model_identity=identity, conversation_start_date=date)
    theirs = encoding.render_conversation_for_completion(
        harmony_conversation(h, messages, tools, effort, identity, date), h.Role.ASSISTANT)
    assert ours == encoding.decode_utf8(theirs)
    assert encoding.encode(ours, allowed_special="all") == theirs  # the same ids, piece boundaries included
    if case == "a preamble and two calls":  # a tool loop in progress keeps its reasoning
        assert "Need the weather first." in ours and "Search too." in ours
    if case == "after the answer":  # after a final answer every earlier reasoning is gone
        assert "Need the weather first." not in ours and "Done." not in ours


def test_where_the_drop_rules_part(encoding):
    """A second turn's reasoning: the checkpoint's template (and tsterm) drop it once the turn has its answer;
    openai-harmony 0.0.8 drops only the analysis before the conversation's first final message. tsterm renders what
    harmony renders for the conversation without that reasoning."""
    import openai_harmony as h

    second = {"role": "assistant", "content": "It is 12:00.", "reasoning_content": "Time asked."}
    messages = [ASK, ANSWER, {"role": "user", "content": "Time?"}, second, {"role": "user", "content": "Thanks"}]
    ours = render(messages, TOOLS, conversation_start_date=DATE)
    theirs = encoding.decode_utf8(encoding.render_conversation_for_completion(
        harmony_conversation(h, messages, TOOLS, "medium", None, DATE), h.Role.ASSISTANT))
    assert "Time asked." in theirs and "Time asked." not in ours
    without = [ASK, ANSWER, messages[2], {**second, "reasoning_content": ""}, messages[4]]
    assert ours == encoding.decode_utf8(encoding.render_conversation_for_completion(
        harmony_conversation(h, without, TOOLS, "medium", None, DATE), h.Role.ASSISTANT))


def completion(encoding, h, messages) -> str:
    """What the model writes for `messages` (harmony's rendering after the prompt's `<|start|>assistant`): the
    training rendering (its analysis kept), whose final message ends `<|return|>`."""
    ids = encoding.render_conversation_for_training(h.Conversation.from_messages(messages),
                                                    h.RenderConversationConfig(auto_drop_analysis=False))
    text = encoding.decode_utf8(ids)
    assert text.startswith("<|start|>assistant")
    return text.removeprefix("<|start|>assistant")


def test_harmony_s_completions_read_back(encoding):
    import openai_harmony as h

    A = h.Role.ASSISTANT
    arguments = '{"city":"Oslo","unit":"celsius"}'
    turn = completion(encoding, h, [
        h.Message.from_role_and_content(A, "Need the weather.").with_channel("analysis"),
        h.Message.from_role_and_content(A, "Let me check.").with_channel("commentary"),
        h.Message.from_role_and_content(A, arguments).with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json")])
    assert turn.endswith("<|call|>")
    for chunk in (len(turn), 1, 7):  # whole, and streamed in pieces
        parser = HarmonyParser(TOOLS)
        events = []
        for i in range(0, len(turn), chunk):
            events += parser.feed(turn[i:i + chunk])
        events += parser.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        [tool_call] = [e for e in events if isinstance(e, ToolCall)]
        assert (reasoning, text) == ("Need the weather.", "Let me check.")
        assert tool_call.ok and (tool_call.name, tool_call.arguments) == ("get_weather", json.loads(arguments))
    answer = completion(encoding, h, [
        h.Message.from_role_and_content(A, "Easy.").with_channel("analysis"),
        h.Message.from_role_and_content(A, "21 °C.").with_channel("final")])
    assert answer.endswith("<|return|>")
    parser = HarmonyParser(TOOLS)
    events = parser.feed(answer) + parser.finish()
    assert events == [ReasoningDelta("Easy."), TextDelta("21 °C.")]
    # and harmony's own parser reads tsterm's rendering of the same turn as those messages
    ours = render([ASK, {"role": "assistant", "content": "", "reasoning_content": "Need the weather.",
                         "tool_calls": [call(0, "get_weather", json.loads(arguments))]}], TOOLS,
                  add_generation_prompt=False, conversation_start_date=DATE)
    tail = ours[ours.index("<|start|>user"):]
    parsed = encoding.parse_messages_from_completion_tokens(encoding.encode(tail, allowed_special="all"), None)
    assert [(m.author.role, m.channel, m.recipient) for m in parsed[1:]] == [
        (A, "analysis", None), (A, "commentary", "functions.get_weather")]
    assert parsed[2].content[0].text == arguments

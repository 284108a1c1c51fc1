"""gpt-oss's harmony turns (tsterm.agent.harmony) on replies written as the format's spec renders them: reasoning on
the analysis channel, text on the final channel and in commentary preambles, tool calls as commentary messages to
`functions.NAME` ended by <|call|> (the recipient before or after the channel), checked against the offered tools;
streamed one character at a time the parser gives what it gives on the whole turn."""
from __future__ import annotations

import json

import pytest

from tsterm.agent.harmony import Header, HarmonyParser, ReasoningDelta, parse
from tsterm.agent.tool_calls import TextDelta, ToolCall

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def call_message(name: str, arguments: dict, recipient_first: bool = False) -> str:
    """One call as the spec writes it (`<|start|>assistant` is the previous message's or the prompt's)."""
    if recipient_first:
        return f" to=functions.{name}<|channel|>commentary json<|message|>{json.dumps(arguments)}<|call|>"
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(arguments)}<|call|>"


def streamed(text: str, tools=TOOLS) -> list:
    """The events of `text` fed one character at a time, adjacent deltas of one kind merged."""
    parser = HarmonyParser(tools)
    events = []
    for ch in text:
        events += parser.feed(ch)
    events += parser.finish()
    merged = []
    for event in events:
        if merged and type(event) is type(merged[-1]) and isinstance(event, (TextDelta, ReasoningDelta)):
            merged[-1] = type(event)(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


def test_reasoning_then_a_call():
    turn = ("<|channel|>analysis<|message|>The user wants Tokyo's weather; call the tool.<|end|>"
            "<|start|>assistant" + call_message("get_weather", {"city": "Tokyo", "days": 2}))
    events = parse(turn, TOOLS)
    assert events[0] == ReasoningDelta("The user wants Tokyo's weather; call the tool.")
    call = events[1]
    assert isinstance(call, ToolCall) and call.ok and len(events) == 2
    assert (call.id, call.name, call.arguments) == ("call_0", "get_weather", {"city": "Tokyo", "days": 2})
    assert turn.endswith(call.raw) and call.raw.startswith("<|start|>assistant<|channel|>commentary to=functions.")
    assert streamed(turn) == events


def test_the_recipient_may_come_before_the_channel():
    turn = "<|channel|>analysis<|message|>ok<|end|><|start|>assistant" + call_message("get_weather", {"city": "Oslo"},
                                                                                      recipient_first=True)
    events = parse(turn, TOOLS)
    assert [type(e) for e in events] == [ReasoningDelta, ToolCall]
    assert events[1].ok and events[1].arguments == {"city": "Oslo"}
    assert Header.parse(" to=functions.get_weather<|channel|>commentary json") == \
        Header("commentary", "functions.get_weather", "json")


def test_a_final_answer_and_a_preamble_are_text():
    turn = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary<|message|>Checking the "
            "forecast.<|end|><|start|>assistant" + call_message("get_weather", {"city": "Lima"}))
    events = parse(turn, TOOLS)
    assert events[:2] == [ReasoningDelta("think"), TextDelta("Checking the forecast.")]
    assert events[2].name == "get_weather" and events[2].ok
    answer = "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny, " \
             "22 °C in <b>Lima</b>.<|return|>"
    assert parse(answer, TOOLS) == [ReasoningDelta("It is sunny."), TextDelta("Sunny, 22 °C in <b>Lima</b>.")]
    assert streamed(answer) == parse(answer, TOOLS)


def test_two_calls_count_their_ids():
    turn = call_message("get_weather", {"city": "A"}) + "<|start|>assistant" + call_message("get_weather",
                                                                                           {"city": "B"})
    calls = parse(turn, TOOLS)
    assert [(c.id, c.arguments["city"]) for c in calls] == [("call_0", "A"), ("call_1", "B")]


@pytest.mark.parametrize("turn, problem", [
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": <|call|>", "not valid JSON"),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>[1]<|call|>", "must be a JSON object"),
    ("<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}<|call|>", "unknown tool 'launch'"),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"days\": 1}<|call|>", "city"),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"X\"}", "incomplete"),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"X\"}<|end|>",
     "<|call|>"),
])
def test_a_malformed_call_says_what_to_fix(turn, problem):
    events = parse(turn, TOOLS)
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert len(calls) == 1 and not calls[0].ok and problem in calls[0].error, calls[0].error
    assert streamed(turn) == events


def test_text_that_is_not_harmony_is_text():
    assert parse("plain reply, no markers", TOOLS) == [TextDelta("plain reply, no markers")]
    assert parse("<|channel|>final<|message|>cut off", TOOLS) == [TextDelta("cut off")]  # no <|return|>: kept


def test_a_marker_split_across_deltas_is_held_back():
    parser = HarmonyParser(TOOLS)
    assert parser.feed("<|channel|>final<|message|>Hi<|re") == [TextDelta("Hi")]
    assert parser.feed("turn|>") == [] and parser.finish() == []

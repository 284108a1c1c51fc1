"""The tool-call parser: both formats, several calls per turn, any chunking of the stream, truncation anywhere, and
malformed calls that come back as error calls instead of a crash or a silently dropped call."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tsterm.agent.tool_calls import CLOSE_TAG, OPEN_TAG, TextDelta, ToolCall, ToolCallParser, check_schema

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["path"], "additionalProperties": False}}}
EDIT = {"type": "function", "function": {
    "name": "edit", "description": "Edit a file.",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "text": {"type": "string"}, "line": {"type": "integer"},
        "dry_run": {"type": "boolean"}, "ranges": {"type": "array", "items": {"type": "integer"}},
        "options": {"type": "object"}, "mode": {"enum": ["replace", "append"]}},
        "required": ["path"]}}}
TOOLS = [READ_FILE, EDIT]


def hermes(name, arguments) -> str:
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE_TAG}"


def coder(name, parameters: dict[str, str]) -> str:
    inner = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"{OPEN_TAG}\n<function={name}>\n{inner}</function>\n{CLOSE_TAG}"


def run(chunks, tools=None, **options) -> list:
    parser = ToolCallParser(tools, **options)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def text_of(events) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


def calls_of(events) -> list[ToolCall]:
    return [event for event in events if isinstance(event, ToolCall)]


def shape(events) -> list:
    """The events with adjacent text merged: what any chunking of the same stream must give."""
    merged: list = []
    for event in events:
        if isinstance(event, TextDelta) and merged and isinstance(merged[-1], str):
            merged[-1] += event.text
        else:
            merged.append(event.text if isinstance(event, TextDelta) else event)
    return merged


def rebuilt(events) -> str:
    return "".join(event.text if isinstance(event, TextDelta) else event.raw for event in events)


# ---- the formats

def test_hermes_calls_with_text_around_them():
    stream = ("Let me look. " + hermes("read_file", {"path": "a.py"}) + "\n\nand "
              + hermes("read_file", {"path": "b.py", "limit": 3}) + " done.")
    events = run([stream], TOOLS)
    assert shape(events)[0] == "Let me look. " and shape(events)[2] == "\n\nand " and shape(events)[4] == " done."
    calls = calls_of(events)
    assert [(c.id, c.name, c.arguments, c.error) for c in calls] == [
        ("call_0", "read_file", {"path": "a.py"}, None), ("call_1", "read_file", {"path": "b.py", "limit": 3}, None)]
    assert rebuilt(events) == stream


def test_hermes_arguments_may_be_a_json_string():
    stream = OPEN_TAG + json.dumps({"name": "read_file", "arguments": json.dumps({"path": "x"})}) + CLOSE_TAG
    [call] = calls_of(run([stream], TOOLS))
    assert call.ok and call.arguments == {"path": "x"}


def test_coder_calls_convert_values_with_the_schema():
    stream = ("Editing.\n" + coder("edit", {
        "path": "src/a.py", "text": "\ndef f():\n    return 1\n", "line": "12", "dry_run": "True",
        "ranges": "[1, 2]", "options": '{"force": true}', "mode": "append"})
        + "\n" + coder("read_file", {"path": "  spaced  "}) + "bye")
    events = run([stream], TOOLS)
    first, second = calls_of(events)
    assert first.ok and first.name == "edit" and first.arguments == {
        "path": "src/a.py", "text": "\ndef f():\n    return 1\n", "line": 12, "dry_run": True, "ranges": [1, 2],
        "options": {"force": True}, "mode": "append"}
    assert second.ok and second.arguments == {"path": "  spaced  "}  # only one newline each side is the form's
    assert text_of(events) == "Editing.\n\nbye" and rebuilt(events) == stream


def test_coder_values_stay_text_without_tools():
    [call] = calls_of(run([coder("anything", {"n": "5"})]))
    assert call.ok and call.arguments == {"n": "5"}


def test_no_tools_given_accepts_any_name():
    [call] = calls_of(run([hermes("whatever", {"x": [1, {"y": None}]})]))
    assert call.ok and call.name == "whatever" and call.arguments == {"x": [1, {"y": None}]}


def test_ids_are_deterministic_per_turn():
    stream = hermes("a", {}) + hermes("b", {}) + coder("c", {})
    assert [c.id for c in calls_of(run([stream], id_prefix="turn3_"))] == ["turn3_0", "turn3_1", "turn3_2"]
    assert [c.id for c in calls_of(run([stream]))] == ["call_0", "call_1", "call_2"]


# ---- streaming

FIXED_STREAM = ("I'll check a < b, <tool and </tool_call> stray. " + hermes("read_file", {"path": "a<tool_c.py"})
                + " then\n" + coder("edit", {"path": "x", "line": "7"}) + "<tool_cal" + OPEN_TAG + "{bad json"
                + CLOSE_TAG + " the end <tool_ca")


def test_every_split_gives_the_events_of_one_feed():
    whole = shape(run([FIXED_STREAM], TOOLS))
    assert [e for e in whole if isinstance(e, str)] == [
        "I'll check a < b, <tool and </tool_call> stray. ", " then\n", "<tool_cal", " the end <tool_ca"]
    assert [(c.name, c.ok) for c in whole if isinstance(c, ToolCall)] == [
        ("read_file", True), ("edit", True), ("", False)]
    assert shape(run(list(FIXED_STREAM), TOOLS)) == whole
    for cut in range(len(FIXED_STREAM) + 1):
        assert shape(run([FIXED_STREAM[:cut], FIXED_STREAM[cut:]], TOOLS)) == whole, cut
    short = FIXED_STREAM[40:140]  # every three-piece split of a window holding a whole call and tags around it
    short_whole = shape(run([short], TOOLS))
    for first in range(len(short) + 1):
        for second in range(first, len(short) + 1):
            assert shape(run([short[:first], short[first:second], short[second:]], TOOLS)) == short_whole


def test_a_partial_tag_is_held_back_until_it_cannot_be_one():
    parser = ToolCallParser()
    assert parser.feed("hello <tool_") == [TextDelta("hello ")]
    assert parser.feed("ca") == []
    assert parser.feed("x") == [TextDelta("<tool_cax")]
    assert parser.feed(" <tool_call") == [TextDelta(" ")]
    assert parser.feed('>{"name": "f"}') == []  # inside a call: nothing shows
    call, space = parser.feed(f"{CLOSE_TAG} <")
    assert call.name == "f" and call.ok and space == TextDelta(" ")
    assert parser.finish() == [TextDelta("<")]  # held back to the end: never became a tag, released


def test_feed_after_finish_is_an_error_and_finish_is_idempotent():
    parser = ToolCallParser()
    assert parser.feed("x <") == [TextDelta("x ")]
    assert parser.finish() == [TextDelta("<")] and parser.finish() == []
    with pytest.raises(RuntimeError, match="one parser per turn"):
        parser.feed("y")


# ---- malformed calls: error calls, never a crash or a dropped call

@pytest.mark.parametrize("body, error", [
    ('{"name": "read_file", "arguments": {"path": "a"', "not valid JSON"),
    ('["read_file"]', "tool call JSON is a array"),
    ('{"arguments": {"path": "a"}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": "rm_rf", "arguments": {}}', "unknown tool 'rm_rf'; available tools: edit, read_file"),
    ('{"name": "read_file", "arguments": [1]}', '"arguments" must be an object, got array'),
    ('{"name": "read_file", "arguments": "{oops"}', '"arguments" is a string that is not JSON'),
    ('{"name": "read_file", "arguments": {}}', "arguments: missing required field 'path'"),
    ('{"name": "read_file", "arguments": {"path": 3}}', "arguments.path: expected string, got integer 3"),
    ('{"name": "read_file", "arguments": {"path": "a", "mode": "x"}}',
     "arguments: unexpected field 'mode' (allowed: path, limit)"),
    ('{"name": "edit", "arguments": {"path": "a", "ranges": [1, "two"]}}', "arguments.ranges[1]: expected integer"),
    ('{"name": "edit", "arguments": {"path": "a", "mode": "delete"}}', 'arguments.mode: "delete" is not one of'),
    ("   ", "empty tool call"),
    ("<function=edit>\n<parameter=path>\na\n</parameter>\n", "</function> missing"),
    ("<function=edit>\n<parameter=path>\na\n</parameter>\n<parameter=line>\nten\n</parameter>\n</function>",
     "parameter 'line': expected integer as JSON, got 'ten'"),
    ("<function=edit>\n<parameter=path>\na\n</function>", "is </parameter> missing?"),
    ("<function=edit>\n<parameter=path>\na\n</parameter><parameter=path>\nb\n</parameter></function>", "given twice"),
    ("<function=>\n</function>", "<function=> has no name"),
    ("<function=nope>\n</function>", "unknown tool 'nope'"),
])
def test_malformed_calls_become_error_calls(body, error):
    stream = "before " + OPEN_TAG + body + CLOSE_TAG + " after"
    events = run([stream], TOOLS)
    [call] = calls_of(events)
    assert not call.ok and error in call.error, call.error
    assert call.raw == OPEN_TAG + body + CLOSE_TAG and text_of(events) == "before  after"


def test_schema_errors_name_every_bad_field():
    [call] = calls_of(run([hermes("edit", {"line": "3", "dry_run": 1})], TOOLS))
    assert call.name == "edit" and call.arguments == {"line": "3", "dry_run": 1}  # what was read is kept
    for part in ("missing required field 'path'", "arguments.line: expected integer", "arguments.dry_run"):
        assert part in call.error


def test_a_nested_open_tag_ends_the_first_call_as_an_error():
    stream = OPEN_TAG + '{"name": "read_file", ' + hermes("read_file", {"path": "a"}) + "ok"
    events = run([stream], TOOLS)
    first, second = calls_of(events)
    assert not first.ok and "a new <tool_call> began" in first.error
    assert first.raw == OPEN_TAG + '{"name": "read_file", '
    assert second.ok and second.arguments == {"path": "a"} and (first.id, second.id) == ("call_0", "call_1")
    assert text_of(events) == "ok" and rebuilt(events) == stream


def test_an_unterminated_call_is_an_error_call_at_finish():
    parser = ToolCallParser(TOOLS)
    assert parser.feed("text " + OPEN_TAG + '{"name": "read_file", "arguments": {"path": "a"}}') == [TextDelta("text ")]
    [call] = parser.finish()
    assert not call.ok and "ended before </tool_call>" in call.error
    assert call.name == "read_file" and call.raw == OPEN_TAG + '{"name": "read_file", "arguments": {"path": "a"}}'


@pytest.mark.parametrize("tools, message", [
    ([{"type": "function", "function": {"description": "no name"}}], "tools\\[0\\]"),
    ([READ_FILE, READ_FILE], "given twice"),
    ([{"type": "retrieval"}], "tools\\[0\\]"),
    ([{"name": "f", "parameters": "object"}], "parameters must be a JSON schema"),
])
def test_bad_tool_specs_are_refused_up_front(tools, message):
    with pytest.raises(ValueError, match=message):
        ToolCallParser(tools)


def test_check_schema_types():
    assert check_schema(2.0, {"type": "integer"}, "x") == []  # JSON Schema: 2.0 is an integer
    assert check_schema(True, {"type": "integer"}, "x") == ["x: expected integer, got boolean true"]
    assert check_schema(None, {"type": ["string", "null"]}, "x") == []
    assert check_schema({"a": 1}, {"type": "object", "additionalProperties": {"type": "string"}}, "x") == [
        "x.a: expected string, got integer 1"]


def test_check_schema_is_full_json_schema():
    """jsonschema checks every keyword (not a subset): each problem still names its field by path."""
    schema = {"type": "object", "$defs": {"name": {"type": "string", "minLength": 1, "pattern": "^[a-z]+$"}},
              "properties": {"names": {"type": "array", "items": {"$ref": "#/$defs/name"}, "maxItems": 3},
                             "limit": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "null"}]}}}
    assert check_schema({"names": ["ok", "", "Bad"], "limit": None}, schema, "arguments") == [
        "arguments.names[1]: '' should be non-empty", "arguments.names[1]: '' does not match '^[a-z]+$'",
        "arguments.names[2]: 'Bad' does not match '^[a-z]+$'"]
    assert check_schema({"names": ["a", "b", "c", "d"], "limit": 0}, schema, "arguments") == [
        "arguments.names: ['a', 'b', 'c', 'd'] is too long",
        "arguments.limit: 0 is not valid under any of the given schemas"]
    assert check_schema({"names": ["ok"], "limit": 3}, schema, "arguments") == []


def test_a_schema_with_a_mistake_is_checked_as_far_as_it_can_be():
    """A client's schema with an unknown type or a reference to nothing: the calls are still read, never crash."""
    typo = {"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "int"}}}
    assert check_schema({"path": 3, "n": 1}, typo, "arguments") == ["arguments.path: expected string, got integer 3"]
    dangling = {"type": "object", "properties": {"path": {"$ref": "#/$defs/nowhere"}}}
    assert check_schema({"path": "a"}, dangling, "arguments")[0].startswith(
        "arguments: the tool's schema has a reference that cannot be resolved")
    parser = ToolCallParser([{"name": "f", "parameters": typo}])
    (call,) = [e for e in parser.feed('<tool_call>{"name": "f", "arguments": {"path": "a", "n": 1}}</tool_call>')
               if isinstance(e, ToolCall)]
    assert call.ok and call.arguments == {"path": "a", "n": 1}


# ---- properties

TAGGY = ["<", "<tool", "<tool_call", "</tool_call>", "tool_call>", "<function=x>", "</parameter>", ">", "\n", " ", "{"]
texts = st.lists(st.one_of(st.sampled_from(TAGGY), st.text(max_size=6)), max_size=8).map("".join).filter(
    lambda text: OPEN_TAG not in text)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
typed_values = st.one_of(
    st.tuples(st.just("string"), st.text(max_size=12).filter(lambda text: "</parameter>" not in text)),
    st.tuples(st.just("integer"), st.integers()),
    st.tuples(st.just("number"), st.floats(allow_nan=False, allow_infinity=False)),
    st.tuples(st.just("boolean"), st.booleans()),
    st.tuples(st.just("array"), st.lists(st.integers(), max_size=3)),
    st.tuples(st.just("object"), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2)))


@st.composite
def generated_call(draw, index: int):
    """(raw text, name, arguments, tool spec) for one call in either format; the name is unique in the turn."""
    name = f"{draw(names)}_{index}"
    if draw(st.booleans()):
        arguments = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
        payload = json.dumps(arguments) if draw(st.booleans()) else arguments
        raw = f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': payload})}\n{CLOSE_TAG}"
        schema = {"type": "object"}
    else:
        typed = draw(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True), typed_values, max_size=4))
        arguments = {key: value for key, (_, value) in typed.items()}
        raw = coder(name, {key: value if kind == "string" else json.dumps(value)
                           for key, (kind, value) in typed.items()})
        schema = {"type": "object", "properties": {key: {"type": kind} for key, (kind, _) in typed.items()},
                  "required": list(typed), "additionalProperties": False}
    if raw.count(OPEN_TAG) != 1 or raw.count(CLOSE_TAG) != 1:  # the known limit: a tag inside a value
        raw, arguments = f"{OPEN_TAG}{json.dumps({'name': name})}{CLOSE_TAG}", {}
    return raw, name, arguments, {"type": "function", "function": {"name": name, "parameters": schema}}


@st.composite
def turns(draw):
    """A turn: text, call, text, call, ..., text. Returns (segments as (kind, text, call or None), tools)."""
    calls = [draw(generated_call(index)) for index in range(draw(st.integers(0, 4)))]
    segments = [("text", draw(texts), None)]
    for raw, name, arguments, _ in calls:
        segments += [("call", raw, (name, arguments)), ("text", draw(texts), None)]
    return segments, [spec for *_, spec in calls]


def chunked(data, stream: str) -> list[str]:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    return [stream[start:end] for start, end in zip([0, *cuts], [*cuts, len(stream)])]


@PROPERTY
@given(st.text(), st.data())
def test_text_without_a_call_passes_through_exactly(text, data):
    text = text.replace(OPEN_TAG, "")
    assert text_of(run(chunked(data, text))) == text
    assert calls_of(run(chunked(data, text))) == []


@PROPERTY
@given(texts, st.data())
def test_tag_like_text_without_a_call_passes_through_exactly(text, data):
    events = run(chunked(data, text), TOOLS)
    assert text_of(events) == text and calls_of(events) == []


@PROPERTY
@given(turns(), st.data())
def test_generated_calls_in_random_chunks_are_recovered_exactly(turn, data):
    segments, tools = turn
    stream = "".join(text for _, text, _ in segments)
    events = run(chunked(data, stream), tools)
    assert text_of(events) == "".join(text for kind, text, _ in segments if kind == "text")
    calls = calls_of(events)
    expected = [(f"call_{i}", *call, raw, None) for i, (_, raw, call) in
                enumerate(s for s in segments if s[0] == "call")]
    assert [(c.id, c.name, c.arguments, c.raw, c.error) for c in calls] == expected


@PROPERTY
@given(turns(), st.data())
def test_a_stream_cut_anywhere_never_raises_nor_shows_a_tag(turn, data):
    segments, tools = turn
    stream = "".join(text for _, text, _ in segments)
    cut = data.draw(st.integers(0, len(stream)))
    events = run(chunked(data, stream[:cut]), tools)
    # what the cut leaves: whole segments before it, then the segment it falls in
    expected_text, expected_calls, position = "", [], 0
    for kind, text, call in segments:
        kept = text[:max(0, cut - position)]
        position += len(text)
        if kind == "text" or (kept and len(kept) < len(OPEN_TAG)):  # a partial open tag at the end is text
            expected_text += kept
        elif kept == text:
            expected_calls.append((*call, text, False))
        elif kept:
            expected_calls.append(("?", "?", kept, True))
    # no text between two calls (or the ends) shows an open tag; texts on both sides of a call may join into one
    # ("<tool_call" + call + ">"), which is the model's text, not a tag the parser left
    assert text_of(events) == expected_text
    assert not any(isinstance(run_, str) and OPEN_TAG in run_ for run_ in shape(events))
    calls = calls_of(events)
    assert [c.raw for c in calls] == [raw for *_, raw, _ in expected_calls]
    for call, (name, arguments, _, open_at_cut) in zip(calls, expected_calls):
        if open_at_cut:
            assert not call.ok and "ended before </tool_call>" in call.error
        else:
            assert call.ok and (call.name, call.arguments) == (name, arguments)
    assert rebuilt(events) == stream[:cut]

"""Tool calls streamed in pieces, and tool_choice required / any / named constraining generation, on a real server and
engine (agent-demo on the CPU, which was trained to call `calculator`), driven by the official clients."""
from __future__ import annotations

import json

import anthropic
import llguidance
import openai
import pytest

from tests.server.conftest import MODEL
from tsterm.agent.tools import Calculator
from tsterm.server.app import create_app
from tsterm.server.serve import BackgroundServer, build_state
from tsterm.server.tool_stream import CallArguments, CallEnd, CallScanner, CallStart, ReplyParser

TOOLS = [Calculator().spec()]
_SPEC = TOOLS[0]["function"]
ANTHROPIC_TOOLS = [{"name": _SPEC["name"], "description": _SPEC["description"], "input_schema": _SPEC["parameters"]}]
GREEDY = {"temperature": 0}
TWO_CALLS = [{"role": "user", "content": "What is 12 + 7 and 3 * 45?"}]  # the model answers with two calls
GREETING = [{"role": "user", "content": "Hello"}]  # the model answers in text under "auto"
NAMED = {"type": "function", "function": {"name": "calculator"}}


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _tool_deltas(chunks, choice: int = 0) -> list:
    return [d for c in chunks for ch in c.choices if ch.index == choice for d in ch.delta.tool_calls or []]


def test_openai_stream_sends_arguments_in_pieces_that_rebuild_the_reply(client):
    kwargs = dict(model=MODEL, messages=TWO_CALLS, tools=TOOLS, temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 2
    with client.chat.completions.stream(**kwargs) as stream:  # the client's own accumulation
        final = stream.get_final_completion().choices[0]
    assert _calls(final.message) == _calls(whole.message) and final.finish_reason == "tool_calls"
    assert [c.index for c in final.message.tool_calls] == [0, 1]

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = _tool_deltas(chunks)
    for index, (name, arguments) in enumerate(_calls(whole.message)):
        mine = [d for d in deltas if d.index == index]
        first, rest = mine[0], mine[1:]
        assert first.id and first.type == "function" and first.function.name == name
        assert first.function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in rest)
        assert len(rest) > 1  # the arguments came in several fragments
        assert "".join(d.function.arguments for d in rest) == arguments
    ids = [d.id for d in deltas if d.id]
    assert len(ids) == len(set(ids)) == 2
    assert [d.index for d in deltas] == sorted(d.index for d in deltas)  # call 0 ends before call 1 starts
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_2_streams_each_choice_its_own_calls(client):
    kwargs = dict(model=MODEL, messages=TWO_CALLS, tools=TOOLS, temperature=0, max_tokens=80, n=2)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for choice in whole.choices:
        deltas = _tool_deltas(chunks, choice.index)
        streamed = {}
        for d in deltas:
            name, arguments = streamed.get(d.index, ("", ""))
            streamed[d.index] = (name + (d.function.name or ""), arguments + d.function.arguments)
        assert [streamed[i] for i in sorted(streamed)] == _calls(choice.message)
        assert sorted({d.index for d in deltas}) == [0, 1]


def test_anthropic_stream_sends_input_json_in_pieces_that_rebuild_the_reply(claude):
    kwargs = dict(model=MODEL, max_tokens=80, messages=TWO_CALLS, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    blocks = [(b.type, b.name, b.input) for b in whole.content]
    assert [b[0] for b in blocks] == ["tool_use", "tool_use"] and whole.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == blocks and final.stop_reason == "tool_use"
    assert len({b.id for b in final.content}) == 2
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type, e.content_block.input) for e in starts] == [(0, "tool_use", {}),
                                                                                         (1, "tool_use", {})]
    for index in (0, 1):
        fragments = [e.delta.partial_json for e in events
                     if e.type == "content_block_delta" and e.index == index and e.delta.type == "input_json_delta"]
        assert len(fragments) > 1 and json.loads("".join(fragments)) == whole.content[index].input
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]


def test_required_makes_a_greeting_a_call_through_the_grammar(client, llm):
    kwargs = dict(model=MODEL, messages=GREETING, tools=TOOLS, temperature=0, max_tokens=40)
    auto = client.chat.completions.create(**kwargs)
    assert auto.choices[0].finish_reason == "stop" and not auto.choices[0].message.tool_calls
    required = client.chat.completions.create(**kwargs, tool_choice="required")
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    ((name, arguments),) = _calls(choice.message)
    assert name == "calculator" and set(json.loads(arguments)) == {"expression"}
    assert required.usage.prompt_tokens == auto.usage.prompt_tokens  # the grammar adds no prompt tokens
    assert required.usage.total_tokens == required.usage.prompt_tokens + required.usage.completion_tokens
    with client.chat.completions.stream(**kwargs, tool_choice="required") as stream:
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message) == _calls(choice.message)


def test_a_named_tool_is_called_once(client, claude):
    kwargs = dict(model=MODEL, messages=TWO_CALLS, tools=TOOLS, temperature=0, max_tokens=80)
    both = _calls(client.chat.completions.create(**kwargs).choices[0].message)
    assert len(both) == 2
    named = client.chat.completions.create(**kwargs, tool_choice=NAMED).choices[0]
    assert _calls(named.message) == both[:1] and named.finish_reason == "tool_calls"
    with client.chat.completions.stream(**kwargs, tool_choice=NAMED) as stream:
        assert _calls(stream.get_final_completion().choices[0].message) == both[:1]
    single = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert _calls(single.message) == both[:1]

    anthropic_kwargs = dict(model=MODEL, max_tokens=80, messages=TWO_CALLS, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    for choice in ({"type": "tool", "name": "calculator"}, {"type": "auto", "disable_parallel_tool_use": True}):
        r = claude.messages.create(**anthropic_kwargs, tool_choice=choice)
        assert [(b.name, json.dumps(b.input)) for b in r.content] == both[:1] and r.stop_reason == "tool_use"


def test_anthropic_any_and_named_make_a_greeting_a_tool_use(claude):
    kwargs = dict(model=MODEL, max_tokens=40, messages=GREETING, tools=ANTHROPIC_TOOLS, extra_body=GREEDY)
    assert [b.type for b in claude.messages.create(**kwargs).content] == ["text"]
    for choice in ({"type": "any"}, {"type": "tool", "name": "calculator"}):
        whole = claude.messages.create(**kwargs, tool_choice=choice)
        assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
        assert whole.content[0].name == "calculator" and set(whole.content[0].input) == {"expression"}
        with claude.messages.stream(**kwargs, tool_choice=choice) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]


def test_a_call_cut_short_stays_and_ends_with_length_streamed_or_not(client):
    kwargs = dict(model=MODEL, messages=TWO_CALLS, tools=TOOLS, temperature=0)
    (name, arguments), _ = _calls(client.chat.completions.create(**kwargs, max_tokens=80).choices[0].message)
    chunks = list(client.chat.completions.create(**kwargs, max_tokens=14, stream=True))
    deltas = _tool_deltas(chunks)
    streamed = "".join(d.function.arguments for d in deltas)
    assert deltas[0].function.name == name and len(deltas) > 2  # started, some arguments sent
    assert arguments.startswith(streamed) and streamed != arguments  # what the model wrote before max_tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.chat.completions.create(**kwargs, max_tokens=14).choices[0]  # not streamed: the same cut call
    assert whole.finish_reason == "length" and not whole.message.content
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [(name, streamed)]


def test_a_constrained_reply_that_is_no_valid_call_is_a_422(client):
    kwargs = dict(model=MODEL, messages=GREETING, tools=TOOLS, temperature=0, max_tokens=3, tool_choice="required")
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(**kwargs)
    assert err.value.body["code"] == "tool_choice_unsatisfied"
    with pytest.raises(openai.APIError) as err:  # in a stream: an error event after what was streamed
        list(client.chat.completions.create(**kwargs, stream=True))
    assert "tool_choice" in str(err.value)


class _NoToolCallsTemplate:
    """A tokenizer whose chat template drops assistant tool calls (as some templates do)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template([{k: v for k, v in m.items() if k != "tool_calls"}
                                                  for m in messages], **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_template_that_renders_no_tool_calls_refuses_required_with_a_400(llm, aengine):
    state = build_state(aengine, MODEL)
    state.tokenizer = _NoToolCallsTemplate(llm.tokenizer)
    server = BackgroundServer(create_app(state)).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for choice in ("required", NAMED):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=MODEL, messages=GREETING, tools=TOOLS, tool_choice=choice)
            assert err.value.body["code"] == "tool_choice_unsupported" and "cannot be enforced" in str(err.value)
        ok = client.chat.completions.create(model=MODEL, messages=TWO_CALLS, tools=TOOLS, temperature=0,
                                            max_tokens=80)
        assert ok.choices[0].finish_reason == "tool_calls"  # "auto" needs no forcing
    finally:
        server.stop()


def _stream_pieces(parser: ReplyParser, text: str, size: int = 1) -> list:
    pieces = []
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    for n, chunk in enumerate(chunks):
        pieces += parser.feed(chunk, final=n == len(chunks) - 1)
    return pieces


def test_call_scanner_follows_the_arguments_object_character_by_character():
    body = '\n{"name": "calc\\"x", "arguments": {"a": {"b": [1, "}"]}, "c": "\\""}}\n'
    scanner, seen = CallScanner(), []
    for char in body:
        scanner.feed(char)
        seen.append((scanner.name, scanner.arguments_so_far()))
    assert scanner.name == 'calc"x' and scanner.arguments_so_far() == '{"a": {"b": [1, "}"]}, "c": "\\""}'
    assert json.loads(scanner.arguments_so_far()) == {"a": {"b": [1, "}"]}, "c": '"'}
    assert all(body.startswith(arguments, body.index('{"a"')) for _, arguments in seen if arguments)
    for other in ('{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}',  # arguments as a string
                  '<function=calculator>\n<parameter=expression>\n1\n</parameter>\n</function>'):  # the XML form
        scanner = CallScanner()
        scanner.feed(other)
        assert scanner.arguments_start is None


def test_reply_parser_streams_json_calls_and_sends_other_forms_whole():
    xml = ('<tool_call>\n<function=calculator>\n<parameter=expression>\n1 + 2\n</parameter>\n</function>\n'
           '</tool_call>')
    pieces = _stream_pieces(ReplyParser(TOOLS, True), xml)
    assert [type(p) for p in pieces] == [CallStart, CallArguments, CallEnd]  # at its end, in one piece
    assert json.loads(pieces[1].text) == {"expression": "1 + 2"}

    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expr": "1"}}\n</tool_call>'  # fails the schema
    streamed = ReplyParser(TOOLS, True)
    pieces = _stream_pieces(streamed, bad)
    assert isinstance(pieces[0], CallStart) and not pieces[-1].call.ok  # started, cannot be taken back
    assert "".join(p.text for p in pieces if isinstance(p, CallArguments)) == '{"expr": "1"}'
    assert streamed.finish_reason("stop") == "tool_calls" and streamed.finish_reason("length") == "length"
    whole = ReplyParser(TOOLS, True)
    assert whole.feed(bad, final=True) == [bad] and whole.finish_reason("stop") == "stop"  # not streamed: text

    unknown = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert _stream_pieces(ReplyParser(TOOLS, True), unknown) == [unknown]  # never started: text


class _XmlCallsTemplate(_NoToolCallsTemplate):
    """A tokenizer whose template writes assistant tool calls in the XML form (as Qwen3-Coder's does)."""

    def apply_chat_template(self, messages, **kwargs):
        def xml(call):
            fn = call["function"]
            parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in fn["arguments"].items())
            return f"<tool_call>\n<function={fn['name']}>\n{parameters}</function>\n</tool_call>"

        rendered = [{**m, "content": (m.get("content") or "") + "\n".join(xml(c) for c in m["tool_calls"])}
                    if m.get("tool_calls") else m for m in messages]
        return super().apply_chat_template(rendered, **kwargs)


def test_the_call_grammar_follows_the_template_and_the_allowed_tools(llm):
    from tsterm.server.state import ServerState
    from tsterm.server.tool_choice import ToolUse, call_grammar

    state = ServerState(engine=None, tokenizer=llm.tokenizer, model_name=MODEL, max_model_len=512)
    other = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
    prompt = list(llm.tokenizer.apply_chat_template(GREETING, tools=TOOLS, add_generation_prompt=True, tokenize=True))
    tags = [llm.tokenizer.token_to_id(t) for t in ("<tool_call>", "</tool_call>")]
    one = call_grammar(state, ToolUse(TOOLS, True, True, "calculator", single=True), prompt, False).grammar
    lines = one.splitlines()
    assert lines[0] == "start: tc" and lines[1] == f'tc: <[{tags[0]}]> "\\n" call "\\n" <[{tags[1]}]>'
    (schema,) = [json.loads(line.split("%json ", 1)[1]) for line in lines if line.startswith("call:")]
    assert schema["properties"] == {"name": {"const": "calculator"}, "arguments": _SPEC["parameters"]}
    assert (schema["x-guidance"]["item_separator"], schema["x-guidance"]["key_separator"]) == (", ", ": ")  # as written
    several = call_grammar(state, ToolUse([TOOLS[0], other], True, True), prompt, False).grammar
    assert several.startswith('start: tc ("\\n" tc)*')  # the template separates two calls with a newline
    assert [s["properties"]["name"] for s in json.loads(several.split("%json ", 1)[1].splitlines()[0])["anyOf"]] == [
        {"const": "calculator"}, {"const": "clock"}]
    thinking = call_grammar(state, ToolUse(TOOLS, True, True), prompt, True).grammar
    think = llm.tokenizer.token_to_id("<think>"), llm.tokenizer.token_to_id("</think>")
    assert thinking.startswith("start: think tc") and f"think: (<[{think[0]}]> /(?s:.*)/ <[{think[1]}]>" in thinking


def _matches(llm, grammar: str, text: str) -> bool:
    """Whether llguidance, masking by `grammar` over the engine's tokenizer, takes `text`'s tokens and may end there."""
    matcher = llguidance.LLMatcher(llm.engine.grammars.lltokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in llm.tokenizer.encode(text)) and matcher.is_accepting()


def test_the_call_grammar_follows_a_template_that_writes_the_xml_form(llm):
    from tsterm.server.state import ServerState
    from tsterm.server.tool_choice import ToolUse, call_grammar

    state = ServerState(engine=None, tokenizer=_XmlCallsTemplate(llm.tokenizer), model_name=MODEL, max_model_len=512)
    other = {"type": "function", "function": {"name": "clock", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}, "offset": {"type": "integer"}}}}}
    one = call_grammar(state, ToolUse([*TOOLS, other], True, True, "calculator", single=True), [], False).grammar
    several = call_grammar(state, ToolUse([*TOOLS, other], True, True), [], False).grammar

    def call(name, parameters):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters.items())
        return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"

    calc = call("calculator", {"expression": "(1 + 2) * 3\nx < y"})  # any text, several lines, a '<' included
    assert _matches(llm, one, calc) and _matches(llm, several, calc)
    assert _matches(llm, several, calc + "\n" + call("clock", {"offset": 2}) + "\n" + call("clock", {}))
    assert not _matches(llm, one, calc + "\n" + calc)  # a named tool: one call
    for bad in (call("clock", {}),  # not the named tool
                call("calculator", {}),  # its required parameter missing
                call("calculator", {"expr": "1"}),  # a parameter it does not take
                call("calculator", {"expression": "1</parameter>2"}),  # a value cannot hold the close tag
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'):  # JSON
        assert not _matches(llm, one, bad), bad
    assert not _matches(llm, several, call("clock", {"offset": "two"}))  # an integer parameter's value is JSON
    parsed = ReplyParser(TOOLS, True).feed(calc, final=True)  # what the grammar lets through, the parser reads
    assert [type(p) for p in parsed] == [CallStart, CallArguments, CallEnd]
    assert json.loads(parsed[1].text) == {"expression": "(1 + 2) * 3\nx < y"}


def test_a_required_call_with_an_xml_form_template_is_a_valid_call(llm, aengine):
    # agent-demo learned the JSON form, never the XML one: a bounded integer is a value it must end (a free text value
    # it would write until max_tokens); the grammar writes the rest of the call
    dice = [{"type": "function", "function": {"name": "dice", "description": "Roll a die.", "parameters": {
        "type": "object", "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 9}},
        "required": ["sides"]}}}]
    state = build_state(aengine, MODEL)
    state.tokenizer = _XmlCallsTemplate(llm.tokenizer)
    server = BackgroundServer(create_app(state)).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for choice, parallel in (("required", False), ({"type": "function", "function": {"name": "dice"}}, True)):
            r = client.chat.completions.create(model=MODEL, messages=GREETING, tools=dice, tool_choice=choice,
                                               parallel_tool_calls=parallel, temperature=0, max_tokens=60)
            assert r.choices[0].finish_reason == "tool_calls"
            ((name, arguments),) = _calls(r.choices[0].message)
            assert name == "dice" and 2 <= json.loads(arguments)["sides"] <= 9
    finally:
        server.stop()


def test_a_strict_function_under_auto_leaves_text_free_and_holds_calls_to_its_schema(client, llm):
    from tsterm.server.state import ServerState
    from tsterm.server.tool_choice import ToolUse, call_grammar

    strict = [{"type": "function", "function": {**_SPEC, "strict": True}}]
    kwargs = dict(model=MODEL, tools=strict, temperature=0, max_tokens=80)
    greeting = client.chat.completions.create(**kwargs, messages=GREETING).choices[0]
    assert greeting.finish_reason == "stop" and greeting.message.content and not greeting.message.tool_calls
    calls = client.chat.completions.create(**kwargs, messages=TWO_CALLS).choices[0]
    assert calls.finish_reason == "tool_calls" and [name for name, _ in _calls(calls.message)] == ["calculator"] * 2

    state = ServerState(engine=None, tokenizer=llm.tokenizer, model_name=MODEL, max_model_len=512)
    other = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}}
    grammar = call_grammar(state, ToolUse([*strict, other], True, False, strict=True), [], False).grammar
    # an optional reasoning block first (a model that reasons on its own may), then free text, then any calls
    assert grammar.startswith('start: think text (tc ("\\n" tc)*)?') and "text: /(?s:.*)/" in grammar
    assert "think: (" in grammar and grammar.split("think: (", 1)[1].split("\n", 1)[0].endswith(")?")
    schemas = json.loads(grammar.split("%json ", 1)[1].splitlines()[0])["anyOf"]
    assert [s["properties"]["arguments"] for s in schemas] == [_SPEC["parameters"], {"type": "object"}]


class _Starts:
    """An observer that keeps the RequestInfo of each request."""

    def __init__(self):
        self.infos = []

    def started(self, info):
        self.infos.append(info)

    def progress(self, info, output):
        pass

    def finished(self, info, output, error):
        pass


def test_the_observer_sees_the_prompt_ids_actually_sent(llm, aengine):
    state = build_state(aengine, MODEL)
    state.observer = _Starts()
    server = BackgroundServer(create_app(state)).start()
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=MODEL, messages=GREETING, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=40)
        (info,) = state.observer.infos
        rendered = llm.tokenizer.apply_chat_template(GREETING, tools=TOOLS, add_generation_prompt=True, tokenize=True)
        assert info.prompt_ids == list(rendered)  # the template's prompt: the grammar holds the reply to a call
        assert len(info.prompt_ids) == r.usage.prompt_tokens
    finally:
        server.stop()

"""DeepSeek-V3 / V3.1's and Kimi-K2's tool-call sections and `<think>` reasoning, on replies rendered by templates
written as the published ones (tests/agent/chat_formats.py): the agent's parser (any chunking of the stream, each
call out as soon as the marker after it arrives, errors that name what to fix), the server's streamed calls
(ReplyParser) and reasoning split (ReasoningSplit, V3.1's thinking prompt), and the call grammar (tool_choice
required / named, agent sessions) read off each template, with the section markers as text or as special tokens."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.agent.chat_formats import (DEEPSEEK_V3, DEEPSEEK_V31, KIMI_K2, TEMPLATES, TOOLS, assistant_reply,
                                      calls_of, parse, rebuilt, render)
from tsterm.agent.tool_calls import (DEEPSEEK_CALL, DEEPSEEK_SECTION, KIMI_CALL, KIMI_SECTION, TextDelta,
                                     ToolCallParser)
from tsterm.server.responses_api import ReasoningSplit
from tsterm.server.tool_stream import CallArguments, CallEnd, CallStart, ReplyParser

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FAMILIES = ["deepseek_v3", "deepseek_v31", "kimi_k2"]
SECTION = {"deepseek_v3": DEEPSEEK_SECTION, "deepseek_v31": DEEPSEEK_SECTION, "kimi_k2": KIMI_SECTION}
CALL = {"deepseek_v3": DEEPSEEK_CALL, "deepseek_v31": DEEPSEEK_CALL, "kimi_k2": KIMI_CALL}

CALLS = [("read_file", {"path": "notes/a b.txt", "limit": 5}),
         ("edit", {"path": "x.py", "text": "if a < b:\n    return {\"k\": 1}\n```", "dry_run": True,
                   "options": {"k": [1, 2], "s": "é"}, "ranges": [3, 4]})]


def message(calls=CALLS, content="Let me look.") -> dict:
    """An assistant turn as an OpenAI client sends it back: arguments as JSON text, Kimi's ids functions.NAME:IDX."""
    return {"content": content,
            "tool_calls": [{"id": f"functions.{n}:{i}", "type": "function",
                            "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                           for i, (n, a) in enumerate(calls)]}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rendered_turn_reads_back_as_its_calls(family):
    reply = assistant_reply(TEMPLATES[family], message())
    assert reply.startswith("Let me look." + SECTION[family][0] + CALL[family][0])
    assert reply.endswith(CALL[family][1] + SECTION[family][1])
    events = parse(reply)
    calls = calls_of(events)
    assert [(c.name, c.arguments) for c in calls] == CALLS and all(c.ok for c in calls), [c.error for c in calls]
    kimi_ids = ["functions.read_file:0", "functions.edit:1"]  # Kimi's ids as the model wrote them
    assert [c.id for c in calls] == (kimi_ids if family == "kimi_k2" else ["call_0", "call_1"])
    assert rebuilt(events) == reply  # text and the calls' raw are the reply, exactly
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Let me look."
    assert calls[0].raw.startswith(SECTION[family][0]) and calls[1].raw.endswith(SECTION[family][1])


@PROPERTY
@given(data=st.data())
@pytest.mark.parametrize("family", FAMILIES)
def test_any_chunking_reads_the_same(family, data):
    reply = assistant_reply(TEMPLATES[family], message()) + "\nDone <|tool"  # a held-back tag prefix at the end
    sizes = data.draw(st.lists(st.integers(1, 9), max_size=len(reply)))
    events = parse(reply, chunks=sizes)
    assert [(c.name, c.arguments) for c in calls_of(events)] == CALLS
    assert rebuilt(events) == reply


@pytest.mark.parametrize("family", FAMILIES)
def test_each_call_comes_out_once_the_marker_after_it_arrives(family):
    """A section's first call is out before the second is written: as soon as the next call's begin marker (or the
    section's end) is read, not when the section closes."""
    reply = assistant_reply(TEMPLATES[family], message(content=""))
    second = reply.index(CALL[family][0], reply.index(CALL[family][1]))
    parser = ToolCallParser(TOOLS)
    assert calls_of(parser.feed(reply[:second])) == []  # the first call ended; what follows is not known yet
    (first,) = calls_of(parser.feed(reply[second:second + len(CALL[family][0])]))
    assert first.ok and (first.name, first.arguments) == CALLS[0]
    end = reply.index(SECTION[family][1])
    assert calls_of(parser.feed(reply[second + len(CALL[family][0]):end])) == []
    (last,) = calls_of(parser.feed(reply[end:]))
    assert last.ok and (last.name, last.arguments) == CALLS[1] and parser.finish() == []


S, C = DEEPSEEK_SECTION, DEEPSEEK_CALL
K, KC = KIMI_SECTION, KIMI_CALL


@pytest.mark.parametrize("text, wanted", [
    (f"{S[0]}{C[0]}function<｜tool▁sep｜>nope\n```json\n{{}}\n```{C[1]}{S[1]}", "unknown tool 'nope'"),
    (f'{S[0]}{C[0]}read_file<｜tool▁sep｜>{{"path": 1}}{C[1]}{S[1]}', "bad arguments for tool 'read_file'"),
    (f'{S[0]}{C[0]}read_file<｜tool▁sep｜>{{"path": "a"{C[1]}{S[1]}', "not valid JSON"),
    (f'{S[0]}{C[0]}read_file<｜tool▁sep｜>["a"]{C[1]}{S[1]}', "must be a JSON object, got array"),
    (f'{S[0]}{C[0]}read_file {{"path": "a"}}{C[1]}{S[1]}', "no <｜tool▁sep｜>"),
    (f'{S[0]}{C[0]}read_file<｜tool▁sep｜>{{"path": "a"}}', "ended before <｜tool▁call▁end｜>"),
    (f"{S[0]}hello{S[1]}", "no <｜tool▁call▁begin｜>"),
    (f'{S[0]}oops{C[0]}read_file<｜tool▁sep｜>{{"path": "a"}}{C[1]}{S[1]}', "text in a <｜tool▁calls▁begin｜>"),
    (f'{K[0]}{KC[0]}read_file<|tool_call_argument_begin|>{{"path": "a"}}{KC[1]}{K[1]}', "not functions.NAME:IDX"),
    (f'{K[0]}{KC[0]}functions.read_file:0{{"path": "a"}}{KC[1]}{K[1]}', "no <|tool_call_argument_begin|>"),
    (f'{K[0]}{KC[0]}functions.read_file:0<|tool_call_argument_begin|>{{"path": "a"}}{KC[1]} stray {K[1]}',
     "text between the calls"),
    (f"{K[0]}{KC[0]}functions.read_file:0<|tool_call_argument_begin|>{{", "ended before <|tool_call_end|>"),
    (f"{K[0]}", "the <|tool_calls_section_begin|> section is incomplete"),
])
def test_a_malformed_call_is_an_error_call_that_says_what_to_fix(text, wanted):
    events = parse(text)
    (call,) = calls_of(events)
    assert not call.ok and wanted in call.error, call.error
    assert rebuilt(events) == text


def test_a_section_left_open_after_a_whole_call_still_gives_the_call():
    text = f'Hi{K[0]}{KC[0]}functions.read_file:3<|tool_call_argument_begin|>{{"path": "a"}}{KC[1]}\n'
    events = parse(text)
    (call,) = calls_of(events)
    assert call.ok and (call.name, call.arguments) == ("read_file", {"path": "a"}) and rebuilt(events) == text


@pytest.mark.parametrize("family", FAMILIES)
def test_the_server_streams_the_calls(family):
    reply = assistant_reply(TEMPLATES[family], message())
    parser = ReplyParser(TOOLS, True)
    pieces = []
    for i in range(0, len(reply), 5):
        pieces += parser.feed(reply[i:i + 5], i + 5 >= len(reply))
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [s.name for s in starts] == ["read_file", "edit"] and [s.index for s in starts] == [0, 1]
    for index, (_, arguments) in enumerate(CALLS):
        text = "".join(p.text for p in pieces if isinstance(p, CallArguments) and p.index == index)
        assert json.loads(text) == arguments
    assert [p.call.ok for p in pieces if isinstance(p, CallEnd)] == [True, True]
    assert parser.finish_reason("stop") == "tool_calls"
    assert "".join(p for p in pieces if isinstance(p, str)) == "Let me look."


def test_deepseek_v31_thinking_opens_the_reasoning_in_its_prompt_and_closes_it_otherwise():
    user = [{"role": "user", "content": "?"}]
    thinking = render(DEEPSEEK_V31, user, add_generation_prompt=True, thinking=True)
    plain = render(DEEPSEEK_V31, user, add_generation_prompt=True)
    assert thinking.rstrip().endswith("<｜Assistant｜><think>") and plain.rstrip().endswith("<｜Assistant｜></think>")
    opened = thinking.rfind("<think>") > thinking.rfind("</think>")  # what prompt_opens_reasoning reads
    assert opened and not plain.rfind("<think>") > plain.rfind("</think>")
    reply = "Read it first.</think>Let me look." + assistant_reply(DEEPSEEK_V31, message(content=""))
    split, parser = ReasoningSplit(True), ReplyParser(TOOLS, True)
    kinds, pieces = [], []
    for i in range(0, len(reply), 4):
        final = i + 4 >= len(reply)
        kinds += split.feed(reply[i:i + 4], final)
        pieces += parser.feed(reply[i:i + 4], final)
    assert "".join(f for kind, f in kinds if kind == "reasoning") == "Read it first."
    assert [p.call.name for p in pieces if isinstance(p, CallEnd)] == ["read_file", "edit"]
    r1 = "<think>\nplan\n</think>\n\nHello."  # R1 / V3-0324 with reasoning: a block the reply opens
    assert ReasoningSplit(False).feed(r1, final=True) == [("reasoning", "\nplan\n"), ("text", "\n\nHello.")]


def _template_tokens(tmp_path, name: str, template: str, special: tuple[str, ...] = ()):
    """A test tokenizer with `template`; `special`: tokens added as special (one id each, as the real tokenizers
    have them)."""
    from tests.helpers.tokenizers import make_tokenizer_dir
    from tsterm.agent.tool_grammar import ChatTokens
    from tsterm.tokenizer import Tokenizer

    directory = make_tokenizer_dir(tmp_path / name)
    (directory / "chat_template.jinja").write_text(template)
    if special:
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(directory / "tokenizer.json"))
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        backend.save(str(directory / "tokenizer.json"))
    return ChatTokens(Tokenizer.from_dir(directory))


def _accepts(tokens, grammar: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(tokens.lltokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tokens.tokenizer.encode(text)) and matcher.is_accepting()


KIMI_SPECIAL = (*KIMI_SECTION, *KIMI_CALL, "<|tool_call_argument_begin|>")
DEEPSEEK_SPECIAL = (*DEEPSEEK_SECTION, *DEEPSEEK_CALL, "<｜tool▁sep｜>")


@pytest.mark.parametrize("family, special", [("deepseek_v3", ()), ("deepseek_v31", DEEPSEEK_SPECIAL),
                                             ("kimi_k2", ()), ("kimi_k2", KIMI_SPECIAL)])
def test_the_call_grammar_follows_each_section_form(tmp_path, family, special):
    """tool_choice required / named and agent sessions constrain these templates' calls: the form is read off the
    template (DeepSeek's arguments concatenated as a string, Kimi's id written as functions.NAME:IDX), the grammar
    writes one call per section with the name and the arguments held to the tool's schema, and what it lets through
    the parser reads as the call; with the markers as special tokens they are token references."""
    from tsterm.agent.tool_grammar import agent_grammar, call_form, call_rules, tool_parameters

    tokens = _template_tokens(tmp_path, family, TEMPLATES[family], special)
    form = call_form(tokens)
    assert form.named is not None and form.open_tag == SECTION[family][0]
    assert form.open.startswith("<[") == bool(special)
    parameters = tool_parameters(TOOLS)
    one = "\n".join(["start: tc", f"tc: {form.open} call {form.close}",
                     *call_rules(form, {"read_file": parameters["read_file"]})])
    calls = [assistant_reply(TEMPLATES[family], message([c], content="")) for c in CALLS]
    assert _accepts(tokens, one, calls[0])
    (read,) = calls_of(parse(calls[0]))
    assert read.ok and (read.name, read.arguments) == CALLS[0]
    for bad in (calls[1],  # not the named tool
                calls[0].replace('"limit": 5', '"limit": "five"'),  # an integer
                calls[0].replace('"path"', '"file"'),  # a parameter it lacks
                calls[0].replace("read_file", "read_files")):  # another name
        assert not _accepts(tokens, one, bad), bad
    if family == "kimi_k2":  # the index is any digits
        assert _accepts(tokens, one, calls[0].replace("read_file:0", "read_file:12"))
    session = agent_grammar(tokens, form, parameters)
    assert _accepts(tokens, session, "Reading both.\n" + calls[0] + "\n" + calls[1].replace(":0", ":1"))
    assert _accepts(tokens, session, "<think>plan</think>\n" + calls[1])
    assert _accepts(tokens, session, "No call needed.")
    assert not _accepts(tokens, session, calls[0].replace("read_file", "nope"))
    assert not _accepts(tokens, session, "I write " + SECTION[family][0] + " in text")
    events = parse("Reading both.\n" + calls[0] + "\n" + calls[1])
    assert [(c.name, c.arguments) for c in calls_of(events)] == CALLS


def test_a_section_template_the_grammar_cannot_follow_is_a_clear_refusal(tmp_path):
    """A section whose call neither DeepSeek's nor Kimi's spelling follows is refused by name (the server answers 400
    tool_choice_unsupported), never a crash: here V3's fence spelt ```js."""
    from tsterm.agent.tool_grammar import CallFormError, call_form

    broken = DEEPSEEK_V3.replace("'```json'", "'```js'")
    assert broken != DEEPSEEK_V3
    with pytest.raises(CallFormError, match="does not render an assistant tool call"):
        call_form(_template_tokens(tmp_path, "broken", broken))
    odd = KIMI_K2.replace("<|tool_call_argument_begin|>{%", "<|tool_call_argument_begin|>args={%")
    assert odd != KIMI_K2
    with pytest.raises(CallFormError, match="does not render an assistant tool call"):
        call_form(_template_tokens(tmp_path, "odd", odd))


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v31"])
def test_history_with_call_objects_renders_through_a_template_that_joins_arguments_as_text(tmp_path, family):
    """tsterm's own history carries a past call's arguments as an object (the agent loop, the Anthropic route);
    DeepSeek's templates concatenate them as text: the tokenizer renders them as their JSON text instead of failing
    with a TypeError, the same prompt as a client sending JSON text."""
    tokenizer = _template_tokens(tmp_path, family, TEMPLATES[family]).tokenizer
    as_text = message()
    as_objects = {**as_text, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in as_text["tool_calls"]]}
    conversation = [{"role": "user", "content": "Fix x.py."}]
    want = tokenizer.apply_chat_template([*conversation, {"role": "assistant", **as_text}], tools=TOOLS)
    got = tokenizer.apply_chat_template([*conversation, {"role": "assistant", **as_objects}], tools=TOOLS)
    assert got == want and '"path": "x.py"' in got

"""GLM-4.5 / 4.6's and MiniMax-M2's tool-call and reasoning formats, on replies rendered by templates written as the
published ones (tests/agent/chat_formats.py): the agent's parser (any chunking of the stream, errors that name what
to fix), the server's streamed calls (ReplyParser) and reasoning split (ReasoningSplit), and a reasoning block left
open by the generation prompt (MiniMax-M2's) or closed by it (GLM's with thinking off)."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.agent.chat_formats import (GLM45, MINIMAX_M2, TEMPLATES, TOOLS, assistant_reply, calls_of, parse,
                                      rebuilt, render)
from tsterm.agent.tool_calls import MINIMAX_OPEN, TextDelta
from tsterm.server.responses_api import ReasoningSplit
from tsterm.server.tool_stream import CallArguments, CallEnd, CallStart, ReplyParser

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CALLS = [("read_file", {"path": "notes/a b.txt", "limit": 5}),
         ("edit", {"path": "x.py", "text": "if a < b:\n    return {\"k\": 1}", "dry_run": True,
                   "options": {"k": [1, 2], "s": "é"}, "ranges": [3, 4]})]


def message(calls=CALLS, content="Let me look.", reasoning="The user wants the file; read it first.") -> dict:
    return {"content": content, "reasoning_content": reasoning,
            "tool_calls": [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(calls)]}


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2"])
def test_a_rendered_turn_reads_back_as_its_calls(family):
    reply = assistant_reply(TEMPLATES[family], message())
    assert ("<tool_call>read_file\n<arg_key>" if family == "glm4_moe" else '<invoke name="read_file">') in reply
    events = parse(reply)
    calls = calls_of(events)
    assert [(c.name, c.arguments) for c in calls] == CALLS and all(c.ok for c in calls)
    assert [c.id for c in calls] == ["call_0", "call_1"]
    assert rebuilt(events) == reply  # text and the calls' raw are the reply, exactly
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert "Let me look." in text and "<arg_key>" not in text and "invoke" not in text


@PROPERTY
@given(data=st.data())
@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2"])
def test_any_chunking_reads_the_same(family, data):
    reply = assistant_reply(TEMPLATES[family], message()) + "\nDone <tool"  # a held-back tag prefix at the end
    sizes = data.draw(st.lists(st.integers(1, 9), max_size=len(reply)))
    events = parse(reply, chunks=sizes)
    assert [(c.name, c.arguments) for c in calls_of(events)] == CALLS
    assert rebuilt(events) == reply


def test_a_minimax_block_shares_its_text_out_among_its_calls():
    reply = assistant_reply(MINIMAX_M2, message(content=""))
    first, second = calls_of(parse(reply))
    assert first.raw.startswith(MINIMAX_OPEN) and first.raw.endswith("</invoke>")
    assert second.raw.startswith("\n<invoke") and second.raw.endswith("</minimax:tool_call>")


def test_glm_and_minimax_values_take_their_schema_types_and_strings_stay_text():
    glm = "<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>007</arg_value>\n" \
          "<arg_key>dry_run</arg_key>\n<arg_value>false</arg_value>\n</tool_call>"
    (call,) = calls_of(parse(glm))
    assert call.ok and call.arguments == {"path": "007", "dry_run": False}
    (untyped,) = calls_of(parse(glm, tools=None))  # no schema: the values as written
    assert untyped.arguments == {"path": "007", "dry_run": "false"}
    minimax = f'{MINIMAX_OPEN}\n<invoke name="read_file">\n<parameter name="path">\n12\n</parameter>\n' \
              '<parameter name="limit">12</parameter>\n</invoke>\n</minimax:tool_call>'
    (call,) = calls_of(parse(minimax))
    assert call.ok and call.arguments == {"path": "12", "limit": 12}
    (bare,) = calls_of(parse("<tool_call>read_file</tool_call>", tools=None))  # GLM: a call without arguments
    assert bare.ok and (bare.name, bare.arguments) == ("read_file", {})


@pytest.mark.parametrize("text, wanted", [
    ("<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "unknown tool 'nope'"),
    ("<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>a</arg_value>\n<arg_key>limit</arg_key>\n"
     "<arg_value>many</arg_value>\n</tool_call>", "parameter 'limit': expected integer"),
    ("<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>a</arg_value>\nstray\n</tool_call>",
     "text outside <arg_key>/<arg_value>"),
    ("<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>a", "ended before </tool_call>"),
    ("<tool_call>read file now</tool_call>", "not valid JSON"),  # neither a name nor JSON
    (f"{MINIMAX_OPEN}\nhello\n</minimax:tool_call>", "no <invoke>"),
    (f'{MINIMAX_OPEN}\n<invoke name="read_file">\n<parameter name="path">a</parameter>\n</invoke>\nstray\n'
     "</minimax:tool_call>", "text outside <invoke>"),
    (f'{MINIMAX_OPEN}\n<invoke name="read_file">\n<parameter name="lim">1</parameter>\n</invoke>\n'
     "</minimax:tool_call>", "bad arguments for tool 'read_file'"),
    (f'{MINIMAX_OPEN}\n<invoke name="read_file">\n<parameter name="path">a', "ended before </minimax:tool_call>"),
])
def test_a_malformed_call_is_an_error_call_that_says_what_to_fix(text, wanted):
    events = parse(text)
    (call,) = calls_of(events)
    assert not call.ok and wanted in call.error, call.error
    assert rebuilt(events) == text


@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2"])
def test_the_server_streams_the_calls_and_splits_the_reasoning(family):
    template = TEMPLATES[family]
    reply = assistant_reply(template, message())
    prompt = render(template, [{"role": "user", "content": "?"}], TOOLS, add_generation_prompt=True)
    opened = prompt.rfind("<think>") > prompt.rfind("</think>")  # what prompt_opens_reasoning reads
    assert opened == (family == "minimax_m2")
    if opened:  # MiniMax's generation prompt wrote the open tag: the model continues after it
        reply = reply.removeprefix("<think>\n")
    parser, split = ReplyParser(TOOLS, True), ReasoningSplit(opened)
    pieces, kinds = [], []
    for i in range(0, len(reply), 5):
        final = i + 5 >= len(reply)
        pieces += parser.feed(reply[i:i + 5], final)
        kinds += split.feed(reply[i:i + 5], final)
    starts = [p for p in pieces if isinstance(p, CallStart)]
    assert [s.name for s in starts] == ["read_file", "edit"] and [s.index for s in starts] == [0, 1]
    for index, (_, arguments) in enumerate(CALLS):
        text = "".join(p.text for p in pieces if isinstance(p, CallArguments) and p.index == index)
        assert json.loads(text) == arguments
    assert [p.call.ok for p in pieces if isinstance(p, CallEnd)] == [True, True]
    assert parser.finish_reason("stop") == "tool_calls"
    reasoning = "".join(f for kind, f in kinds if kind == "reasoning")
    assert reasoning.strip() == "The user wants the file; read it first."
    assert "Let me look." in "".join(p for p in pieces if isinstance(p, str))


def test_glm_with_thinking_off_closes_the_block_in_its_prompt():
    prompt = render(GLM45, [{"role": "user", "content": "?"}], add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|assistant|>\n<think></think>")
    split = ReasoningSplit(prompt.rfind("<think>") > prompt.rfind("</think>"))
    assert split.feed("\nHello.", final=True) == [("text", "\nHello.")]


def test_a_minimax_history_keeps_each_turns_reasoning_interleaved():
    """MiniMax-M2 reasons between tool calls and its template keeps each assistant turn's <think> block in the
    history: what tsterm sends back as reasoning_content is rendered in place."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", **message(CALLS[:1], "", "first thought")},
                {"role": "tool", "tool_call_id": "c0", "content": "data"},
                {"role": "assistant", "content": "Done.", "reasoning_content": "second thought"}]
    rendered = render(MINIMAX_M2, messages)
    assert rendered.index("first thought") < rendered.index('<invoke name="read_file">') \
        < rendered.index("second thought") < rendered.index("Done.")


def _template_tokens(tmp_path, name: str, template: str):
    from tests.helpers.tokenizers import make_tokenizer_dir
    from tsterm.agent.tool_grammar import ChatTokens
    from tsterm.tokenizer import Tokenizer

    directory = make_tokenizer_dir(tmp_path / name)
    (directory / "chat_template.jinja").write_text(template)
    return ChatTokens(Tokenizer.from_dir(directory))


def _accepts(tokens, grammar: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(tokens.lltokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tokens.tokenizer.encode(text)) and matcher.is_accepting()


def test_the_call_grammar_follows_glms_form(tmp_path):
    """tool_choice required / named and agent sessions constrain a GLM-4.5 template's calls: the grammar is read off
    the template (its empty <think></think> before a past turn's calls skipped), spells GLM's pieces, holds each
    value to its schema, and what it lets through the parser reads as the call."""
    from tsterm.agent.tool_grammar import agent_grammar, call_form, call_rules, tool_parameters

    tokens = _template_tokens(tmp_path, "glm", GLM45)
    form = call_form(tokens)
    assert form.xml is not None and form.xml.parameter_close == "</arg_value>"
    parameters = tool_parameters(TOOLS)
    one = "\n".join(["start: tc", f"tc: {form.open} call {form.close}",
                     *call_rules(form, {"read_file": parameters["read_file"]})])
    calls = [assistant_reply(GLM45, message([c], content="", reasoning="")).removeprefix("\n<think></think>\n")
             for c in CALLS]
    assert calls[0].startswith("<tool_call>read_file\n<arg_key>path</arg_key>")
    assert _accepts(tokens, one, calls[0])
    (read,) = calls_of(parse(calls[0]))
    assert read.ok and (read.name, read.arguments) == CALLS[0]
    for bad in (calls[1],  # not the named tool
                calls[0].replace("<arg_value>5</arg_value>", "<arg_value>five</arg_value>"),  # an integer's JSON
                calls[0].replace("<arg_key>path</arg_key>", "<arg_key>file</arg_key>"),  # a parameter it lacks
                calls[0].replace("notes/a b.txt", "a</arg_value>b")):  # a value cannot hold the close tag
        assert not _accepts(tokens, one, bad), bad
    session = agent_grammar(tokens, form, parameters)
    assert _accepts(tokens, session, "Reading both.\n" + calls[0] + "\n" + calls[1])
    assert _accepts(tokens, session, "<think>plan</think>\n" + calls[1])
    assert not _accepts(tokens, session, calls[0].replace("read_file", "nope"))


def test_the_call_grammar_follows_minimaxs_block(tmp_path):
    """MiniMax-M2's template: its generation prompt opens the reasoning (the probe's reply reasons first), its calls
    are <invoke>s in a <minimax:tool_call> block. The grammar writes one invoke per block (the parser reads a block of
    several as well), text never spells the block's open tag, and what it lets through the parser reads."""
    from tsterm.agent.tool_calls import MINIMAX_OPEN
    from tsterm.agent.tool_grammar import agent_grammar, call_form, call_rules, tool_parameters

    tokens = _template_tokens(tmp_path, "minimax", MINIMAX_M2)
    form = call_form(tokens)
    assert form.open_tag == MINIMAX_OPEN and form.xml.function_head == '<invoke name="{name}">'
    parameters = tool_parameters(TOOLS)
    one = "\n".join(["start: tc", f"tc: {form.open} call {form.close}",
                     *call_rules(form, {"read_file": parameters["read_file"]})])
    calls = [assistant_reply(MINIMAX_M2, message([c], content="", reasoning="")).lstrip() for c in CALLS]
    assert calls[0].startswith(MINIMAX_OPEN + '\n<invoke name="read_file">')
    assert _accepts(tokens, one, calls[0])
    (read,) = calls_of(parse(calls[0]))
    assert read.ok and (read.name, read.arguments) == CALLS[0]
    for bad in (calls[1],  # not the named tool
                calls[0].replace('"limit">5<', '"limit">five<'),  # an integer's JSON
                calls[0].replace('name="path"', 'name="file"'),  # a parameter it lacks
                calls[0].replace("notes/a b.txt", "a</parameter>b")):  # a value cannot hold the close tag
        assert not _accepts(tokens, one, bad), bad
    session = agent_grammar(tokens, form, parameters, opened=True)  # the prompt opened the reasoning
    assert _accepts(tokens, session, "plan</think>\n\nReading both.\n" + calls[0] + "\n" + calls[1])
    assert not _accepts(tokens, session, "plan</think>\nI write " + MINIMAX_OPEN + " in text")
    bad = calls[0].replace('"limit">5<', '"limit">five<')
    assert not _accepts(tokens, session, "plan</think>\nReading.\n" + bad)  # a block after text is a valid call
    events = parse("plan</think>\n\nReading both.\n" + calls[0] + "\n" + calls[1])
    assert [(c.name, c.arguments) for c in calls_of(events)] == CALLS


def test_required_tool_choice_on_a_template_the_grammar_cannot_follow_is_a_clear_refusal(tmp_path):
    """A template whose calls tsterm's parser cannot read is refused by name (the server answers 400
    tool_choice_unsupported), never a crash: here MiniMax's block with its invoke misspelt."""
    from tsterm.agent.tool_grammar import CallFormError, call_form

    broken = MINIMAX_M2.replace("'<invoke name=\"'", "'<invoke tool=\"'")
    assert broken != MINIMAX_M2
    with pytest.raises(CallFormError, match="does not render an assistant tool call"):
        call_form(_template_tokens(tmp_path, "broken", broken))

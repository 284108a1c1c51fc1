"""The Responses API (`/v1/responses`) on a real server and engine (agent-demo on the CPU), driven by the official
`openai` client: text and function-tool replies, streamed and not, stored responses continued by
`previous_response_id` from their exact ids (the whole earlier conversation from the prefix cache), `store: false`,
retrieve / delete, the store's bounds, and bad fields. The reply splitting (reasoning, text, calls) and the input
items are also checked without a model."""
from __future__ import annotations

import json
import threading

import openai
import pytest

from tests.server.conftest import MODEL, http, wait_blocks_free
from tsterm.agent.tools import Calculator
from tsterm.agent.tool_calls import ToolCall
from tsterm.server.response_store import ResponseStore
from tsterm.server.responses_api import (
    OutputBuilder, ReasoningSplit, ResponsesRequest, input_messages, thinking_kwargs,
)
from tsterm.server.tool_stream import CallArguments, CallEnd, CallStart

BLOCK = 16  # the agent-demo profile's block size: the prefix cache serves whole blocks
QUESTION = "What is 37 * 12?"
_SPEC = Calculator().spec()["function"]
TOOLS = [{"type": "function", "name": _SPEC["name"], "description": _SPEC["description"],
          "parameters": _SPEC["parameters"], "strict": True}]


class Recorder:
    """The request observer: every finished request's info and last output."""

    def __init__(self):
        self.done: list[tuple] = []
        self.lock = threading.Lock()

    def started(self, info):
        pass

    def progress(self, info, output):
        pass

    def finished(self, info, output, error):
        with self.lock:
            self.done.append((info, output, error))


def _call_output(response, result: str) -> list[dict]:
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "37 * 12"}
    return [{"type": "function_call_output", "call_id": call.call_id, "output": result}]


def _assert_cached_through(usage, previous) -> None:
    """`usage` (of a request continuing `previous`) found the previous prompt + reply in the prefix cache, to the
    block: all of it but the reply's last token, which the engine sampled and never computed (the tests share one
    engine, so an earlier test's identical request may have left more)."""
    computed = previous.input_tokens + previous.output_tokens - 1
    assert usage.input_tokens_details.cached_tokens >= computed // BLOCK * BLOCK > 0


def test_text_reply_is_the_chat_reply(client):
    r = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.", temperature=0,
                                max_output_tokens=8)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.instructions == "Be brief." and r.store is True and r.max_output_tokens == 8
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert r.output_text == chat.choices[0].message.content.lstrip()
    u = r.usage
    assert u.input_tokens == chat.usage.prompt_tokens and u.output_tokens == chat.usage.completion_tokens <= 8
    assert u.total_tokens == u.input_tokens + u.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_streamed_text_is_the_non_streamed_text(client):
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}],
                  temperature=0, max_output_tokens=12)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          end]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert text == done.text == whole.output_text and text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == whole.status


def test_calculator_round_trip_continues_from_the_exact_ids(make_server):
    server = make_server()
    server.state.observer = recorder = Recorder()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, temperature=0,
                                     input=_call_output(first, "444"))
    assert second.status == "completed" and second.previous_response_id == first.id
    assert "444" in second.output_text and [item.type for item in second.output] == ["message"]
    _assert_cached_through(second.usage, first.usage)
    (info1, out1, error1), (info2, out2, error2) = recorder.done
    assert info1.api == info2.api == "responses" and error1 is error2 is None
    assert info1.request_id == first.id and info2.request_id == second.id
    # the second prompt is the first's exact ids (prompt + reply), then the tool result's text: nothing re-rendered
    kept = list(info1.prompt_ids) + list(out1.outputs[0].token_ids)
    assert list(info2.prompt_ids[:len(kept)]) == kept and len(info2.prompt_ids) > len(kept)
    assert info2.history_policy == "preserve" and info2.history_fallback is None
    # the observer sees the whole conversation, as the workstation shows it
    roles = [m["role"] for m in info2.messages]
    assert roles == ["user", "assistant", "tool"] and info2.messages[1]["tool_calls"][0]["function"]["name"] == \
        "calculator"


def test_streamed_calculator_round_trip(client):
    with client.responses.stream(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0) as stream:
        events = list(stream)
        first = stream.get_final_response()
    (call,) = first.output
    assert call.type == "function_call" and call.status == "completed"
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.call_id == call.call_id and added.item.arguments == ""
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments and len(
        [e for e in events if e.type == "response.function_call_arguments.delta"]) > 1
    with client.responses.stream(model=MODEL, previous_response_id=first.id, tools=TOOLS, temperature=0,
                                 input=_call_output(first, "444")) as stream:
        second = stream.get_final_response()
    assert "444" in second.output_text
    _assert_cached_through(second.usage, first.usage)


def test_a_client_sending_its_whole_history_continues_too(client):
    """Without previous_response_id (store false, or the Agents SDK's default) the echoed items are matched against
    the server's API conversations, as a chat request is."""
    first = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0, store=False)
    history = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in first.output],
               *_call_output(first, "444")]
    second = client.responses.create(model=MODEL, input=history, tools=TOOLS, temperature=0, store=False)
    assert "444" in second.output_text
    _assert_cached_through(second.usage, first.usage)


def test_store_false_then_previous_response_id_is_a_404(client):
    r = client.responses.create(model=MODEL, input="Hello", temperature=0, max_output_tokens=4, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="Again", previous_response_id=r.id, max_output_tokens=4)
    assert err.value.body["message"] == f"Previous response with id '{r.id}' not found."
    assert err.value.body["param"] == "previous_response_id"


def test_retrieve_and_delete(client, server):
    r = client.responses.create(model=MODEL, input="Hello", temperature=0, max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Again", previous_response_id=r.id, max_output_tokens=4)


def test_stored_responses_are_bounded_by_count(make_server):
    server = make_server(max_stored_responses=2)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    ids = [client.responses.create(model=MODEL, input=f"Hello {i}", max_output_tokens=2).id for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    none = make_server(max_stored_responses=0)
    client = openai.OpenAI(base_url=f"{none.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Again", previous_response_id=r.id, max_output_tokens=2)


def test_stored_responses_expire(make_server):
    server = make_server()
    now = [0.0]
    server.state.responses = ResponseStore(8, ttl_s=60.0, clock=lambda: now[0])
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=2)
    now[0] = 59.0
    assert client.responses.retrieve(r.id).id == r.id
    now[0] = 60.0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="Again", previous_response_id=r.id, max_output_tokens=2)
    assert err.value.body["code"] == "previous_response_not_found"


def test_responses_are_kept_apart_per_api_key():
    store = ResponseStore(4, 60.0)
    store.put("resp_1", "owner-a", {"id": "resp_1"}, object(), None)
    assert store.get("owner-b", "resp_1") is None and not store.delete("owner-b", "resp_1")
    assert store.get("owner-a", "resp_1").body == {"id": "resp_1"}


def test_an_api_key_server_stores_and_continues(make_server):
    server = make_server(api_key="k1")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k1", max_retries=0, timeout=60)
    first = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, temperature=0,
                                     input=_call_output(first, "444"))
    assert "444" in second.output_text
    status, _ = http("GET", f"{server.url}/v1/responses/{first.id}")  # no key: refused before the store is asked
    assert status == 401


@pytest.fixture(scope="module")
def refusing(make_server):
    """A server of its own, sent only requests it refuses: none is in flight once each is answered."""
    return make_server()


@pytest.mark.parametrize("body, param", [
    ({"temperature": 5}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0.call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x",  # a look-ahead: llguidance cannot compile it
                          "schema": {"type": "string", "pattern": "^(?=a)[a-z]+$"}}}}, "text.format.schema"),
    ({"background": True}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs.tools"),
])
def test_a_bad_field_is_a_400_naming_it(refusing, body, param):
    client = openai.OpenAI(base_url=f"{refusing.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": MODEL, "input": "Hello", **body})
    assert err.value.body["param"] == param
    assert refusing.state.in_flight == 0  # a request refused after its admission gave its place back


def test_new_instructions_replace_the_previous_ones(make_server):
    """As OpenAI does: a previous response's instructions are not carried over; the conversation then starts
    differently, so it is rendered as the template says (the prefix cache serves what it can)."""
    server = make_server()
    server.state.observer = recorder = Recorder()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=2)
    client.responses.create(model=MODEL, input="Again", instructions="Be kind.", previous_response_id=first.id,
                            max_output_tokens=2)
    info, _, _ = recorder.done[-1]
    assert [m["role"] for m in info.messages] == ["system", "user", "assistant", "user"]
    assert info.messages[0]["content"] == "Be kind." and info.history_policy is None


def test_a_stream_ends_with_an_error_event(client, aengine):
    """A required call cut short by max_output_tokens, found after the stream began: an `error` event ends it."""
    with client.responses.stream(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="required",
                                 max_output_tokens=2, temperature=0) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "error"
    assert events[-1].code == "tool_choice_unsatisfied" and events[-1].param == "tool_choice"
    assert wait_blocks_free(aengine)["used"] == 0  # the request ended: its blocks are free


def test_text_format_json_schema_holds_the_reply(client):
    schema = {"enum": ["yes", "no", 444]}  # agent-demo, constrained: it answers its only number
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text) in schema["enum"]
    assert r.text.format.type == "json_schema"


# ---- without a model --------------------------------------------------------------------------------------------


def _run(builder: OutputBuilder, pieces: list, cut: bool = False) -> list[dict]:
    events = []
    for piece in pieces:
        events += builder.feed([piece])
    return events + builder.finish(cut)


@pytest.mark.parametrize("opened", [False, True])
def test_reasoning_then_text_become_two_items(opened):
    chunks = ["\n<thi", "nk>\nLet me th", "ink.</th", "ink>\n\nThe answer", " is 4."]
    if opened:  # the generation prompt opened the block: the reply starts inside it
        chunks = ["\nLet me th", "ink.</", "think>\n\n", "The answer", " is 4."]
    builder = OutputBuilder(opened)
    events = _run(builder, chunks)
    reasoning, message = builder.items
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"].strip() == "Let me think."
    assert message["type"] == "message" and message["content"][0]["text"] == "The answer is 4."
    assert reasoning["status"] == message["status"] == "completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == reasoning["content"][0]["text"]
    assert [e["type"] for e in events if e["type"].startswith("response.output_item")] == [
        "response.output_item.added", "response.output_item.done"] * 2


def test_a_call_closes_the_text_before_it_and_a_cut_marks_the_last_item():
    call = ToolCall("call_1", "calculator", {"expression": "1"}, raw="<tool_call>...</tool_call>")
    builder = OutputBuilder(False)
    events = _run(builder, ["Computing.", CallStart(0, "call_1", "calculator"), CallArguments(0, '{"expr'),
                            CallArguments(0, 'ession": "1"}'), CallEnd(0, call), "Then more"], cut=True)
    message, function_call, tail = builder.items
    assert message["status"] == "completed" and function_call["status"] == "completed"
    assert function_call["arguments"] == '{"expression": "1"}' and function_call["call_id"] == "call_1"
    assert tail["type"] == "message" and tail["status"] == "incomplete"
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == function_call["arguments"] and done["output_index"] == 1


def test_a_held_tag_prefix_that_is_not_a_tag_is_text():
    split = ReasoningSplit(False)
    assert split.feed("<th") == []
    assert split.feed("ree>", final=True) == [("text", "<three>")]


@pytest.mark.parametrize("effort, kwargs, thinking", [
    ("none", {}, False), ("minimal", {}, False), ("low", {}, True), ("high", {}, True),
    ("high", {"enable_thinking": False}, False),  # chat_template_kwargs decides when it says
    (None, {}, None),  # not asked: the template's own default
])
def test_reasoning_effort_is_the_templates_enable_thinking(effort, kwargs, thinking):
    body = ResponsesRequest(model=MODEL, input="Hi", reasoning=None if effort is None else {"effort": effort})
    assert thinking_kwargs(body, kwargs).get("enable_thinking") is thinking


def test_reasoning_effort_is_echoed(client):
    r = client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "low"}, max_output_tokens=2)
    assert r.reasoning.effort == "low"


def test_input_items_become_chat_messages():
    messages = input_messages([
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"expression": "1"}'},
        {"type": "function_call", "call_id": "c2", "name": "calculator", "arguments": '{"expression": "2'},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ])
    assert messages == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": {"expression": "1"}}},
            # a call cut short comes back as the string it was (OpenAI takes any arguments string)
            {"id": "c2", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]


# ---- a thinking model: reasoning items, and a tool loop continued from its exact ids ----------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A loopback server on the tiny thinking model of the history-policy tests (thinking_model.py: the Qwen3
    family's template, which drops the reasoning of replies before the last user message; every reply thinks, then
    calls its tool)."""
    from tests.server.conftest import Served
    from tests.server.thinking_model import make_thinking_model
    from tsterm import LLM
    from tsterm.engine.async_engine import AsyncEngine
    from tsterm.server.app import create_app
    from tsterm.server.serve import BackgroundServer
    from tsterm.server.state import ServerState

    llm = LLM(str(make_thinking_model(tmp_path_factory.mktemp("thinking"))), device="cpu")
    aengine = AsyncEngine(llm.engine)
    state = ServerState(engine=aengine, tokenizer=llm.tokenizer, model_name="thinking",
                        max_model_len=llm.engine.max_model_len, observer=Recorder())
    server = BackgroundServer(Served(create_app(state))).start()
    server.state = state
    server.llm_decode = lambda ids: llm.tokenizer.decode(list(ids), skip_special_tokens=False)
    yield server
    server.stop()
    aengine.shutdown()
    llm.engine.shutdown()


def _thinking_client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _thinking_tools(strict: bool = False):
    from tests.server.thinking_model import TOOLS as CHAT_TOOLS

    return [{"type": "function", **tool["function"], "strict": strict} for tool in CHAT_TOOLS]


@pytest.mark.parametrize("strict", [False, True])
def test_a_thinking_reply_is_a_reasoning_item_then_its_call(thinking, strict):
    """Strict (the Responses default) too: under "auto" the grammar lets the reply open with its reasoning (a special
    `<think>` that free text cannot hold; the reply ended at once before)."""
    from tests.server.thinking_model import ARGUMENTS, REASONING, TOOL

    client, tools = _thinking_client(thinking), _thinking_tools(strict)
    kwargs = dict(model="thinking", input="Read the tides.", tools=tools, temperature=0, max_output_tokens=16)
    r = client.responses.create(**kwargs)
    reasoning, call = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text == REASONING
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", TOOL, ARGUMENTS)
    assert r.usage.output_tokens_details.reasoning_tokens == 3  # <think>, the reasoning, </think>
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    streamed = events[-1].response
    assert events[-1].type == "response.completed"
    ignore = {"id", "call_id", "parsed_arguments"}  # fresh ids; the stream helper's parsed form
    assert [item.model_dump(exclude=ignore) for item in streamed.output] == \
        [item.model_dump(exclude=ignore) for item in r.output]


LONG_RESULT = " ".join(f"Tide table line {i}: high water at {i % 12 + 1}:{i * 7 % 60:02d}, low water six hours later."
                       for i in range(42))


def _loop(client, tools, task: str, **follow_up) -> tuple:
    """A tool loop through previous_response_id (a ~2,000-token tool result, a second call, its short result and a
    follow-up question): (the loop's last response, the follow-up response)."""
    kwargs = dict(model="thinking", tools=tools, temperature=0, max_output_tokens=16, instructions="Be careful.")
    r = client.responses.create(input=task, **kwargs)
    for result in (LONG_RESULT,):
        (call,) = [item for item in r.output if item.type == "function_call"]
        r = client.responses.create(previous_response_id=r.id, **kwargs, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    (call,) = [item for item in r.output if item.type == "function_call"]
    follow = client.responses.create(previous_response_id=r.id, **kwargs, **follow_up, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "Done."},
        {"role": "user", "content": "Thanks. And 7*8?"}])
    return r, follow


def test_a_tool_loop_continued_by_id_keeps_its_reasoning_and_its_cache(thinking):
    """The template drops the loop's reasoning once a user message follows; continued from the stored exact ids the
    follow-up still finds the whole loop in the prefix cache, where the template's rendering would compute it
    again."""
    from tests.server.thinking_model import REASONING

    client, tools = _thinking_client(thinking), _thinking_tools()
    loop, follow = _loop(client, tools, "Read the tides (preserve).")
    info, _, _ = thinking.state.observer.done[-1]
    assert info.request_id == follow.id and info.history_policy == "preserve" and info.history_fallback is None
    assert thinking.llm_decode(info.prompt_ids).count(REASONING) == 2  # both replies' reasoning, as computed
    _assert_cached_through(follow.usage, loop.usage)
    # the template's rendering of the same conversation drops the reasoning: most of the loop computed again
    loop, again = _loop(client, tools, "Read the tides (template).",
                        extra_body={"chat_template_kwargs": {"thinking_history": "template"}})
    info, _, _ = thinking.state.observer.done[-1]
    assert info.history_policy == "template" and thinking.llm_decode(info.prompt_ids).count(REASONING) == 0
    assert again.usage.input_tokens_details.cached_tokens < (loop.usage.input_tokens + loop.usage.output_tokens) // 2

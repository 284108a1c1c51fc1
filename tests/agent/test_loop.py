"""The agent loop on a scripted model (fixed token streams through a real tokenizer and chat template): calls and
results, several calls per turn, malformed calls, tool timeouts and exceptions, max_steps, abort, approval, pins,
exact ids from step to step, and a template miss that is reported with what it costs."""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from tests.agent.scripted import ScriptedBackend
from tsterm.agent.loop import (ABORTED, NO_APPROVER, REFUSED, Agent, AgentFinished, AgentOptions, StepFinished,
                               StepStarted, TextChunk, ToolCallParsed, ToolFinished)
from tsterm.agent.tool_calls import CLOSE_TAG, OPEN_TAG
from tsterm.agent.tools import Calculator, Tool, ToolError
from tsterm.chat.history import PRESERVE, TEMPLATE
from tsterm.config import SamplingParams
from tsterm.errors import ConfigError
from tsterm.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "moe_demo"  # its template offers tools


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


def call(name: str, **arguments) -> str:
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE_TAG}"


class Recorder(Tool):
    """Records its calls; optional failure or approval need. With `hold`, a call signals `running` and then blocks
    until `hold` is set: a tool that hangs for as long as the test wants."""

    description = "record a value"
    parameters = {"type": "object", "properties": {"value": {"type": "string"}}, "required": ["value"]}

    def __init__(self, name: str = "record", *, hold: threading.Event | None = None, crash: bool = False,
                 approval: bool = False):
        self.name, self.hold, self.crash, self.needs_approval = name, hold, crash, approval
        self.calls: list[str] = []
        self.running = threading.Event()

    def run(self, arguments: dict) -> str:
        if self.crash:
            raise RuntimeError("the tool's own bug")
        self.running.set()
        if self.hold is not None:
            self.hold.wait()
        self.calls.append(arguments["value"])
        if arguments["value"] == "bad":
            raise ToolError("record: 'bad' is not allowed")
        return f"recorded {arguments['value']}"


async def run(agent: Agent, task: str) -> list:
    return [event async for event in agent.run(task)]


def of(events, kind) -> list:
    return [e for e in events if isinstance(e, kind)]


async def test_a_call_its_result_and_the_answer_with_exact_ids(tokenizer):
    backend = ScriptedBackend(tokenizer, [f"Let me compute.\n{call('calculator', expression='2 + 3 * 4')}",
                                          "It is 14."])
    agent = Agent(backend, tokenizer, [Calculator()], SamplingParams(temperature=0))
    events = await run(agent, "What is 2 + 3 * 4?")

    done = events[-1]
    assert done == AgentFinished("It is 14.", "answer", 2)
    text = "".join(e.text for e in of(events, TextChunk) if e.step == 1)
    assert text == "Let me compute.\n" and OPEN_TAG not in text  # the call's tags never show as text
    [parsed] = of(events, ToolCallParsed)
    assert (parsed.call.name, parsed.call.arguments, parsed.call.id) == ("calculator", {"expression": "2 + 3 * 4"},
                                                                         "call_1_0")
    [finished] = of(events, ToolFinished)
    assert (finished.call.status, finished.call.result, finished.call.error) == ("done", "14", None)
    tool_message = agent.session.messages[-2]
    assert tool_message == {"role": "tool", "content": "14", "name": "calculator", "tool_call_id": "call_1_0"}

    # step 2's prompt: step 1's prompt + every id it generated, then only the tool result and the next header
    first, second = backend.prompts
    step1 = first + backend.finished[0][len(first):]
    assert second[:len(step1)] == step1
    added = tokenizer.decode(second[len(step1):], skip_special_tokens=False)
    assert added == "\n<|im_start|>user\n<tool_response>\n14\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    s1, s2 = agent.steps
    assert s2.kept_tokens == len(step1) and not s2.miss and s2.lost_tokens == 0
    assert s2.cached_tokens == len(step1) // 16 * 16  # the scripted cache: whole blocks of what step 1 left
    assert [e.kept_tokens for e in of(events, StepStarted)] == [0, len(step1)]

    out = agent.to_json("It is 14.")
    assert out["answer"] == "It is 14." and len(out["steps"]) == 2
    assert out["steps"][0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "2 + 3 * 4"},
                                              "result": "14", "error": None}]
    assert out["steps"][1]["prompt_tokens"] == len(second) and out["steps"][1]["cached_tokens"] == s2.cached_tokens
    json.dumps(out)  # plain JSON
    trace = agent.trace("m")
    assert [len(s["tool_latency_s"]) for s in trace["steps"]] == [1, 0]
    assert [(s["prompt_tokens"], s["kept_tokens"]) for s in trace["steps"]] == [(len(first), 0), (len(second),
                                                                                                 len(step1))]


async def test_several_calls_in_one_turn_run_in_order(tokenizer):
    record = Recorder()
    backend = ScriptedBackend(tokenizer, [call("record", value="a") + "\n" + call("record", value="b")
                                          + call("calculator", expression="6 * 7"), "done"])
    agent = Agent(backend, tokenizer, [record, Calculator()])
    events = await run(agent, "record a and b, then 6 * 7")
    assert record.calls == ["a", "b"]
    assert [e.call.id for e in of(events, ToolCallParsed)] == ["call_1_0", "call_1_1", "call_1_2"]
    tools = [m for m in agent.session.messages if m["role"] == "tool"]
    assert [m["content"] for m in tools] == ["recorded a", "recorded b", "42"]
    assert "<tool_response>\nrecorded a\n</tool_response>\n<tool_response>\nrecorded b" in \
        tokenizer.decode(backend.prompts[1], skip_special_tokens=False)
    assert events[-1].reason == "answer"


async def test_malformed_calls_come_back_to_the_model_as_errors(tokenizer):
    record = Recorder()
    bad_json = f"{OPEN_TAG}\n{{\"name\": \"record\", \"arguments\": {{\"value\": }}\n{CLOSE_TAG}"
    replies = [bad_json + call("nope", x=1) + call("record", value=3) + call("record", value="bad")
               + call("record", value="ok"), "sorry"]
    agent = Agent(ScriptedBackend(tokenizer, replies), tokenizer, [record])
    events = await run(agent, "go")
    calls = agent.steps[0].tool_calls
    assert len(calls) == 5  # none dropped
    assert [c.status for c in calls] == ["error", "error", "error", "error", "done"]
    assert all(c.error for c in calls[:4]) and calls[4].error is None
    assert "nope" in calls[1].error and "value" in calls[2].error and "'bad' is not allowed" in calls[3].error
    assert record.calls == ["bad", "ok"]  # the schema failures never reached the tool
    tools = [m["content"] for m in agent.session.messages if m["role"] == "tool"]
    assert all(t.startswith("error: ") for t in tools[:4]) and tools[4] == "recorded ok"
    assert events[-1] == AgentFinished("sorry", "answer", 2)


async def test_a_hanging_or_crashing_tool_is_an_error_result_and_the_session_goes_on(tokenizer):
    hung = threading.Event()
    slow, broken = Recorder("slow", hold=hung), Recorder("broken", crash=True)
    backend = ScriptedBackend(tokenizer, [call("slow", value="x") + call("broken", value="y"), "went on"])
    agent = Agent(backend, tokenizer, [slow, broken], options=AgentOptions(tool_timeout_s=0.2))
    try:
        events = await asyncio.wait_for(run(agent, "go"), 120)  # a hang guard: a loop that waits for the tool
        assert slow.running.is_set() and not slow.calls  # the task ended while the slow tool still hangs
    finally:
        hung.set()
    hung, crashed = agent.steps[0].tool_calls
    assert "no result within 0.2 s" in hung.error and hung.status == "error"
    assert "RuntimeError: the tool's own bug" in crashed.error
    assert events[-1] == AgentFinished("went on", "answer", 2)


async def test_max_steps_stops_a_model_that_keeps_calling(tokenizer):
    backend = ScriptedBackend(tokenizer, [call("calculator", expression=f"{i} + 1") for i in range(10)])
    agent = Agent(backend, tokenizer, [Calculator()], options=AgentOptions(max_steps=3))
    events = await run(agent, "loop")
    assert events[-1].reason == "max_steps" and events[-1].steps == 3
    assert len(backend.prompts) == 3 and len(of(events, ToolFinished)) == 3
    assert agent.session.messages[-1]["role"] == "tool"  # the last calls' results are kept for a next task


async def test_abort_while_generating_ends_the_task_and_the_session_goes_on(tokenizer):
    backend = ScriptedBackend(tokenizer, ["a long reply that will not finish " * 4, "next"], token_delay_s=0.01)
    agent = Agent(backend, tokenizer, [Calculator()])
    events = []
    async for event in agent.run("talk"):
        events.append(event)
        if isinstance(event, TextChunk):
            agent.abort()
    assert events[-1].reason == "aborted" and not of(events, StepFinished)
    assert backend.aborted == ["%s-1" % agent.session.id]
    assert agent.steps == [] and agent.session.token_ids == [] and agent.session.messages == []
    assert (await run(agent, "again"))[-1] == AgentFinished("next", "answer", 1)


async def test_abort_between_tools_gives_the_rest_an_aborted_result(tokenizer):
    record = Recorder()
    backend = ScriptedBackend(tokenizer, [call("record", value="1") + call("record", value="2")])
    agent = Agent(backend, tokenizer, [record])
    events = []
    async for event in agent.run("go"):
        events.append(event)
        if isinstance(event, ToolFinished):
            agent.abort()
    assert record.calls == ["1"] and events[-1].reason == "aborted"
    tools = [m["content"] for m in agent.session.messages if m["role"] == "tool"]
    assert tools == ["recorded 1", f"error: {ABORTED}"]


async def test_cancelling_the_consumer_still_answers_every_call(tokenizer):
    held = threading.Event()
    record = Recorder(hold=held)
    backend = ScriptedBackend(tokenizer, [call("record", value="1") + call("record", value="2")])
    agent = Agent(backend, tokenizer, [record])

    async def consume():
        async for _ in agent.run("go"):
            pass

    task = asyncio.create_task(consume())
    try:
        await asyncio.to_thread(record.running.wait)  # cancelled while its first tool runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        held.set()
    assert [m["role"] for m in agent.session.messages] == ["user", "assistant", "tool", "tool"]


async def test_approval_refused_granted_missing_and_auto(tokenizer):
    asked = []

    async def deny(record, tool):
        asked.append((record.name, record.arguments))
        return False

    async def allow(record, tool):
        return True

    for approve, options, ran, error in ((deny, AgentOptions(), [], REFUSED), (allow, AgentOptions(), ["x"], None),
                                         (None, AgentOptions(), [], NO_APPROVER),
                                         (deny, AgentOptions(auto_approve=True), ["x"], None)):
        tool = Recorder(approval=True)
        agent = Agent(ScriptedBackend(tokenizer, [call("record", value="x"), "ok"]), tokenizer, [tool],
                      options=options, approve=approve)
        await run(agent, "go")
        [record] = agent.steps[0].tool_calls
        assert tool.calls == ran and record.error == error
        assert record.status == ("refused" if error else "done")
    assert asked == [("record", {"value": "x"})]  # auto_approve never asked


async def test_pins_while_waiting_and_close_releases(tokenizer):
    backend = ScriptedBackend(tokenizer, [call("calculator", expression="1 + 1"), "2"])
    agent = Agent(backend, tokenizer, [Calculator()], options=AgentOptions(pin_ttl_s=42.0))
    seen = []
    async for event in agent.run("1 + 1?"):
        if isinstance(event, ToolFinished):  # the tools run while the prefix is pinned
            seen.append(list(backend.pins[agent.pin_key].token_ids))
    assert seen == [backend.finished[0]]
    pin = backend.pins[agent.pin_key]  # waiting on the user: the whole session is pinned
    assert pin.token_ids == agent.session.token_ids and pin.ttl_s == 42.0
    await agent.close()
    assert backend.unpinned == [agent.pin_key] and agent.pin_key not in backend.pins


async def test_a_template_miss_is_reported_with_the_tokens_it_costs(tokenizer):
    backend = ScriptedBackend(tokenizer, ["first", "second"])
    agent = Agent(backend, tokenizer, [Calculator()])
    await run(agent, "one")
    kept = len(agent.session.token_ids)
    agent.session.set_system_prompt("a new system prompt")  # rewrites the start of the rendering
    events = await run(agent, "two")
    [started] = of(events, StepStarted)
    assert started.miss and started.diverged_at is not None and started.diverged_at < 20
    # the default `preserve` cannot append to ids whose messages changed: the step is the template's, and says why
    assert (started.policy_applied, started.fallback_reason) == (
        TEMPLATE, "the kept ids or the messages they stand for changed since they were recorded")
    assert started.lost_tokens == kept - started.kept_tokens > 0
    assert agent.steps[-1].miss and agent.to_json()["steps"][-1]["lost_tokens"] == started.lost_tokens


async def test_two_sessions_run_at_once_on_one_backend(tokenizer):
    backend = ScriptedBackend(tokenizer, [call("calculator", expression="1 + 2"), call("calculator", expression="3 + 4"),
                                          "A", "B"], token_delay_s=0.001)
    one, two = Agent(backend, tokenizer, [Calculator()]), Agent(backend, tokenizer, [Calculator()])
    first, second = await asyncio.gather(run(one, "x"), run(two, "y"))
    assert {first[-1].answer, second[-1].answer} == {"A", "B"}
    results = sorted(c.result for agent in (one, two) for c in agent.steps[0].tool_calls)
    assert results == ["3", "7"]


def test_bad_setup_is_a_clear_error(tokenizer):
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        Agent(ScriptedBackend(tokenizer, []), tokenizer, [Calculator(), Calculator()])
    with pytest.raises(ConfigError, match="max_steps"):
        AgentOptions(max_steps=0)
    with pytest.raises(ConfigError, match="tool_timeout_s"):
        AgentOptions(tool_timeout_s=-1)


async def test_an_empty_task_is_refused(tokenizer):
    agent = Agent(ScriptedBackend(tokenizer, []), tokenizer, [])
    with pytest.raises(ValueError, match="empty"):
        await run(agent, "  ")


async def test_qwen3_dropping_an_earlier_think_block_is_a_reported_miss_under_template(tmp_path):
    from tests.helpers.tokenizers import make_tokenizer_dir

    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "qwen3", template="qwen3"))
    backend = ScriptedBackend(tok, ["<think>\nthe user wants a number\n</think>\n\nIt is 4.", "It is 6."])
    agent = Agent(backend, tok, [], history_policy=TEMPLATE)
    await run(agent, "2 + 2?")
    kept = list(agent.session.token_ids)
    events = await run(agent, "3 + 3?")
    [started] = of(events, StepStarted)
    # the template renders the first reply without its thinking now: the prompt keeps the ids before that block
    think_at = next(i for i in range(len(kept)) if tok.decode(kept[:i + 1], skip_special_tokens=False)
                    .endswith("<think>"))
    assert started.miss and started.diverged_at == started.kept_tokens <= think_at
    assert started.lost_tokens == len(kept) - started.kept_tokens
    assert (started.policy_applied, started.fallback_reason) == (TEMPLATE, None)
    assert backend.prompts[1][:started.kept_tokens] == kept[:started.kept_tokens]
    assert "<think>" not in tok.decode(backend.prompts[1], skip_special_tokens=False)


async def test_qwen3_keeps_the_earlier_think_block_under_preserve(tmp_path):
    """The default policy: the next task's prompt is every kept id (the first reply's <think> block included) and
    exactly the new user message's text; the step, its JSON and the session's turn say which policy planned it."""
    from tests.helpers.tokenizers import make_tokenizer_dir

    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "qwen3", template="qwen3"))
    backend = ScriptedBackend(tok, ["<think>\nthe user wants a number\n</think>\n\nIt is 4.", "It is 6."])
    agent = Agent(backend, tok, [])
    assert agent.history_policy == PRESERVE
    await run(agent, "2 + 2?")
    kept = list(agent.session.token_ids)
    events = await run(agent, "3 + 3?")
    [started] = of(events, StepStarted)
    assert not started.miss and started.kept_tokens == len(kept) and started.lost_tokens == 0
    assert (started.policy_applied, started.fallback_reason) == (PRESERVE, None)
    second = backend.prompts[1]
    assert second[:len(kept)] == kept
    assert tok.decode(second[len(kept):], skip_special_tokens=False) == \
        "\n<|im_start|>user\n3 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert agent.to_json()["steps"][1]["policy_applied"] == PRESERVE
    assert agent.session.turns[1].policy_applied == PRESERVE


async def test_a_reply_cut_at_max_tokens_is_planned_as_the_template_says_and_the_step_says_why(tokenizer):
    """The scripted reply ends without the model's stop token (as a reply cut by max_tokens would): `preserve` cannot
    know where the reply ends in the template's text, so the next step falls back and StepStarted carries why."""
    backend = ScriptedBackend(tokenizer, ["first", "second"])
    agent = Agent(backend, tokenizer, [], stop_ids=[tokenizer.eos_token_ids[1]])  # the scripted stop is not a stop
    await run(agent, "one")
    [started] = of(await run(agent, "two"), StepStarted)
    assert started.policy_applied == TEMPLATE
    assert started.fallback_reason == \
        "the last reply did not end with a stop token (cut by max_tokens or a stop string)"
    assert agent.steps[-1].fallback_reason == started.fallback_reason


def test_the_stop_set_is_the_engines_eos_and_the_requests_stop_ids(tokenizer):
    class EngineLike:
        eos_token_ids = {7, 8}

    backend = ScriptedBackend(tokenizer, [])
    backend.engine = EngineLike()  # as an AsyncEngine holds its Engine
    assert Agent(backend, tokenizer, []).stop_ids == {7, 8}
    assert Agent(backend, tokenizer, [], SamplingParams(stop_token_ids=[3])).stop_ids == {3, 7, 8}
    assert Agent(backend, tokenizer, [], SamplingParams(stop_token_ids=[3], ignore_eos=True)).stop_ids == {3}
    assert Agent(ScriptedBackend(tokenizer, []), tokenizer, []).stop_ids == set(tokenizer.eos_token_ids)
    with pytest.raises(ValueError, match="preserve, template"):
        Agent(backend, tokenizer, [], history_policy="keep")

"""`tsterm agent` end to end on a real checkpoint whose chat template offers tools and whose model emits Hermes
calls (the shipped agent-demo): the built-in calculator runs, its result goes back, the answer comes out, and
every step after the first takes its whole block-aligned prefix from the cache. Two agent sessions on one engine
are batched together."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tsterm import LLM
from tsterm.agent.loop import Agent, AgentOptions
from tsterm.agent.tools import Calculator
from tsterm.bench.trace import load_agent_trace
from tsterm.cli import main
from tsterm.config import SamplingParams
from tsterm.engine.async_engine import AsyncEngine

AGENT_DEMO = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "agent_demo"
BLOCK = 16  # the engine's default block size, used by `--model DIR`


def block_aligned_maximum(previous: dict, step: dict) -> int:
    """What a prefix cache can serve at most: the previous step's prompt + reply, less its last id (never fed to
    the model), and less this prompt's last id (computed for its logits), in whole blocks."""
    full = previous["prompt_tokens"] + previous["generated_tokens"]
    return (min(full, step["prompt_tokens"]) - 1) // BLOCK * BLOCK


def test_tsterm_agent_json_calls_the_calculator_and_reuses_every_prefix(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    code = main(["agent", "--model", str(AGENT_DEMO), "--tools", "calculator", "--device", "cpu", "--json",
                 "--workspace", str(tmp_path), "--trace", str(trace), "What is 37 * 12?"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["reason"] == "answer"
    first, *later = out["steps"]
    assert first["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "37 * 12"}, "result": "444",
                                    "error": None}]
    assert "444" in out["answer"] and later and not later[-1]["tool_calls"]
    assert first["cached_tokens"] == 0
    for previous, step in zip(out["steps"], later):
        assert step["kept_tokens"] == previous["prompt_tokens"] + previous["generated_tokens"]  # token-exact
        assert step["cached_tokens"] >= 0.98 * block_aligned_maximum(previous, step) > 0
        assert not step["miss"]
    recorded = load_agent_trace(trace)
    assert [s["prompt_tokens"] for s in recorded["steps"]] == [s["prompt_tokens"] for s in out["steps"]]


def test_tsterm_agent_prints_steps_on_stderr_and_the_answer_on_stdout(capsys, tmp_path):
    code = main(["agent", "--profile", "agent-demo", "--device", "cpu", "--workspace", str(tmp_path),
                 "What is 5 + 8?"])
    out, err = capsys.readouterr()
    assert code == 0 and "13" in out and out.count("\n") == 1
    assert '-> calculator({"expression": "5 + 8"})' in err and "= 13" in err
    assert "[step 2:" in err and "from the cache" in err


def test_an_agent_stopped_by_max_steps_says_so_in_words(capsys, tmp_path):
    code = main(["agent", "--profile", "agent-demo", "--device", "cpu", "--workspace", str(tmp_path),
                 "--max-steps", "1", "What is 5 + 8?"])  # step 1 calls the calculator; no step is left to answer
    err = capsys.readouterr().err
    assert code == 1 and "before a final answer (it used its only step; raise --max-steps)" in err, err


def test_tsterm_agent_follow_ups_run_in_the_same_session_and_report_their_reuse(capsys, tmp_path):
    """Each follow-up is a new user message in the task's session: its first step keeps every id of the session
    (the tool loop before it included) and takes them from the cache; stdout has one answer per task, stderr one
    reuse line per follow-up."""
    code = main(["agent", "--profile", "agent-demo", "--device", "cpu", "--workspace", str(tmp_path),
                 "--follow-up", "What is 6 * 7?", "--follow-up", "What is 9 + 9?", "What is 5 + 8?"])
    out, err = capsys.readouterr()
    assert code == 0 and out.splitlines() == [line for line in out.splitlines() if line] and len(out.splitlines()) == 3
    assert "13" in out.splitlines()[0], out  # (the tiny demo model answers a follow-up from the first question)
    assert err.count("[follow-up 1: What is 6 * 7?]") == 1 and err.count("[follow-up 2: What is 9 + 9?]") == 1
    assert "[step 1: " in err and "prompt tokens, history: preserve]" in err
    reuse = [line for line in err.splitlines() if line.startswith("[follow-up") and "from the cache" in line]
    assert len(reuse) == 2 and all(line.endswith("thinking history: preserve]") for line in reuse), err

    code = main(["agent", "--profile", "agent-demo", "--device", "cpu", "--workspace", str(tmp_path), "--json",
                 "--follow-up", "What is 6 * 7?", "What is 5 + 8?"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and "13" in out["answer"] and out["thinking_history"] == "preserve"
    [follow_up] = out["follow_ups"]
    assert follow_up["reason"] == "answer" and follow_up["task"] == "What is 6 * 7?"
    task_steps = follow_up["first_step"] - 1
    assert task_steps >= 2 and len(out["steps"]) == task_steps + follow_up["step_count"]  # the task called a tool
    last = out["steps"][task_steps - 1]
    prior = last["prompt_tokens"] + last["generated_tokens"]
    assert follow_up["prior_tokens"] == follow_up["kept_tokens"] == prior
    assert follow_up["policy_applied"] == "preserve" and follow_up["fallback_reason"] is None
    assert follow_up["cached_tokens"] >= 0.95 * (prior // BLOCK * BLOCK) > 0
    assert out["steps"][task_steps]["policy_applied"] == "preserve"


def test_a_profile_s_thinking_history_reaches_tsterm_agent(capsys, tmp_path):
    profile = tmp_path / "tpl.yaml"
    profile.write_text("extends: agent-demo\nthinking_history: template\n")
    code = main(["agent", "--profile", str(profile), "--device", "cpu", "--workspace", str(tmp_path), "--json",
                 "--max-steps", "1", "--follow-up", "What is 6 * 7?", "What is 5 + 8?"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["reason"] == "max_steps" and out["thinking_history"] == "template"
    assert [s["policy_applied"] for s in out["steps"]] == ["template", "template"]
    # the agent-demo's template drops nothing: the template's own rendering keeps the whole history too
    assert not out["follow_ups"][0]["miss"] and out["follow_ups"][0]["kept_tokens"] == out["follow_ups"][0][
        "prior_tokens"]


@pytest.mark.parametrize("argv, message", [
    (["agent", "--model", str(AGENT_DEMO), "  "], "the task is empty"),
    (["agent", "--model", str(AGENT_DEMO), "--workspace", "/no/such/dir", "hi"], "is not a directory"),
    (["agent", "--model", str(AGENT_DEMO), "--max-steps", "0", "hi"], "max_steps"),
    (["agent", "--model", str(AGENT_DEMO), "--tools", "calculator,shell", "hi"], "unknown built-in tool 'shell'"),
    (["agent", "--model", str(AGENT_DEMO), "--follow-up", "ok", "--follow-up", " ", "hi"],
     "--follow-up number 2 is empty"),
])
def test_bad_agent_arguments_are_one_line_errors(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tsterm: error: ") and message in err and err.count("\n") == 1


async def test_two_agent_sessions_are_batched_by_one_engine():
    llm = LLM(str(AGENT_DEMO), device="cpu")
    engine = llm.engine
    widths: list[int] = []
    step = engine.step

    def counting_step():
        widths.append(len(engine.scheduler.running))
        return step()

    engine.step = counting_step
    aengine = AsyncEngine(engine)
    try:
        agents = [Agent(aengine, llm.tokenizer, [Calculator()], SamplingParams(temperature=0, max_tokens=64),
                      options=AgentOptions(max_steps=4)) for _ in range(2)]

        async def answer(agent: Agent, task: str) -> str:
            return [event async for event in agent.run(task)][-1].answer

        answers = await asyncio.gather(answer(agents[0], "What is 12 + 30?"), answer(agents[1], "What is 6 * 7?"))
        for agent in agents:
            await agent.close()
    finally:
        aengine.shutdown()
    assert all("42" in a for a in answers), answers
    assert max(widths) == 2  # both sessions' requests ran in the same engine steps
    assert engine.stats()["pinned_blocks"] == 0  # close() released both pins

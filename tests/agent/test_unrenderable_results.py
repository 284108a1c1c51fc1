"""A tool result that the chat template or the tokenizer cannot take (here: a lone surrogate, which a tool reading
bytes with errors="surrogateescape" returns) fails that session's turn with an error naming the call, before the
engine sees anything; the session keeps an error note in its place and goes on, and the engine serves on."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.agent.scripted import ScriptedBackend
from tsterm import LLM, SamplingParams
from tsterm.agent.loop import Agent, AgentFinished, AgentOptions
from tsterm.agent.tool_calls import CLOSE_TAG, OPEN_TAG
from tsterm.agent.tools import Calculator
from tsterm.engine.async_engine import AsyncEngine
from tsterm.errors import RequestError
from tsterm.tokenizer import Tokenizer

MODELS = Path(__file__).resolve().parents[2] / "tsterm" / "models"
UNRENDERABLE = "4 \udc80"


class SurrogateCalculator(Calculator):
    """The calculator, but its result holds a lone surrogate: no tokenizer can encode it."""

    def run(self, arguments: dict) -> str:
        return UNRENDERABLE


def call(name: str, **arguments) -> str:
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE_TAG}"


async def events_of(agent: Agent, task: str) -> list:
    return [event async for event in agent.run(task)]


async def test_the_turn_fails_naming_the_call_and_the_session_goes_on():
    tokenizer = Tokenizer.from_dir(MODELS / "moe_demo")
    backend = ScriptedBackend(tokenizer, [call("calculator", expression="2 + 2"), "I could not read it."])
    agent = Agent(backend, tokenizer, [SurrogateCalculator()], SamplingParams(temperature=0))
    with pytest.raises(RequestError, match=r"agent step 2: the result of calculator \(call_1_0\) could not be "
                                           r"rendered into the prompt \(TypeError"):
        await events_of(agent, "What is 2 + 2?")
    assert len(backend.prompts) == 1  # the second step never reached the model
    [record] = agent.steps[0].tool_calls
    assert record.status == "error" and "could not be rendered" in record.error
    tool_message = agent.session.messages[-1]
    assert tool_message["role"] == "tool" and tool_message["content"].startswith("error: the result could not be")
    done = (await events_of(agent, "Try again."))[-1]  # the session renders again: the note went to the model
    assert done == AgentFinished("I could not read it.", "answer", 1)
    assert "could not be rendered" in tokenizer.decode(backend.prompts[1], skip_special_tokens=False)


async def test_the_engine_serves_the_next_session_after_a_turn_that_could_not_be_rendered():
    llm = LLM(str(MODELS / "agent_demo"), device="cpu")
    aengine = AsyncEngine(llm.engine)
    params, options = SamplingParams(temperature=0, max_tokens=64), AgentOptions(max_steps=4)
    try:
        broken = Agent(aengine, llm.tokenizer, [SurrogateCalculator()], params, options=options)
        with pytest.raises(RequestError, match=r"the result of calculator \(call_1_0\) could not be rendered"):
            await asyncio.wait_for(events_of(broken, "What is 12 + 30?"), 120)
        await broken.close()
        agent = Agent(aengine, llm.tokenizer, [Calculator()], params, options=options)
        done = (await asyncio.wait_for(events_of(agent, "What is 12 + 30?"), 120))[-1]
        await agent.close()
        assert done.reason == "answer" and "42" in done.answer
        stats = aengine.stats()
        assert stats["used"] == 0 and stats["running"] == 0
    finally:
        aengine.shutdown()

"""Pinning through the agent loop, under pressure: while an agent's tool runs, other sessions' requests churn through
a small KV pool. The pinned session's next step still takes its whole block-aligned prefix from the cache; the
control (a pin that has expired by the time the tool runs) gets none of it back."""
from __future__ import annotations

import asyncio
import random
import threading
from pathlib import Path

import pytest

from tsterm import LLM
from tsterm.agent.loop import Agent, AgentOptions, ToolStarted
from tsterm.agent.tools import Calculator
from tsterm.config import SamplingParams
from tsterm.engine.async_engine import AsyncEngine

AGENT_DEMO = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "agent_demo"
BLOCK = 16


class GatedCalculator(Calculator):
    """The calculator, held until the test has flooded the pool."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def run(self, arguments: dict) -> str:
        assert self.release.wait(60)
        return super().run(arguments)


async def flood(engine: AsyncEngine, vocab_size: int, requests: int = 6, tokens: int = 150) -> None:
    """Other sessions: one after another, each needing ~10 fresh blocks (the freed ones stay cached, LRU)."""
    rng = random.Random(0)
    for _ in range(requests):
        prompt = [rng.randrange(16, vocab_size) for _ in range(tokens)]
        async for _ in engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)):
            pass


@pytest.mark.parametrize("pin_ttl_s, keeps_prefix", [(300.0, True), (1e-6, False)])
async def test_a_waiting_agent_keeps_its_prefix_while_other_sessions_fill_the_pool(pin_ttl_s, keeps_prefix):
    llm = LLM(str(AGENT_DEMO), device="cpu", num_kv_blocks=40)  # 640 tokens: the flood alone cycles it
    aengine = AsyncEngine(llm.engine)
    tool = GatedCalculator()
    agent = Agent(aengine, llm.tokenizer, [tool], SamplingParams(temperature=0, max_tokens=64),
                  options=AgentOptions(pin_ttl_s=pin_ttl_s))
    try:
        async for event in agent.run("What is 37 * 12?"):
            if isinstance(event, ToolStarted):  # the session waits on its tool: its blocks are pinned (or not)
                await flood(aengine, llm.engine.model_config.vocab_size)
                tool.release.set()
        await agent.close()
    finally:
        tool.release.set()
        aengine.shutdown()
    first, second = agent.steps
    assert first.tool_calls[0].result == "444"
    maximum = (first.prompt_tokens + first.generated_tokens - 1) // BLOCK * BLOCK
    if keeps_prefix:
        assert second.cached_tokens == maximum > 0
    else:
        assert second.cached_tokens == 0

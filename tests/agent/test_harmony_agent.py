"""gpt-oss's harmony format in the agent loop, on a scripted model whose replies are written as the format writes
them (their markers special tokens, which the engine's text leaves out): the parser reads the reply's ids, reasoning
comes as ReasoningChunks, the call is run and answered by a `functions.NAME` message, the prompt is rendered by tsterm's
harmony renderer, and the kept ids are reused from step to step (`preserve`); under `template`, what re-rendering
keeps and loses. The call grammar of an agent step is harmony's."""
from __future__ import annotations

import json

import llguidance
import pytest

from tests.helpers.reasoning_templates import FAMILIES, family_tokenizer
from tsterm.agent.harmony import HarmonyChat, render, turn_grammar
from tsterm.agent.loop import (Agent, AgentFinished, ReasoningChunk, StepFinished, StepStarted, TextChunk,
                               ToolCallParsed)
from tsterm.agent.tool_grammar import ChatTokens
from tsterm.agent.tools import Tool
from tsterm.chat.history import TEMPLATE
from tsterm.config import SamplingParams
from tsterm.outputs import CompletionOutput, RequestMetrics, RequestOutput

DATE = "2025-06-28"
KWARGS = {"conversation_start_date": DATE}


class Weather(Tool):
    name = "get_weather"
    description = "The weather in a city"
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    def __init__(self):
        self.cities: list[str] = []

    def run(self, arguments: dict) -> str:
        self.cities.append(arguments["city"])
        return json.dumps({"city": arguments["city"], "celsius": 21})


class HarmonyScript:
    """Each request streams the next reply (written through its stop token, <|call|> or <|return|>) one token at a
    time; the text is the engine's (special tokens left out), the ids are the model's."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.prompts: list[list[int]] = []
        self.finished: list[list[int]] = []
        self.params: list = []
        self.eos_token_ids = tokenizer.eos_token_ids

    async def generate(self, prompt, params=None, request_id=None):
        self.prompts.append(list(prompt))
        self.params.append(params)
        ids = self.tokenizer.encode(self.replies.pop(0))
        assert ids[-1] in self.eos_token_ids
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.001, num_prompt_tokens=len(prompt),
                                 num_cached_tokens=0)
        shown = ""
        for n in range(1, len(ids) + 1):
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            done = n == len(ids)
            yield RequestOutput(request_id, list(prompt), [CompletionOutput(
                0, ids[:n], text, "stop" if done else None, delta_text=text[len(shown):])], 0, metrics, done)
            shown = text
        self.finished.append(list(prompt) + ids)

    def abort(self, request_id):
        pass

    def pin(self, token_ids, ttl_s=300.0, key=None):
        return None

    def unpin(self, pin_id):
        return True


CALL_REPLY = ("<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
              "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
              '{"city":"Oslo"}<|call|>')
ANSWER_REPLY = ("<|channel|>analysis<|message|>21 degrees.<|end|><|start|>assistant<|channel|>final<|message|>"
                "It is 21 °C in Oslo.<|return|>")


@pytest.fixture(scope="module")
def tokenizer():
    return family_tokenizer(FAMILIES["gpt-oss"])


def agent_of(tokenizer, replies, **options) -> tuple[Agent, HarmonyScript, Weather]:
    backend, tool = HarmonyScript(tokenizer, replies), Weather()
    agent = Agent(backend, tokenizer, [tool], SamplingParams(temperature=0), template_kwargs=KWARGS, **options)
    return agent, backend, tool


async def run(agent, task):
    return [e async for e in agent.run(task)]


async def test_a_harmony_tool_loop_reads_reasoning_calls_and_the_answer(tokenizer):
    agent, backend, tool = agent_of(tokenizer, [CALL_REPLY, ANSWER_REPLY])
    assert isinstance(agent.tokenizer, HarmonyChat)
    events = await run(agent, "Weather in Oslo?")
    assert events[-1] == AgentFinished("It is 21 °C in Oslo.", "answer", 2)
    assert tool.cities == ["Oslo"]
    [parsed] = [e.call for e in events if isinstance(e, ToolCallParsed)]
    assert (parsed.name, parsed.arguments, parsed.error) == ("get_weather", {"city": "Oslo"}, None)
    reasoning = ["".join(e.text for e in events if isinstance(e, ReasoningChunk) and e.step == s) for s in (1, 2)]
    assert reasoning == ["The user wants the weather; call the tool.", "21 degrees."]
    assert "".join(e.text for e in events if isinstance(e, TextChunk)) == "It is 21 °C in Oslo."
    steps = [e.step for e in events if isinstance(e, StepFinished)]
    assert steps[0].raw == CALL_REPLY and steps[1].reasoning == "21 degrees."

    # the first prompt is harmony's rendering of the task with the tool; each later one continues the model's ids
    want = render([{"role": "user", "content": "Weather in Oslo?"}], [Weather().spec()], **KWARGS)
    assert backend.prompts[0] == tokenizer.encode(want)
    result = '{"city": "Oslo", "celsius": 21}'
    second = backend.finished[0] + tokenizer.encode(
        f"<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{result}<|end|>"
        "<|start|>assistant")
    assert backend.prompts[1] == second
    # the session's history renders as harmony where a turn is re-rendered: the reasoning, the call (its header in
    # history's form, the recipient first; its arguments as written) and its result
    rendered = agent.tokenizer.apply_chat_template(agent.session.messages[:3], tools=[Weather().spec()], **KWARGS)
    assert rendered == tokenizer.decode(second, skip_special_tokens=False).replace(
        "<|channel|>commentary to=functions.get_weather <|constrain|>",
        " to=functions.get_weather<|channel|>commentary <|constrain|>")


async def test_a_new_task_after_an_answer_keeps_every_id_but_the_return(tokenizer):
    agent, backend, _ = agent_of(tokenizer, [CALL_REPLY, ANSWER_REPLY, ANSWER_REPLY])
    await run(agent, "Weather in Oslo?")
    events = await run(agent, "And tomorrow?")
    started = [e for e in events if isinstance(e, StepStarted)][0]
    previous = backend.finished[1]
    assert previous[-1] == tokenizer.token_to_id("<|return|>")
    assert started.kept_tokens == len(previous) - 1 and not started.miss
    assert backend.prompts[2] == previous[:-1] + tokenizer.encode(
        "<|end|><|start|>user<|message|>And tomorrow?<|end|><|start|>assistant")


@pytest.mark.parametrize("recipient_first", [False, True])
async def test_template_history_keeps_what_harmony_renders_the_same(tokenizer, recipient_first):
    """Re-rendered (`template`), the tool loop keeps the model's reasoning (no final answer yet) and its call, up to
    where the model's header differs from harmony's history form (the recipient before the channel); after the answer
    a new task drops the reasoning, so the kept ids end where the loop's first reasoning began."""
    call = CALL_REPLY
    if recipient_first:
        call = call.replace("<|channel|>commentary to=functions.get_weather <|constrain|>",
                            " to=functions.get_weather<|channel|>commentary <|constrain|>")
    agent, backend, _ = agent_of(tokenizer, [call, ANSWER_REPLY, ANSWER_REPLY], history_policy=TEMPLATE)
    events = await run(agent, "Weather in Oslo?")
    second = [e for e in events if isinstance(e, StepStarted)][1]
    header = tokenizer.encode(render([{"role": "user", "content": "Weather in Oslo?"}], [Weather().spec()], **KWARGS)
                              + "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
                              "<|start|>assistant")
    if recipient_first:  # the model wrote the history form: every id is kept
        assert not second.miss and second.kept_tokens == len(backend.finished[0])
    else:
        assert second.miss and second.kept_tokens == len(header)
    events = await run(agent, "And tomorrow?")
    third = [e for e in events if isinstance(e, StepStarted)][0]
    first_prompt = len(backend.prompts[0])
    assert third.miss and third.kept_tokens == first_prompt  # the reasoning after the prompt is dropped


def test_the_agent_grammar_is_harmony_s(tokenizer):
    agent, _, _ = agent_of(tokenizer, [])
    assert agent.constrains_tool_calls and agent.constraint_note is None
    tokens = ChatTokens(tokenizer)

    def accepts(text: str, required: bool = False) -> bool:
        grammar = turn_grammar(tokens, {"get_weather": Weather.parameters}, required=required)
        matcher = llguidance.LLMatcher(tokens.lltokenizer, grammar)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()

    call, answer = CALL_REPLY.removesuffix("<|call|>"), ANSWER_REPLY.removesuffix("<|return|>")
    assert accepts(call) and accepts(answer)
    assert not accepts(call.replace('"city"', '"town"'))  # the arguments held to the schema
    assert not accepts(call.replace("get_weather", "launch"))  # an offered tool only
    assert accepts(call, required=True) and not accepts(answer, required=True)  # required: a call, not an answer

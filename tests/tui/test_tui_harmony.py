"""gpt-oss's harmony in the workstation: a chat session renders its prompts with tsterm's harmony renderer (not the
checkpoint's Jinja template), shows a reply's analysis channel as the thinking block a reasoning family's `<think>`
gets and its final channel as the reply, records the reply as its messages, and starts the next turn with the first
prompt and the reply's own ids (its `<|return|>` as `<|end|>`, the format's rule), served from the prefix cache; an
agent session shows a step's reasoning (ReasoningChunk) in the same thinking block, live and from its history.

The model is tests/server/harmony_model.py's tiny gpt_oss checkpoint whose tokenizer speaks harmony; its replies are
scripted there (each computed by the real engine after its prompt, so the cache hits are the engine's own)."""
from __future__ import annotations

import json
import math

import pytest

from tests.helpers.reasoning_templates import FAMILIES, family_tokenizer
from tests.server.harmony_model import GREETING_REPLY, PRODUCT_REPLY, ScriptedEngine, make_harmony_checkpoint
from tests.tui.helpers import chat_screen, say, turns_done, wait_until
from tsterm.agent.harmony import chat_format, render
from tsterm.agent.loop import ReasoningChunk, TextChunk
from tsterm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tsterm.server.state import RequestInfo
from tsterm.tui import TstermApp
from tsterm.tui.api_server import ApiObserver
from tsterm.tui.controllers.agent import AgentRun, AgentRuns
from tsterm.tui.messages import ApiTurnFinished, ApiTurnProgress
from tsterm.tui.thinking import SplitReply, split_thinking
from tsterm.tui.widgets.agent_log import split_reply
from tsterm.tui.widgets.chat_log import MessageView, ReplyView

SIZE = (160, 50)
BLOCK = 4
FIRST = GREETING_REPLY
SECOND = PRODUCT_REPLY
CALL = ("<|channel|>analysis<|message|>Use the calculator for 6*7.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.calculator <|constrain|>json<|message|>{"expression":"6*7"}<|call|>')
ANSWER = ("<|channel|>analysis<|message|>The tool said 42.<|end|><|start|>assistant<|channel|>final<|message|>"
          "6*7 is 42.<|return|>")


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    return make_harmony_checkpoint(tmp_path_factory.mktemp("tui-harmony") / "gpt_oss")


def profile(tmp_path, model, **extra) -> str:
    lines = [f"model: {model}", "device: cpu", "dtype: float32", f"block_size: {BLOCK}", "num_kv_blocks: 512",
             "sampling:", "  temperature: 0", "  max_tokens: 6"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    path = tmp_path / "harmony.yaml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def shown(view) -> tuple[str, str]:
    """(thinking, answer) a reply view shows: the Markdown sources of its thinking block and its answer."""
    thinking = view.query(".thinking Markdown")
    answer = view.query_one(".answer")
    return ((thinking.first().source if thinking else "").strip(), answer.source.strip())


async def test_a_harmony_chat_shows_reasoning_apart_and_continues_the_model_s_ids(harmony_model, data_dir, tmp_path):
    app = TstermApp(profile(tmp_path, harmony_model))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        engine = ScriptedEngine(app.host.async_engine)
        engine.replies += [FIRST, SECOND]
        app.host.async_engine = engine
        tokenizer = app.host.tokenizer
        session = screen.session
        await say(pilot, "hello")
        await turns_done(pilot, session, 1)
        # rendered by tsterm's harmony renderer (the checkpoint's template would write its own system text)
        user = [{"role": "user", "content": "hello"}]
        assert engine.prompts[0] == tokenizer.encode(render(user))
        assert session.messages[-1] == {"role": "assistant", "content": "Hello there!",
                                        "reasoning_content": "The user greets me; greet back."}
        reply = screen.chat_log.query(ReplyView).last()
        assert shown(reply) == ("The user greets me; greet back.", "Hello there!")

        await say(pilot, "And 7*8?")
        await turns_done(pilot, session, 2)
        first, second = session.turns
        reply_ids = tokenizer.encode(FIRST)
        kept = engine.prompts[0] + reply_ids[:-1]  # the model's own ids; its <|return|> is history's <|end|>
        assert engine.prompts[1] == kept + tokenizer.encode(
            "<|end|><|start|>user<|message|>And 7*8?<|end|><|start|>assistant")
        assert not second.miss and second.kept_tokens == len(kept) == first.prompt_tokens + first.generated_tokens - 1
        assert second.cached_tokens == len(kept) // BLOCK * BLOCK  # every whole block of them, from the cache

        await screen.show_session(session.id)  # from its history: the same thinking block and answer
        views = await wait_until(pilot, lambda: [v for v in screen.chat_log.query(MessageView)
                                                 if v.role == "assistant"], what="the replies from the history")
        assert [shown(v) for v in views] == [("The user greets me; greet back.", "Hello there!"),
                                             ("Seven times eight is 56.", "It is 56.")]


async def test_an_agent_step_s_harmony_reasoning_shows_as_its_thinking(harmony_model, data_dir, tmp_path):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    app = TstermApp(profile(tmp_path, harmony_model, agent=json.dumps({"workspace": str(workspace),
                                                                       "tools": ["calculator"]})))
    async with app.run_test(size=SIZE) as pilot:
        screen = await chat_screen(pilot)
        engine = ScriptedEngine(app.host.async_engine)
        engine.replies += [CALL, ANSWER]
        app.host.agent_backend = engine
        await pilot.press("ctrl+g")
        session = await wait_until(pilot, lambda: screen.session.kind == "agent" and screen.session,
                                   what="a new agent session")
        await say(pilot, "What is 6*7?", wait_turn=False)
        await wait_until(pilot, lambda: session.id not in screen.running_agents and len(session.turns) >= 2,
                         what="the task")
        steps = list(screen.chat_log.query(ReplyView))
        assert [shown(v) for v in steps] == [("Use the calculator for 6*7.", ""), ("The tool said 42.", "6*7 is 42.")]
        assert session.messages[-1]["content"] == "6*7 is 42."

        await screen.show_session(session.id)  # from its history: the steps' thinking, the call's block
        views = await wait_until(pilot, lambda: [v for v in screen.chat_log.query(MessageView)
                                                 if v.role == "assistant"], what="the steps from the history")
        assert [shown(v) for v in views] == [("Use the calculator for 6*7.", ""), ("The tool said 42.", "6*7 is 42.")]
        assert [view.state.name for view in screen.call_views.values()] == ["calculator"]


async def test_the_agent_runs_show_reasoning_chunks_as_the_step_s_thinking():
    """ReasoningChunks (a harmony step's analysis) become the live step's thinking block, its TextChunks the answer."""
    shown_texts = []

    class View:
        def showing_step(self, session):
            return True

        async def step_text(self, session, text):
            shown_texts.append(text)

    runs = AgentRuns(None, None, View(), None)
    run = AgentRun(shown_at=-math.inf)
    await runs._event(None, run, ReasoningChunk(1, "Use the "))
    assert shown_texts == ["<think>\nUse the "]  # still thinking: the block is open
    await runs._event(None, run, ReasoningChunk(1, "calculator."))
    await runs._event(None, run, TextChunk(1, "It is 42."))
    assert run.text == "<think>\nUse the calculator.\n</think>\n\nIt is 42."
    assert split_thinking(run.text) == SplitReply("Use the calculator.", "It is 42.")


def test_the_workstation_shows_an_api_client_s_harmony_reply_as_thinking_and_a_tool_block():
    """The workstation's API sessions: a harmony reply to a client is shown as its chat format reads it (the server
    streams the engine's outputs, whose text leaves harmony's markers out): its analysis as thinking, its call as the
    tool block the log draws from a reply's call tags."""
    tokenizer = family_tokenizer(FAMILIES["gpt-oss"])
    posted = []
    observer = ApiObserver(posted.append, interval=0.0)
    observer.chat_format = chat_format(tokenizer)
    info = RequestInfo("r1", "chat.completions", [1, 2, 3], messages=[{"role": "user", "content": "6*7?"}])
    ids = tokenizer.encode(CALL)
    outputs = [RequestOutput("r1", info.prompt_ids, [CompletionOutput(
        0, ids[:n], tokenizer.decode(ids[:n], skip_special_tokens=True), "stop" if n == len(ids) else None)], 0,
        RequestMetrics(), n == len(ids)) for n in range(1, len(ids) + 1)]
    observer.started(info)
    for output in outputs:
        observer.progress(info, output)
    observer.finished(info, outputs[-1], None)
    progress = [m.text for m in posted if isinstance(m, ApiTurnProgress)]
    assert any(text.startswith("<think>\nUse the calc") and "</think>" not in text for text in progress)
    [finished] = [m for m in posted if isinstance(m, ApiTurnFinished)]
    text, calls = split_reply(finished.text)
    assert split_thinking(text) == SplitReply("Use the calculator for 6*7.", "")
    assert calls == [("calculator", {"expression": "6*7"}, None)]
    assert not observer._readers  # the request's reader goes with it

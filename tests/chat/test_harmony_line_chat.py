"""gpt-oss's harmony in line mode (`tsterm chat --plain`): given the model's chat format (the agent's and the
server's choice, `tsterm.agent.harmony.chat_format`), the prompt is tsterm's harmony rendering, a reply's analysis
channel streams as the `<think>` block a reasoning family's reply shows and its final channel as the reply, the
session records the reply as its messages, and the next turn starts with the first prompt and the reply's own ids
(its `<|return|>` as `<|end|>`, the format's rule), which the engine serves from its prefix cache.

The model is tests/server/harmony_model.py's tiny gpt_oss checkpoint; its replies are scripted on the real engine
(`SyncScript`: each reply computed after its prompt as if generated, so the cache hits are the engine's own)."""
from __future__ import annotations

import io

import pytest

from tests.server.harmony_model import GREETING_REPLY, PRODUCT_REPLY, make_harmony_checkpoint
from tsterm import LLM, SamplingParams
from tsterm.agent.harmony import HarmonyFormat, chat_format, render
from tsterm.chat.line_chat import LineChat
from tsterm.outputs import CompletionOutput, RequestMetrics, RequestOutput

BLOCK = 4
FIRST = GREETING_REPLY
SECOND = PRODUCT_REPLY


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_harmony_checkpoint(tmp_path_factory.mktemp("harmony-chat") / "gpt_oss")
    llm = LLM(str(path), device="cpu", block_size=BLOCK)
    yield llm
    llm.engine.shutdown()


class SyncScript:
    """The LLM's engine answering with scripted replies: each is computed by the engine after its prompt (through
    all but its stop token, as a generated reply is), then streamed one token at a time as the engine streams (its
    text without the special tokens, its ids whole). Everything else is the engine's."""

    def __init__(self, engine, replies: list[str]):
        self.engine, self.replies = engine, list(replies)
        self.prompts: list[list[int]] = []
        self._pending: list[RequestOutput] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, prompt, params=None, **options):
        prompt = list(prompt)
        self.prompts.append(prompt)
        tokenizer = self.engine.tokenizer
        ids = tokenizer.encode(self.replies.pop(0))
        assert ids[-1] in self.engine.eos_token_ids
        [done] = [out for out in self._run(prompt + ids[:-1]) if out.finished]
        cached = min(done.num_cached_tokens, len(prompt))
        metrics = RequestMetrics(num_prompt_tokens=len(prompt), num_cached_tokens=cached)
        shown = ""
        for n in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:n], skip_special_tokens=True)
            last = n == len(ids)
            self._pending.append(RequestOutput("scripted", prompt, [CompletionOutput(
                0, ids[:n], text, "stop" if last else None, stop_reason=ids[-1] if last else None,
                delta_text=text[len(shown):])], cached, metrics, last))
            shown = text
        return "scripted"

    def _run(self, ids):
        request = self.engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
        outs = []
        while not any(out.finished for out in outs):
            outs += [out for out in self.engine.step() if out.request_id == request]
        return outs

    def step(self):
        return [self._pending.pop(0)] if self._pending else []

    def abort(self, request_id):
        self._pending.clear()
        return True


class ScriptedLLM:
    def __init__(self, llm, replies):
        self.tokenizer, self.engine = llm.tokenizer, SyncScript(llm.engine, replies)


def test_the_model_s_chat_format_is_the_agent_s_choice(llm):
    assert isinstance(chat_format(llm.tokenizer), HarmonyFormat)
    assert isinstance(chat_format(llm.tokenizer, model_type="qwen3_moe"), HarmonyFormat)  # its vocabulary says so


def test_a_harmony_line_chat_shows_reasoning_apart_and_continues_the_model_s_ids(llm):
    scripted = ScriptedLLM(llm, [FIRST, SECOND])
    tokenizer, engine = llm.tokenizer, scripted.engine
    stdin, stdout, stderr = io.StringIO("hello\nAnd 7*8?\n"), io.StringIO(), io.StringIO()
    line = LineChat(scripted, SamplingParams(temperature=0, max_tokens=64), None, None, stdin, stdout, stderr,
                    interactive=False, chat_format=chat_format(llm.tokenizer))
    assert line.run() == 0
    assert stdout.getvalue() == ("<think>\nThe user greets me; greet back.\n</think>\n\nHello there!\n"
                                 "<think>\nSeven times eight is 56.\n</think>\n\nIt is 56.\n")
    session = line.session
    assert engine.prompts[0] == tokenizer.encode(render([{"role": "user", "content": "hello"}]))
    assert session.messages[1:] == [
        {"role": "assistant", "content": "Hello there!", "reasoning_content": "The user greets me; greet back."},
        {"role": "user", "content": "And 7*8?"},
        {"role": "assistant", "content": "It is 56.", "reasoning_content": "Seven times eight is 56."}]
    kept = engine.prompts[0] + tokenizer.encode(FIRST)[:-1]  # the model's own ids; <|return|> is history's <|end|>
    assert engine.prompts[1] == kept + tokenizer.encode(
        "<|end|><|start|>user<|message|>And 7*8?<|end|><|start|>assistant")
    first, second = session.turns
    assert not second.miss and second.kept_tokens == len(kept) == first.prompt_tokens + first.generated_tokens - 1
    assert second.cached_tokens == len(kept) // BLOCK * BLOCK  # every whole block of them, from the cache
    assert f"[cached {second.cached_tokens}/{second.prompt_tokens} tokens]" in stderr.getvalue()



def test_tsterm_chat_plain_renders_a_gpt_oss_chat_with_harmony(llm, monkeypatch, tmp_path, capsys):
    """The command line hands line mode the model's chat format: `tsterm chat --plain` on a gpt-oss model renders
    the harmony prompt and shows the analysis channel as the reply's thinking."""
    from tsterm import launch
    from tsterm.cli import main

    scripted = ScriptedLLM(llm, [FIRST])
    scripted.config = llm.config
    monkeypatch.setattr(launch, "llm_from_args", lambda args, profile=None: scripted)
    monkeypatch.setenv("TSTERM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--plain", "--model", str(llm.config.model), "--temperature", "0"]) == 0
    assert scripted.engine.prompts[0] == llm.tokenizer.encode(render([{"role": "user", "content": "hello"}]))
    assert "<think>\nThe user greets me; greet back.\n</think>\n\nHello there!\n" in capsys.readouterr().out

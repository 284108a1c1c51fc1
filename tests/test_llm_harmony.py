"""`LLM.chat` on a gpt-oss model: the prompt is tsterm's harmony rendering (the agent loop's, the server's and the chat
views' choice, not the checkpoint's Jinja template), the reply's text is read from its ids (the engine's text leaves
harmony's markers out): the final channel after the analysis channel as a `<think>` block, a tool call as written;
given back as history, the reply's reasoning is read off its `<think>` block and dropped as harmony drops a final
answer's, and the next prompt's shared prefix with the first prompt and reply comes from the prefix cache.

The model is tests/server/harmony_model.py's tiny gpt_oss checkpoint; its replies are scripted on the real engine
(tests/chat/test_harmony_line_chat.py's `SyncScript`: each reply computed after its prompt as if generated, so the
cache hits are the engine's own)."""
from __future__ import annotations

import pytest

from tests.chat.test_harmony_line_chat import SyncScript
from tests.server.harmony_model import make_harmony_checkpoint
from tsterm import LLM
from tsterm.harmony import read_reply, render, shown_reply, split_shown

BLOCK = 4
DATE = {"conversation_start_date": "2026-01-05"}
FIRST = ("<|channel|>analysis<|message|>The user greets me; greet back.<|end|><|start|>assistant<|channel|>final"
         "<|message|>Hello there!<|return|>")
SECOND = "<|channel|>final<|message|>It is 56.<|return|>"
CALL = ("<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_harmony_checkpoint(tmp_path_factory.mktemp("harmony-llm") / "gpt_oss")
    llm = LLM(str(path), device="cpu", block_size=BLOCK)
    yield llm
    llm.engine.shutdown()


@pytest.fixture
def script(llm, monkeypatch):
    def scripted(*replies: str) -> SyncScript:
        engine = SyncScript(llm.engine, list(replies))
        monkeypatch.setattr(llm, "engine", engine)
        return engine
    return scripted


def test_llm_chat_renders_harmony_and_reads_the_final_channel(llm, script):
    engine = script(FIRST)
    messages = [{"role": "user", "content": "hello"}]
    [out] = llm.chat(messages, **DATE)
    assert engine.prompts[0] == out.prompt_token_ids == llm.tokenizer.encode(render(messages, **DATE))
    assert out.outputs[0].token_ids == llm.tokenizer.encode(FIRST)  # the model's ids as they came
    assert out.outputs[0].text == "<think>\nThe user greets me; greet back.\n</think>\n\nHello there!"
    assert split_shown(out.outputs[0].text) == ("The user greets me; greet back.", "Hello there!")


def test_llm_chat_renders_history_and_tools_as_harmony_not_as_the_checkpoint_template(llm, script):
    """The checkpoint's template JSON-encodes a tool result and writes a call without <|constrain|>; tsterm's harmony
    rendering (openai-harmony's) does neither. A reply that calls a tool reads as the call written out."""
    engine = script(CALL)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c0", "name": "get_weather", "content": "-3C, snow"},
                {"role": "assistant", "content": "It is -3C and snowing in Oslo."},
                {"role": "user", "content": "And in Paris?"}]
    [out] = llm.chat(messages, tools=TOOLS, **DATE)
    expected = llm.tokenizer.encode(render(messages, TOOLS, **DATE))
    assert engine.prompts[0] == expected
    assert expected != llm.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                         tokenize=True, **DATE)
    call = CALL[CALL.index("<|start|>"):]  # the call's message as the model wrote it
    assert out.outputs[0].text == shown_reply("I need the weather.", call)


def test_a_second_chat_with_the_reply_as_history_hits_the_prefix_cache(llm, script):
    engine = script(FIRST, SECOND)
    first = [{"role": "user", "content": "hello"}]
    [one] = llm.chat(first, **DATE)
    history = [*first, {"role": "assistant", "content": one.outputs[0].text}, {"role": "user", "content": "And 7*8?"}]
    [two] = llm.chat(history, **DATE)
    answered = [*first, {"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "And 7*8?"}]
    assert engine.prompts[1] == llm.tokenizer.encode(render(answered, **DATE))  # the reasoning dropped, as harmony does
    assert two.outputs[0].text == "It is 56."
    computed = engine.prompts[0] + one.outputs[0].token_ids[:-1]  # the first prompt and reply, in the cache
    shared = next(n for n, (a, b) in enumerate(zip(computed, engine.prompts[1] + [-1])) if a != b)
    assert shared > len(engine.prompts[0])  # the whole first prompt, and the reply's first token (<|channel|>)
    assert two.num_cached_tokens == shared // BLOCK * BLOCK > 0


def test_read_reply_keeps_a_cut_reply_s_text_and_leaves_built_in_tool_messages_out(llm):
    tokenizer = llm.tokenizer
    cut = tokenizer.encode("<|channel|>analysis<|message|>Let me look.<|end|><|start|>assistant to=browser.search"
                           "<|channel|>analysis<|message|>{\"q\":\"x\"}<|call|>")
    assert read_reply(tokenizer, cut).answer == "" and read_reply(tokenizer, cut).reasoning == "Let me look."
    ids = tokenizer.encode("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
                           "<|message|>Done, the file is sav")  # cut by max_tokens: no end marker
    assert read_reply(tokenizer, ids).shown == "Checking.Done, the file is sav"

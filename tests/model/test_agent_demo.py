"""The shipped `agent-demo` checkpoint (trained by scripts/train_agent_demo.py): through tsterm's engine it calls the
calculator for arithmetic questions it was not trained on, copies the tool's results into its answer, and matches
transformers token for token."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tsterm
from tsterm import LLM, SamplingParams
from tsterm.agent.tool_calls import ToolCall, ToolCallParser
from tsterm.agent.tools import Calculator
from tsterm.convert.shipped import SHIPPED_MODELS

from tests.helpers.parity import reference_greedy

MODEL_DIR = Path(tsterm.__file__).parent / "models" / "agent_demo"
TOOLS = [Calculator().spec()]
# (question, expressions the calls must carry): no expression here is in the training data (seed 0)
TASKS = [
    ("What is 37 * 12?", ["37 * 12"]),
    ("Compute 4821 - 77.", ["4821 - 77"]),
    ("How much is (15 + 9) * 306?", ["(15 + 9) * 306"]),
    ("What is 59 * 6 and 250 - 1987?", ["59 * 6", "250 - 1987"]),
    ("Calculate 918 * 27 and 6004 - 3915", ["918 * 27", "6004 - 3915"]),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(MODEL_DIR), dtype="float32", device="cpu")


def tool_calls(text: str) -> list[ToolCall]:
    parser = ToolCallParser(tools=TOOLS)
    return [e for e in parser.feed(text) + parser.finish() if isinstance(e, ToolCall)]


def greedy(llm: LLM, messages: list[dict], max_tokens: int = 96) -> str:
    prompt = llm.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text


def test_checkpoint_is_small_shipped_and_measured():
    config = json.loads((MODEL_DIR / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "qwen3_moe" and config["max_position_embeddings"] >= 1024
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 4_000_000
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text(encoding="utf-8"))
    tokenizer = json.loads((MODEL_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    im_end = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_end|>")
    assert im_end in generation["eos_token_id"]
    assert SHIPPED_MODELS["agent-demo"]() == MODEL_DIR
    report = json.loads((MODEL_DIR / "training.json").read_text(encoding="utf-8"))
    assert report["heldout_engine_greedy"]["single"]["both_steps_right"] >= 0.9


@pytest.mark.parametrize("question,expressions", TASKS, ids=[q for q, _ in TASKS])
def test_calls_the_calculator_then_answers_with_the_results(llm, question, expressions):
    messages = [{"role": "user", "content": question}]
    step1 = greedy(llm, messages)
    calls = tool_calls(step1)
    assert [(c.error, c.name, c.arguments) for c in calls] == \
        [(None, "calculator", {"expression": e}) for e in expressions], step1

    results = [Calculator().call(c.arguments).content for c in calls]
    messages.append({"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]})
    messages += [{"role": "tool", "content": r} for r in results]
    answer = greedy(llm, messages)
    assert not tool_calls(answer), answer
    for expression, result in zip(expressions, results):
        assert f"{expression} = {result}" in answer, answer


def test_answers_a_greeting_without_tools(llm):
    reply = greedy(llm, [{"role": "user", "content": "Hello"}])
    assert reply.startswith("Hello") and not tool_calls(reply), reply


def test_tsterm_matches_transformers(llm):
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4 and 5 * 6?"}],
                                               tools=TOOLS, add_generation_prompt=True, tokenize=True)
    new_tokens = 20
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0]
    expected, _ = reference_greedy(hf_model, prompt, new_tokens)
    assert out.token_ids == expected

"""The thinking-history policy in tsterm's own agent sessions (issue 40), on a real engine: a tiny random Qwen3-MoE
whose tokenizer carries the in-house Qwen3 thinking template (tests/helpers/reasoning_templates.py), which drops the
`<think>` of replies before the last user message. The loop's replies are scripted on the engine (EngineScript: the
engine computes them as if generated, so its prefix cache and num_cached_tokens are its own): a first reply that
reasons and calls read_file on a ~2,000-token log and the calculator (two calls in one turn), a second that reasons
and calls the calculator, a third that reasons and answers. Then the user's follow-up, which the model answers itself.

Under `preserve` the follow-up's prompt is every id of the loop and only the new message's text: the engine serves
the loop's whole block-aligned prefix from its cache, and the reply is the one a from-scratch run of the same prompt
gives. Under `template` the follow-up renders the loop's first reply without its reasoning: a miss there, and the
engine computes the whole loop again. Both through the Agent and through `tsterm agent --follow-up`."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.agent.scripted import EngineScript
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.reasoning_templates import FAMILIES, family_tokenizer
from tests.helpers.tokenizers import CORPUS
from tsterm import LLM
from tsterm.agent.loop import Agent, AgentOptions, StepStarted
from tsterm.agent.tools import Calculator, ReadFile
from tsterm.agent.toolset import open_workspace
from tsterm.chat.history import PRESERVE, TEMPLATE
from tsterm.cli import main
from tsterm.config import SamplingParams
from tsterm.engine.async_engine import AsyncEngine

BLOCK = 16  # the engine's default block size
FAMILY = FAMILIES["qwen3"]
TASK = "How many errors does build.log report, and what is 6 * 7?"
FOLLOW_UP = "Thanks. And 7*8?"
LOOP = [  # (reasoning, content, calls): what the model generates in the tool loop
    ("The user wants the error count of the log and a product: read the log and compute 6 * 7 at once.", "",
     [("read_file", {"path": "build.log"}), ("calculator", {"expression": "6 * 7"})]),
    ("The log reports 3 errors. Check that 3 * 14 is 42 as well.", "", [("calculator", {"expression": "3 * 14"})]),
    ("Both products are 42.", "build.log reports 3 errors; 6 * 7 = 42 (= 3 * 14).", []),
]
REPLIES = [FAMILY.reply(*step)[1] for step in LOOP]  # the generated texts, through <|im_end|>


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE with the family's tokenizer files: tokenizer.json, the chat template and its stops."""
    tok = family_tokenizer(FAMILY)
    path, _ = make_checkpoint(tmp_path_factory.mktemp("thinking") / "qwen3-thinking", "qwen3_moe",
                              dict(vocab_size=tok.vocab_size, max_position_embeddings=4096, num_experts=4,
                                   num_experts_per_tok=2), with_tokenizer=False)
    tok._backend.save(str(path / "tokenizer.json"))  # the trained BPE, its special and added tokens
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": FAMILY.stops[0],
                                                            "chat_template": FAMILY.template}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(tok.eos_token_ids)}))
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A workspace whose build.log is a ~2,000-token tool result."""
    root = tmp_path_factory.mktemp("workspace")
    tok = family_tokenizer(FAMILY)
    lines, n = [], 0
    corpus = [line for line in CORPUS.splitlines() if line.strip()]
    while len(tok.encode("\n".join(lines))) < 2000:
        lines.append(f"[{n:04d}] {'ERROR' if n in (7, 40, 77) else 'info'} {corpus[n % len(corpus)]}")
        n += 1
    (root / "build.log").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def recompute(model_dir):
    """The same model with no prefix cache: what a prompt's reply is when every id of it is computed."""
    llm = LLM(str(model_dir), device="cpu", enable_prefix_caching=False)
    yield lambda prompt, params: list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    llm.engine.shutdown()


def block_aligned(n: int) -> int:
    return n // BLOCK * BLOCK


def run_session(model_dir: Path, workspace: Path, policy: str):
    """The task (the scripted tool loop) then the follow-up, in one agent session on a fresh engine."""
    llm = LLM(str(model_dir), device="cpu")
    script = EngineScript(AsyncEngine(llm.engine), REPLIES)
    root = open_workspace(workspace)
    params = SamplingParams(temperature=0, max_tokens=8)
    # unconstrained: the follow-up is compared with the same prompt generated without a grammar, and this random
    # model's free text is not always valid UTF-8, which the tool-call grammar would not let it write
    agent = Agent(script, llm.tokenizer, [ReadFile(root), Calculator()], params, history_policy=policy,
                  options=AgentOptions(max_steps=4), constrain_tool_calls=False)

    async def go():
        task = [e async for e in agent.run(TASK)]
        loop_ids = list(agent.session.token_ids)
        follow_up = [e async for e in agent.run(FOLLOW_UP)]
        await agent.close()
        return task, loop_ids, follow_up

    try:
        task, loop_ids, follow_up = asyncio.run(go())
    finally:
        script.shutdown()
    return agent, script, task, loop_ids, follow_up, params


@pytest.mark.parametrize("policy", [PRESERVE, TEMPLATE])
def test_a_follow_up_after_a_tool_loop_reuses_the_loop_under_preserve_and_recomputes_it_under_template(
        model_dir, workspace, recompute, policy):
    agent, script, task, loop_ids, follow_up, params = run_session(model_dir, workspace, policy)
    tok = agent.tokenizer
    steps = agent.steps
    assert task[-1].reason == "answer" and len(steps) == 4  # three scripted loop steps, then the follow-up's
    assert task[-1].answer == LOOP[2][1]  # the answer without the reasoning before it (the step's text keeps it)
    first, second, third, asked = steps
    assert [c.name for c in first.tool_calls] == ["read_file", "calculator"]  # two calls in the loop's first turn
    [log_result, product] = [m["content"] for m in agent.session.messages if m["role"] == "tool"][:2]
    assert len(tok.encode(log_result)) >= 2000 and product == "42"
    assert third.text.endswith(LOOP[2][1]) and "<think>" in agent.session.messages[1]["content"]

    # inside the loop nothing is dropped (the reasoning is after the last user message): every step keeps the
    # previous one's ids and takes them from the cache, block-aligned, under either policy
    for before, step, prompt in zip(steps[:2], steps[1:3], script.prompts[1:3]):
        previous = before.prompt_tokens + before.generated_tokens
        assert step.kept_tokens == previous and not step.miss and step.policy_applied == policy
        assert step.cached_tokens >= 0.95 * block_aligned(previous)

    # the follow-up: the loop's prompt + generated ids, then the new user message
    prompt = script.prompts[3]
    [started] = [e for e in follow_up if isinstance(e, StepStarted)]
    ideal = block_aligned(len(loop_ids))
    print(f"{policy}: the loop's ids {len(loop_ids)} (block-aligned {ideal}); the follow-up: prompt "
          f"{asked.prompt_tokens}, kept {asked.kept_tokens}, cached {asked.cached_tokens}, diverged at "
          f"{asked.diverged_at}")
    assert asked.fallback_reason is None and started.policy_applied == asked.policy_applied == policy
    if policy == PRESERVE:
        assert not asked.miss and asked.kept_tokens == len(loop_ids) and prompt[:len(loop_ids)] == loop_ids
        assert tok.decode(prompt[len(loop_ids):], skip_special_tokens=False) == \
            f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n"
        assert asked.cached_tokens >= 0.95 * ideal
    else:
        # the template rendered the loop's first reply without its <think>: the prompt leaves the kept ids where
        # that reply starts, and the engine computes everything after it again
        assert asked.miss and asked.diverged_at == asked.kept_tokens == first.prompt_tokens
        assert "<think>" not in tok.decode(prompt, skip_special_tokens=False)
        assert asked.cached_tokens == block_aligned(asked.diverged_at) < 0.5 * ideal
    # the engine's reuse stays invisible: the reply is what the same prompt gives with nothing cached
    answer = list(script.outputs[3].outputs[0].token_ids)
    assert answer == recompute(prompt, params) and asked.generated_tokens == len(answer) > 0


def cli_session(monkeypatch, capsys, model_dir: Path, workspace: Path, *flags: str) -> tuple[int, dict]:
    """`tsterm agent --json ... --follow-up FOLLOW_UP TASK` on the tiny thinking model, its tool loop scripted on the
    engine the CLI builds."""
    made = []

    def scripted(engine, *args, **kwargs):
        made.append(EngineScript(AsyncEngine(engine, *args, **kwargs), REPLIES))
        return made[-1]

    monkeypatch.setattr("tsterm.engine.async_engine.AsyncEngine", scripted)
    code = main(["agent", "--model", str(model_dir), "--device", "cpu", "--workspace", str(workspace),
                 "--tools", "read_file,calculator", "--temperature", "0", "--max-tokens", "8", "--json",
                 "--follow-up", FOLLOW_UP, *flags, TASK])
    assert len(made) == 1
    return code, json.loads(capsys.readouterr().out)


def test_tsterm_agent_with_a_follow_up_reports_its_reuse_per_policy(monkeypatch, capsys, model_dir, workspace):
    code, out = cli_session(monkeypatch, capsys, model_dir, workspace)
    assert out["reason"] == "answer" and out["answer"] == LOOP[2][1] and out["thinking_history"] == PRESERVE
    [follow_up] = out["follow_ups"]
    loop = out["steps"][2]
    prior = loop["prompt_tokens"] + loop["generated_tokens"]
    assert follow_up["task"] == FOLLOW_UP and follow_up["first_step"] == 4 and follow_up["prior_tokens"] == prior
    assert (follow_up["policy_applied"], follow_up["fallback_reason"], follow_up["miss"]) == (PRESERVE, None, False)
    assert follow_up["kept_tokens"] == prior and follow_up["cached_tokens"] >= 0.95 * block_aligned(prior)
    assert out["steps"][3]["prompt_tokens"] == follow_up["prompt_tokens"]
    assert code == (0 if follow_up["reason"] == "answer" else 1)  # the random model may run out of max_tokens

    code, out = cli_session(monkeypatch, capsys, model_dir, workspace, "--thinking-history", "template")
    [follow_up] = out["follow_ups"]
    assert out["thinking_history"] == TEMPLATE and (follow_up["policy_applied"], follow_up["miss"]) == (TEMPLATE, True)
    assert follow_up["cached_tokens"] == block_aligned(follow_up["diverged_at"]) < 0.5 * follow_up["prior_tokens"]
    assert follow_up["diverged_at"] == out["steps"][0]["prompt_tokens"]

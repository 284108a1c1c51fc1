"""Thinking history, `preserve` against `template` (issue 40): the prefill a follow-up saves, the answers it changes.

    python benchmarks/thinking_history.py [--quick] [--parts trace,agent,factual] [--rounds 2] [--turns 3]
                                          [--result-tokens 1100] [--sessions 100] [--questions 20] [--json FILE]

Both policies run the same conversation in the same run, each on an engine of its own (nothing cached by the other).

trace    A multi-turn agent session under a thinking template, tokens and times: the `--profile` model (default: the
         shipped SmolLM2-135M, for a real tokenizer and real prefill times) with the in-house Qwen3 thinking template
         (tests/helpers/reasoning_templates.py: the one the policy's tests render agent histories through, so the
         benchmark measures the template the tests check; a copy here could drift from it). It keeps `<think>` only
         for replies after the last user message, as Qwen3's does. `--turns` user turns, each a tool loop of four
         model calls: read_file on a build log (~`--result-tokens` tokens), then read_file on a test log (~60% of
         that) with the calculator in the same reply, then the calculator, then the answer, every reply reasoning
         first; then one last follow-up answered without tools. The replies are scripted, so both policies see the
         same messages: the engine prefills each step's prompt as a request (its time to first token and prefix-
         cache hits are the engine's own), then computes the reply's ids after it, as decoding would have left them
         in the cache. The tools are real (tsterm's read_file and calculator on generated logs). Token counts are
         exact; times are as noisy as the machine.
agent    The shipped agent-demo profile's task accuracy, as `tsterm agent TASK --follow-up TEXT` runs it (the
         profile's tools, sampling and loop; tsterm.agent.loop.Agent): `--sessions` sessions of one held-out task
         and one held-out follow-up (scripts/train_agent_demo.py's held-out set: seed 0, 32,000 training
         conversations, 100 single and 100 two-call tasks with no trained expression). An answer is right when it
         holds `= RESULT` for every expression (the training report's answer_has_results); calls are right when the
         task's first step calls the calculator on exactly its expressions. agent-demo does not think and its
         template renders a reply as it was generated: the policies must give the same ids and the same answers,
         a check that `preserve` changes nothing there, not a quality finding.
factual  The default model's factual questions (benchmarks/default_sampling.py's 20, right when the reply's first
         sentence holds an accepted answer) asked one after the other in one chat (tsterm.chat.line_chat.LineChat,
         `tsterm chat --plain`'s loop), greedy with the profile's penalties, under two templates:
           smollm2        SmolLM2's own: nothing to drop, both policies the same ids (a check, as above);
           thinking-off   SmolLM2's with a Qwen3-style thinking-off generation prompt: each reply opens with an empty
                          `<think>\\n\\n</think>\\n\\n` that the template does not write back into the history. Under
                          `preserve` the model sees those empty blocks in every earlier turn, under `template` it
                          does not: the answers may differ, and that is the quality finding.
Prints the CPU and the machine's load first, then one table per part (markdown).
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.helpers (the in-house templates), benchmarks.* (shared question set)

POLICIES = ("preserve", "template")
EMPTY_THINK = "<think>\n\n</think>\n\n"
FOLLOW_UP = "Thanks. And 7*8?"


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- trace: a multi-turn agent session under a thinking template --------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One model call of the trace: what its prompt was and what the engine took from its cache."""

    turn: int  # 1-based; the last turn is the final follow-up (no tools)
    index: int  # 1-based within the session
    prompt: int
    cached: int
    kept: int  # leading ids the plan took verbatim from the previous step
    generated: int
    miss: bool
    diverged_at: int | None
    ttft_s: float  # the engine's time to first token of the prompt (its prefill, one token sampled)
    policy_applied: str | None
    fallback_reason: str | None

    @property
    def prefilled(self) -> int:
        return self.prompt - self.cached


@dataclass(frozen=True)
class Turn:
    """A user turn of the trace: its steps summed, and its first step (the one that starts from the history)."""

    turn: int
    steps: int
    prompt: int
    cached: int
    prefilled: int
    first_prompt: int
    first_cached: int
    first_kept: int
    first_miss: bool
    prior: int  # the session's ids before the turn (the last step's prompt + reply): what its first step could reuse
    ttft_s: float  # the first step's
    prefill_s: float  # every step's time to first token, summed


def turns_of(steps: Sequence[Step]) -> list[Turn]:
    out = []
    for turn in sorted({s.turn for s in steps}):
        group = [s for s in steps if s.turn == turn]
        first = group[0]
        before = [s for s in steps if s.index < first.index]
        prior = before[-1].prompt + before[-1].generated if before else 0
        out.append(Turn(turn, len(group), sum(s.prompt for s in group), sum(s.cached for s in group),
                        sum(s.prefilled for s in group), first.prompt, first.cached, first.kept, first.miss, prior,
                        first.ttft_s, sum(s.ttft_s for s in group)))
    return out


class ScriptedReplies:
    """An agent backend on a real engine (an LLM) whose replies are scripted texts (through the stop token). Each
    request is two engine requests: the prompt (one token sampled and dropped: the request's prefix-cache hits and
    time to first token are the engine's), then the prompt + the reply's ids less the stop (one token sampled and
    dropped), so the cache holds what decoding the reply would have left there. Once the script is done it raises."""

    def __init__(self, llm: Any, replies: Sequence[str]):
        from tsterm.config import SamplingParams

        self.llm, self.tokenizer = llm, llm.tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.one = SamplingParams(temperature=0, max_tokens=1)

    @property
    def eos_token_ids(self):
        return self.llm.engine.eos_token_ids

    async def generate(self, prompt, params=None, request_id=None):
        from tsterm.outputs import CompletionOutput, RequestOutput

        if not self.replies:
            raise RuntimeError("the script has no reply left for this request")
        prompt = list(prompt)
        self.prompts.append(prompt)
        ids = self.tokenizer.encode(self.replies.pop(0))
        if not ids or ids[-1] not in self.eos_token_ids:
            raise ValueError("a scripted reply ends with the model's stop token")
        [first] = self.llm.generate([prompt], self.one)
        self.llm.generate([prompt + ids[:-1]], self.one)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        yield RequestOutput(request_id, prompt, [CompletionOutput(0, ids, text, "stop", delta_text=text)],
                            first.num_cached_tokens, first.metrics, True)

    def abort(self, request_id: str) -> None:  # a request runs to its end before the loop sees anything
        pass

    def pin(self, token_ids, ttl_s=300.0, key=None):
        return self.llm.engine.pin(token_ids, ttl_s, key)

    def unpin(self, pin_id: str) -> bool:
        return self.llm.engine.unpin(pin_id)


def log_text(rng: random.Random, tokens: int, count, errors_every: int) -> tuple[str, int, int]:
    """A build/test log of about `tokens` tokens (`count(text)`): (text, lines, ERROR lines)."""
    services = ("api", "worker", "scheduler", "db", "cache", "auth", "billing", "search")
    events = ("request served", "job finished", "connection opened", "retrying upload", "cache miss",
              "config reloaded", "slow query", "heartbeat", "user session renewed", "batch committed")
    lines: list[str] = []
    errors = 0
    while count("\n".join(lines)) < tokens:
        n = len(lines)
        level = "ERROR" if rng.randrange(errors_every) == 0 else rng.choice(("INFO", "INFO", "DEBUG", "WARN"))
        errors += level == "ERROR"
        lines.append(f"2026-12-06T{8 + n // 600:02d}:{n // 10 % 60:02d}:{n * 7 % 60:02d} {level:5} "
                     f"{rng.choice(services)}-{rng.randrange(1, 9)} {rng.choice(events)} "
                     f"id={rng.randrange(16 ** 6):06x} {rng.randrange(1, 900)}ms")
    return "\n".join(lines) + "\n", len(lines), errors


def build_trace(workspace: Path, tokenizer: Any, turns: int, result_tokens: int,
                seed: int = 0) -> tuple[list[str], list[str]]:
    """Writes the logs into `workspace`; returns the user messages and the scripted replies (Qwen3's generated text:
    `<think>` reasoning, Hermes tool calls, `<|im_end|>`) of the whole session."""
    from tests.helpers.reasoning_templates import FAMILIES

    reply = FAMILIES["qwen3"].reply
    rng = random.Random(seed)
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    users, replies = [], []
    for t in range(1, turns + 1):
        build, test = f"build-{t}.log", f"test-{t}.log"
        text, lines_b, err_b = log_text(rng, result_tokens, count, 25)
        (workspace / build).write_text(text)
        text, lines_t, err_t = log_text(rng, int(result_tokens * 0.6), count, 12)
        (workspace / test).write_text(text)
        share = f"({err_b} + {err_t}) / ({lines_b} + {lines_t}) * 100"
        percent = round(100 * (err_b + err_t) / (lines_b + lines_t), 2)
        users.append(f"How many ERROR lines are in {build} and {test}, and what share of all their lines is that?"
                     if t == 1 else f"Thanks. Now the same for {build} and {test}.")
        steps = [
            (f"The user wants the ERROR lines of {build} and {test} and their share of all lines. I will read "
             f"{build} first and count its lines and ERROR lines, then {test}, then compute the share with the "
             "calculator instead of doing the division in my head.", "", [("read_file", {"path": build})]),
            (f"{build} has {lines_b} lines, {err_b} of them ERROR. Now {test}; meanwhile the calculator can give "
             f"{build}'s own share, which the user may want next to the total.", "",
             [("read_file", {"path": test}), ("calculator", {"expression": f"{err_b} / {lines_b} * 100"})]),
            (f"{test} has {lines_t} lines, {err_t} of them ERROR. The share over both files is "
             f"({err_b} + {err_t}) / ({lines_b} + {lines_t}).", "", [("calculator", {"expression": share})]),
            (f"The calculator says {percent} percent. Summarise the counts for both files and the share.",
             f"{build}: {err_b} ERROR lines of {lines_b}; {test}: {err_t} of {lines_t}. Together "
             f"{err_b + err_t} of {lines_b + lines_t} lines, {percent}% of them.", []),
        ]
        replies += [reply(*step)[1] for step in steps]
    users.append(FOLLOW_UP)
    replies.append(reply("Simple arithmetic, no tool needed: 7 * 8 = 56.", "7 * 8 = 56.", [])[1])
    return users, replies


def run_trace(profile_name: str, policy: str, turns: int, result_tokens: int,
              kv_scale: float = 2.0) -> list[Step]:
    """The trace under `policy` on a fresh engine; one Step per model call."""
    from tests.helpers.reasoning_templates import QWEN3_AGENT_TEMPLATE
    from tsterm.agent.loop import Agent, AgentFinished, AgentOptions
    from tsterm.agent.tools import Calculator, ReadFile
    from tsterm.agent.toolset import open_workspace
    from tsterm.launch import load_llm
    from tsterm.profiles import load_profile

    profile = load_profile(profile_name)
    overrides = {}
    if profile.engine.get("kv_cache_memory"):  # room for the old and the re-rendered loop under `template`
        overrides["kv_cache_memory"] = int(profile.engine["kv_cache_memory"] * kv_scale)
    llm = load_llm(profile, **overrides)
    tokenizer = copy.copy(llm.tokenizer)  # the engine's tokenizer, rendering with the thinking template
    tokenizer.chat_templates = {"default": QWEN3_AGENT_TEMPLATE}
    with tempfile.TemporaryDirectory(prefix="thinking-history-") as tmp:
        users, replies = build_trace(Path(tmp), tokenizer, turns, result_tokens)
        backend = ScriptedReplies(llm, replies)
        root = open_workspace(tmp)
        agent = Agent(backend, tokenizer, [ReadFile(root), Calculator()], profile.sampling_params(temperature=0),
                      options=AgentOptions(max_steps=8, auto_approve=True), system_prompt=profile.system_prompt,
                      history_policy=policy)

        async def session() -> list[int]:
            firsts = []
            for text in users:
                firsts.append(len(agent.steps))
                done = [e async for e in agent.run(text) if isinstance(e, AgentFinished)]
                if done[-1].reason != "answer":
                    raise RuntimeError(f"the scripted turn {text!r} ended with {done[-1].reason}")
            await agent.close()
            return firsts

        try:
            firsts = asyncio.run(session())
        finally:
            llm.engine.shutdown()
    if backend.replies:
        raise RuntimeError(f"{len(backend.replies)} scripted replies were not asked for")
    limit = llm.engine.config.max_model_len
    if len(agent.session.token_ids) > limit:
        raise RuntimeError(f"the trace ({len(agent.session.token_ids)} tokens) is longer than the model's {limit}")
    turn_of = {i: sum(i >= f for f in firsts) for i in range(len(agent.steps))}
    return [Step(turn_of[i], s.index, s.prompt_tokens, s.cached_tokens, s.kept_tokens, s.generated_tokens, s.miss,
                 s.diverged_at,
                 s.ttft_s or 0.0, s.policy_applied, s.fallback_reason) for i, s in enumerate(agent.steps)]


def token_view(steps: Sequence[Step]) -> list[tuple]:
    """What must be the same in every round of one policy: everything but the times."""
    return [(s.turn, s.prompt, s.cached, s.kept, s.generated, s.miss, s.diverged_at, s.policy_applied)
            for s in steps]


def median_times(rounds: Sequence[Sequence[Step]]) -> list[Step]:
    """The first round's steps with each step's median time to first token over the rounds."""
    out = []
    for i, step in enumerate(rounds[0]):
        d = asdict(step)
        d["ttft_s"] = statistics.median(r[i].ttft_s for r in rounds)
        out.append(Step(**d))
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def trace_report(runs: dict[str, list[Step]], rounds: int) -> list[str]:
    lines = []
    per = {p: turns_of(steps) for p, steps in runs.items()}
    last = max(t.turn for t in per["preserve"])
    follow_ups = f"turn {last} the follow-up" if last == 2 else f"turns 2-{last} the follow-ups"
    for policy, turns in per.items():
        lines += ["", f"**{policy}** (per user turn; turn 1 is the task, {follow_ups}; times: median "
                      f"of {rounds} round{'s' if rounds > 1 else ''})", "",
                  "| turn | model calls | prompt tokens | cached | prefilled | follow-up: prompt / kept / cached "
                  "| cached of the session's ids | follow-up TTFT s | turn prefill s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in turns:
            miss = " (miss)" if t.first_miss else ""
            share = f"{t.first_cached} of {t.prior} ({100 * t.first_cached / t.prior:.1f}%)" if t.prior else "-"
            lines.append(f"| {t.turn} | {t.steps} | {t.prompt} | {t.cached} | {t.prefilled} | {t.first_prompt} / "
                         f"{t.first_kept} / {t.first_cached}{miss} | {share} | {t.ttft_s:.2f} | {t.prefill_s:.2f} |")
        lines.append(f"| all | {sum(t.steps for t in turns)} | {sum(t.prompt for t in turns)} | "
                     f"{sum(t.cached for t in turns)} | {sum(t.prefilled for t in turns)} | | | "
                     f"{sum(t.ttft_s for t in turns[1:]):.2f} (follow-ups) | {sum(t.prefill_s for t in turns):.2f} |")
    lines += ["", "**preserve / template** (tokens exact; times: as above)", "",
              "| turn | follow-up prefilled tokens | ratio | follow-up TTFT s | ratio | turn prefilled tokens | ratio "
              "| turn prefill s | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    pt, tt = per["preserve"], per["template"]
    for p, t in zip(pt, tt):
        lines.append(f"| {p.turn} | {p.first_prompt - p.first_cached} / {t.first_prompt - t.first_cached} | "
                     f"{ratio(p.first_prompt - p.first_cached, t.first_prompt - t.first_cached)} | "
                     f"{p.ttft_s:.2f} / {t.ttft_s:.2f} | {ratio(p.ttft_s, t.ttft_s)} | {p.prefilled} / "
                     f"{t.prefilled} | {ratio(p.prefilled, t.prefilled)} | {p.prefill_s:.2f} / {t.prefill_s:.2f} | "
                     f"{ratio(p.prefill_s, t.prefill_s)} |")
    fp = sum(p.first_prompt - p.first_cached for p in pt[1:])
    ft = sum(t.first_prompt - t.first_cached for t in tt[1:])
    ttp, ttt = sum(p.ttft_s for p in pt[1:]), sum(t.ttft_s for t in tt[1:])
    ap, at = sum(p.prefilled for p in pt), sum(t.prefilled for t in tt)
    sp, st = sum(p.prefill_s for p in pt), sum(t.prefill_s for t in tt)
    lines.append(f"| follow-ups / all | {fp} / {ft} | {ratio(fp, ft)} | {ttp:.2f} / {ttt:.2f} | "
                 f"{ratio(ttp, ttt)} | {ap} / {at} | {ratio(ap, at)} | {sp:.2f} / {st:.2f} | {ratio(sp, st)} |")
    return lines


# ---- agent: agent-demo's held-out tasks with a follow-up ----------------------------------------------------------

@dataclass(frozen=True)
class AgentTask:
    question: str
    expressions: tuple[str, ...]
    results: tuple[str, ...]


@dataclass
class AgentResult:
    answers: list[str] = field(default_factory=list)  # the task's, then the follow-up's, session after session
    reasons: list[str] = field(default_factory=list)
    answer_right: list[bool] = field(default_factory=list)
    calls_right: list[bool] = field(default_factory=list)
    session_ids: list[list[int]] = field(default_factory=list)
    prefilled: int = 0  # prompt tokens the engine computed, over every step
    fallbacks: int = 0  # steps `preserve` could not plan


def heldout_pairs(sessions: int) -> list[tuple[AgentTask, AgentTask]]:
    """(task, follow-up) per session from scripts/train_agent_demo.py's held-out set (the training run's arguments):
    session i asks single[i] then double[i], or double[i] then single[i] for odd i."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from train_agent_demo import make_tasks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    _, held = make_tasks(seed=0, conversations=32000, heldout=100)
    if sessions > len(held["single"]):
        raise SystemExit(f"--sessions: at most {len(held['single'])} (the held-out set's size per kind)")
    to = lambda t: AgentTask(t.question, t.expressions, t.results)  # noqa: E731
    return [(to(s), to(d)) if i % 2 == 0 else (to(d), to(s))
            for i, (s, d) in enumerate(zip(held["single"][:sessions], held["double"][:sessions]))]


def answer_right(task: AgentTask, answer: str) -> bool:
    return all(re.search(rf"= {re.escape(r)}(?!\d)", answer) for r in task.results)


def calls_right(task: AgentTask, steps: Sequence[Any]) -> bool:
    calls = [(c.error is None, c.name, c.arguments) for c in steps[0].tool_calls] if steps else []
    return calls == [(True, "calculator", {"expression": e}) for e in task.expressions]


def run_agent_demo(policy: str, pairs: Sequence[tuple[AgentTask, AgentTask]]) -> AgentResult:
    """Each pair as `tsterm agent --profile agent-demo --thinking-history POLICY TASK --follow-up FOLLOW_UP` runs it,
    on a fresh engine; the sessions one after the other."""
    from tsterm.agent.loop import Agent, AgentFinished
    from tsterm.agent.toolset import build_toolset
    from tsterm.engine.async_engine import AsyncEngine
    from tsterm.launch import load_llm
    from tsterm.profiles import load_profile

    profile = load_profile("agent-demo")
    settings = profile.agent_settings()
    options, params = settings.loop_options(), profile.sampling_params()
    result = AgentResult()
    llm = load_llm(profile)
    with tempfile.TemporaryDirectory(prefix="agent-demo-") as tmp, build_toolset(settings, tmp) as toolset:
        engine = AsyncEngine(llm.engine)

        async def sessions() -> None:
            for pair in pairs:
                agent = Agent(engine, llm.tokenizer, toolset.tools, params, options=options,
                              system_prompt=profile.system_prompt, history_policy=policy,
                              stop_ids=llm.engine.eos_token_ids)
                for task in pair:
                    first = len(agent.steps)
                    [done] = [e async for e in agent.run(task.question) if isinstance(e, AgentFinished)]
                    steps = agent.steps[first:]
                    result.answers.append(done.answer)
                    result.reasons.append(done.reason)
                    result.answer_right.append(done.reason == "answer" and answer_right(task, done.answer))
                    result.calls_right.append(calls_right(task, steps))
                await agent.close()
                result.session_ids.append(list(agent.session.token_ids))
                result.prefilled += sum(s.new_tokens for s in agent.steps)
                result.fallbacks += sum(s.fallback_reason is not None for s in agent.steps)

        try:
            asyncio.run(sessions())
        finally:
            engine.shutdown()
    return result


def agent_report(results: dict[str, AgentResult], sessions: int) -> list[str]:
    lines = ["", f"| policy | task answers right (of {sessions}) | follow-up answers right (of {sessions}) | "
                 "calls right (task / follow-up) | both right | prompt tokens computed | preserve fell back |",
             "|---|---|---|---|---|---|---|"]
    for policy, r in results.items():
        task, follow = r.answer_right[0::2], r.answer_right[1::2]
        ct, cf = r.calls_right[0::2], r.calls_right[1::2]
        both = sum(a and c for a, c in zip(r.answer_right, r.calls_right))
        lines.append(f"| {policy} | {sum(task)} | {sum(follow)} | {sum(ct)} / {sum(cf)} | {both} of "
                     f"{len(r.answer_right)} | {r.prefilled} | {r.fallbacks} steps |")
    p, t = results["preserve"], results["template"]
    same_ids = sum(a == b for a, b in zip(p.session_ids, t.session_ids))
    same = sum(a == b for a, b in zip(p.answers, t.answers))
    lines += ["", f"Same session ids under both policies: {same_ids} of {len(p.session_ids)} sessions; same answers: "
                  f"{same} of {len(p.answers)} (agent-demo does not think: a check that `preserve` changes nothing "
                  "where the template drops nothing)."]
    return lines


# ---- factual: the default model's questions, one chat -------------------------------------------------------------

@dataclass
class ChatResult:
    answers: list[str]
    right: list[bool]
    prompt_ids: list[int]  # the session's last prompt + reply
    prefilled: int
    fallbacks: int
    cut: int  # replies that hit max_tokens (`preserve` cannot apply after them)


def thinking_off(template: str) -> str:
    """SmolLM2's template with Qwen3's thinking-off generation prompt: the reply opens with an empty think block
    that the template does not render into the history."""
    out = template.replace("{{ '<|im_start|>assistant\n' }}{% endif %}",
                           "{{ '<|im_start|>assistant\n" + EMPTY_THINK + "' }}{% endif %}")
    if out == template:
        raise RuntimeError("the default model's template has no generation prompt where this benchmark expects it")
    return out


def run_factual(policy: str, variant: str, questions: Sequence[tuple[str, tuple[str, ...]]],
                max_tokens: int) -> ChatResult:
    """The questions one after the other in one line-mode chat (the profile's system prompt, greedy with its
    penalties) on a fresh engine of the default profile."""
    from benchmarks.default_sampling import right
    from tsterm.chat.line_chat import LineChat
    from tsterm.launch import load_llm
    from tsterm.profiles import load_profile

    profile = load_profile("default")
    llm = load_llm(profile)
    if variant == "thinking-off":
        llm.tokenizer.chat_templates = {**llm.tokenizer.chat_templates,
                                        "default": thinking_off(llm.tokenizer.chat_templates["default"])}
    params = profile.sampling_params(temperature=0, max_tokens=max_tokens)
    stdin = io.StringIO("".join(q.replace("\n", " ") + "\n" for q, _ in questions))
    line = LineChat(llm, params, profile.system_prompt, None, stdin, io.StringIO(), io.StringIO(), interactive=False,
                    history_policy=policy)
    try:
        line.run()
    finally:
        llm.engine.shutdown()
    session = line.session
    answers = [m["content"] for m in session.messages if m["role"] == "assistant"]
    if len(answers) != len(questions):
        raise RuntimeError(f"{len(answers)} replies to {len(questions)} questions")
    return ChatResult(answers, [right(a, acc) for a, (_, acc) in zip(answers, questions)], list(session.token_ids),
                      sum(t.new_tokens for t in session.turns),
                      sum(t.fallback_reason is not None for t in session.turns),
                      sum(t.finish_reason == "length" for t in session.turns))


def factual_report(results: dict[tuple[str, str], ChatResult], count: int) -> list[str]:
    lines = ["", f"| template | policy | right (of {count}) | prompt tokens computed | preserve fell back "
                 "| replies cut at max_tokens |", "|---|---|---|---|---|---|"]
    for (variant, policy), r in results.items():
        lines.append(f"| {variant} | {policy} | {sum(r.right)} | {r.prefilled} | {r.fallbacks} | {r.cut} |")
    for variant in dict.fromkeys(v for v, _ in results):
        p, t = results[(variant, "preserve")], results[(variant, "template")]
        same = sum(a == b for a, b in zip(p.answers, t.answers))
        flips = [(i + 1, "+" if a else "-") for i, (a, b) in enumerate(zip(p.right, t.right)) if a != b]
        lines.append(f"- {variant}: same answers under both policies {same} of {count}"
                     + ("; the session's ids are identical" if p.prompt_ids == t.prompt_ids else "")
                     + (f"; right under preserve only (+) / template only (-), by question: {flips}" if flips else ""))
    return lines


# ---- the CPU and main -------------------------------------------------------------------------------------------

def cpu_line() -> str:
    from tsterm.bench.machine import cpu_description

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"CPU: {cpu_description()}; load average at start {load}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="trace,agent,factual", help="comma-separated: trace, agent, factual")
    p.add_argument("--quick", action="store_true",
                   help="a short run: 2 turns of ~400-token results, 1 round, 10 sessions, 8 questions")
    p.add_argument("--profile", default="default", help="the trace's model (default: the shipped SmolLM2)")
    p.add_argument("--turns", type=int, help="user turns with a tool loop in the trace (default 3)")
    p.add_argument("--result-tokens", type=int, help="tokens of each turn's first log (default 1100)")
    p.add_argument("--rounds", type=int, help="trace runs per policy, alternating (default 2); times: the median")
    p.add_argument("--sessions", type=int, help="agent-demo sessions (task + follow-up) per policy (default 100)")
    p.add_argument("--questions", type=int, help="factual questions per chat (default: all 20)")
    p.add_argument("--answer-tokens", type=int, default=96, help="max_tokens of a factual answer (default 96)")
    p.add_argument("--json", help="also write every figure to this file")
    args = p.parse_args(argv)
    quick = dict(turns=2, result_tokens=400, rounds=1, sessions=10, questions=8)
    full = dict(turns=3, result_tokens=1100, rounds=2, sessions=100, questions=20)
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = set(args.parts) - {"trace", "agent", "factual"}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    cpu = cpu_line()
    print(cpu)
    command = " ".join(["python benchmarks/thinking_history.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"date {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; {command}")
    figures: dict[str, Any] = {"cpu": cpu}

    if "trace" in args.parts:
        rounds: dict[str, list[list[Step]]] = {p: [] for p in POLICIES}
        for r in range(args.rounds):
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                note(f"[trace] round {r + 1}: {policy}")
                rounds[policy].append(run_trace(args.profile, policy, args.turns, args.result_tokens))
        for policy, runs in rounds.items():
            if any(token_view(run) != token_view(runs[0]) for run in runs):
                raise RuntimeError(f"the token counts of {policy} differ between rounds")
        runs = {p: median_times(r) for p, r in rounds.items()}
        print(f"\n### trace: {args.turns} turns with a tool loop + a follow-up, profile {args.profile}, "
              "in-house Qwen3 thinking template")
        print("\n".join(trace_report(runs, args.rounds)))
        figures["trace"] = {p: [asdict(s) for s in steps] for p, steps in runs.items()}

    if "agent" in args.parts:
        pairs = heldout_pairs(args.sessions)
        results = {}
        for policy in POLICIES:
            note(f"[agent] agent-demo, {args.sessions} sessions: {policy}")
            results[policy] = run_agent_demo(policy, pairs)
        print(f"\n### agent-demo: {args.sessions} held-out tasks, each with a held-out follow-up in its session")
        print("\n".join(agent_report(results, args.sessions)))
        figures["agent"] = {p: {k: v for k, v in asdict(r).items() if k != "session_ids"} for p, r in results.items()}

    if "factual" in args.parts:
        from benchmarks.default_sampling import QUESTIONS

        questions = QUESTIONS[:args.questions]
        chats = {}
        for variant in ("smollm2", "thinking-off"):
            for policy in POLICIES:
                note(f"[factual] {variant}: {policy}")
                chats[(variant, policy)] = run_factual(policy, variant, questions, args.answer_tokens)
        print(f"\n### default model's factual questions, {len(questions)} in one chat, greedy, max_tokens "
              f"{args.answer_tokens}")
        print("\n".join(factual_report(chats, len(questions))))
        figures["factual"] = {f"{v}/{p}": {k: val for k, val in asdict(r).items() if k != "prompt_ids"}
                              for (v, p), r in chats.items()}

    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str) + "\n")
    return figures


if __name__ == "__main__":
    main()

"""benchmarks/thinking_history.py's logic, never its timings (the figures are the benchmark's to report): a turn's
figures are its steps' and its follow-up is measured against the session's ids before it; agent-demo's answer and
call checks; and a tiny run of every part on the shipped models, whose token counts show the policies' difference
(the follow-up reuses the loop under `preserve`, recomputes it from the loop's first reply under `template`) and
whose answers are the same where the template drops nothing."""
from __future__ import annotations

import json
from types import SimpleNamespace

from benchmarks.thinking_history import AgentTask, Step, answer_right, calls_right, main, turns_of


def step(turn: int, index: int, prompt: int, cached: int, generated: int = 10, ttft: float = 0.5) -> Step:
    return Step(turn, index, prompt, cached, 0, generated, False, None, ttft, "preserve", None)


def test_a_turn_sums_its_steps_and_its_follow_up_is_measured_against_the_ids_before_it():
    steps = [step(1, 1, 100, 0, 20, 1.0), step(1, 2, 300, 112, 30, 2.0),  # a task with one tool call
             step(2, 3, 350, 320, 12, 0.25), step(2, 4, 500, 352, 8, 1.5),  # a follow-up with one tool call
             step(3, 5, 520, 496, 5, 0.125)]  # a follow-up answered at once
    first, second, third = turns_of(steps)
    assert (first.steps, first.prompt, first.cached, first.prefilled, first.prior) == (2, 400, 112, 288, 0)
    assert (first.ttft_s, first.prefill_s) == (1.0, 3.0)
    assert (second.steps, second.prompt, second.cached, second.prefilled) == (2, 850, 672, 178)
    assert (second.first_prompt, second.first_cached, second.prior) == (350, 320, 330)  # step 2's prompt + reply
    assert (second.ttft_s, second.prefill_s) == (0.25, 1.75)
    assert (third.steps, third.prior, third.prefilled, third.prefill_s) == (1, 508, 24, 0.125)


def test_agent_demo_answers_and_calls_are_checked_as_its_training_report_does():
    task = AgentTask("What is 2 + 3 and 4 * 5?", ("2 + 3", "4 * 5"), ("5", "20"))
    assert answer_right(task, "2 + 3 = 5 and 4 * 5 = 20.")
    assert not answer_right(task, "2 + 3 = 5 and 4 * 5 = 205.")  # a longer number is another result
    assert not answer_right(task, "2 + 3 = 5.")
    def call(expression: str, error: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(name="calculator", arguments={"expression": expression}, error=error)

    assert calls_right(task, [SimpleNamespace(tool_calls=[call("2 + 3"), call("4 * 5")])])
    assert not calls_right(task, [SimpleNamespace(tool_calls=[call("4 * 5"), call("2 + 3")])])  # in the task's order
    assert not calls_right(task, [SimpleNamespace(tool_calls=[call("2 + 3"), call("4 * 5", "malformed")])])
    assert not calls_right(task, [SimpleNamespace(tool_calls=[call("2 + 3")])]) and not calls_right(task, [])


def test_a_tiny_run_of_every_part(tmp_path, capsys):
    out = tmp_path / "figures.json"
    figures = main(["--turns", "1", "--result-tokens", "40", "--rounds", "1", "--sessions", "2",
                    "--questions", "2", "--answer-tokens", "24", "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("CPU: ") and "AVX-512: " in printed and "AMX: " in printed
    assert "**preserve / template**" in printed and "### agent-demo" in printed and "### default model" in printed
    assert json.loads(out.read_text())["trace"] == figures["trace"]

    preserve, template = figures["trace"]["preserve"], figures["trace"]["template"]
    assert len(preserve) == len(template) == 5  # the task's four model calls, then the follow-up's
    view = lambda s: (s["turn"], s["prompt"], s["cached"], s["kept"], s["generated"], s["miss"])  # noqa: E731
    assert [view(s) for s in preserve[:4]] == [view(s) for s in template[:4]]  # inside a loop nothing is dropped
    *loop, asked = preserve
    prior = loop[-1]["prompt"] + loop[-1]["generated"]
    assert not asked["miss"] and asked["kept"] == prior and asked["cached"] >= prior - 16
    assert asked["policy_applied"] == "preserve" and asked["fallback_reason"] is None
    *loop, asked = template
    assert asked["miss"] and asked["diverged_at"] == asked["kept"]
    assert loop[0]["prompt"] <= asked["diverged_at"] < loop[0]["prompt"] + loop[0]["generated"]  # in its first reply
    assert asked["cached"] <= asked["diverged_at"] and asked["prompt"] - asked["cached"] > 10 * 24

    agent = figures["agent"]
    assert len(agent["preserve"]["answers"]) == 4 and agent["preserve"]["answers"] == agent["template"]["answers"]
    assert agent["preserve"]["fallbacks"] == 0 and agent["preserve"]["prefilled"] == agent["template"]["prefilled"]
    factual = figures["factual"]
    assert factual["smollm2/preserve"]["answers"] == factual["smollm2/template"]["answers"]
    assert all(len(r["answers"]) == 2 for r in factual.values())

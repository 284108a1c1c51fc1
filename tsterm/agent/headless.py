"""`tsterm agent "task"`: one agent task on the command line, and its follow-ups (`--follow-up TEXT`, repeatable:
further user messages sent in the same session, each after the one before has answered, as a user would in the
TUI). Steps stream to stderr as they happen (the model's text, each tool call and its result, the tokens each step
reused, the thinking-history policy that planned it); each task's answer goes to stdout, or with --json one JSON
object: {"answer", "reason", "thinking_history", "steps": [{"prompt_tokens", "cached_tokens", "text", "tool_calls":
[...], "policy_applied", ...}], "follow_ups": [{"task", "answer", "reason", "prompt_tokens", "cached_tokens",
"prior_tokens", "policy_applied", "fallback_reason", ...}]} ("answer"/"reason" are the task's; "steps" every step of
the session). A follow-up's numbers are those of its first step, the one that starts from the session's history.

Tools that need approval are asked about on the terminal (y/N); without a terminal they are refused unless --auto
(or the profile's agent.auto_approve) allows them.

Tool calls are generated under the tool-call grammar (tsterm.agent.loop: the offered tools only, arguments valid
against their schemas) unless --no-constrain-tool-calls or the profile's agent.constrain_tool_calls: false says not;
where the grammar cannot be built, one `tsterm: warning:` line says why and the task runs unconstrained. --json says
which it was ("constrained_tool_calls").
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from tsterm.agent.loop import (Agent, AgentFinished, AgentStep, StepFinished, StepStarted, TextChunk,
                               ToolCallRecord, ToolFinished, ToolStarted)
from tsterm.agent.tools import Tool
from tsterm.agent.toolset import build_toolset
from tsterm.chat.history import POLICIES
from tsterm.errors import ConfigError
from tsterm.profiles import DEFAULT_THINKING_HISTORY, AgentSettings

EXIT_CODES = {"answer": 0, "length": 1, "max_steps": 1, "aborted": 130}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("agent", help="run one agent task: the model calls tools until it answers")
    p.add_argument("task", help="what the agent should do")
    p.add_argument("--follow-up", action="append", dest="follow_ups", metavar="TEXT",
                   help="a further user message, sent in the same session once the task (or the follow-up before "
                        "it) has answered; repeatable, run in order. Its answer goes to stdout after the task's; "
                        "stderr (and --json's follow_ups) say how many of its prompt tokens came from the cache")
    p.add_argument("--thinking-history", choices=POLICIES, dest="thinking_history",
                   help="earlier turns in each prompt: preserve (the exact ids the engine computed, the reasoning "
                        "a template would drop included) or template (as the chat template renders them, "
                        f"recomputed from where they differ) (default: the profile's thinking_history, else "
                        f"{DEFAULT_THINKING_HISTORY})")
    p.add_argument("--model", help="HF-format model directory (or demo:tiny)")
    p.add_argument("--profile", dest="profile", default=argparse.SUPPRESS, help="profile name or YAML path")
    p.add_argument("--max-steps", type=int, dest="max_steps", help="model calls at most (profile: agent.max_steps)")
    p.add_argument("--auto", action="store_true", help="run write and command tools without asking")
    p.add_argument("--workspace", help="the directory the tools work in (default: the profile's, else .)")
    p.add_argument("--tools", help="comma-separated built-in tools to offer (default: the profile's agent.tools, "
                   "else calculator,read_file,list_dir,grep)")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--no-constrain-tool-calls", action="store_const", const=False, dest="constrain_tool_calls",
                   help="generate without the tool-call grammar (default: the profile's agent.constrain_tool_calls, "
                        "else constrained: calls of the offered tools only, their arguments valid against the tools' "
                        "schemas)")
    p.add_argument("--json", action="store_true", help="print one JSON object (answer and every step) instead")
    p.add_argument("--trace", metavar="FILE", help="save the session's trace (for `tsterm bench --trace FILE`)")
    p.add_argument("--max-tokens", type=int, dest="max_tokens", help="per step")
    p.add_argument("--temperature", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="auto, cpu or cuda[:N]")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from tsterm.engine.async_engine import AsyncEngine
    from tsterm.launch import llm_from_args, profile_from_args

    if not args.task.strip():
        raise ConfigError("the task is empty: say what the agent should do")
    follow_ups = args.follow_ups or []
    for n, text in enumerate(follow_ups, 1):
        if not text.strip():
            raise ConfigError(f"--follow-up number {n} is empty: give the message to send")
    if not args.model and not getattr(args, "profile", None):
        args.profile = "default"
    profile = profile_from_args(args)
    settings = profile.agent_settings() if profile else AgentSettings()
    if args.tools is not None:
        settings = dataclasses.replace(settings, tools=[t.strip() for t in args.tools.split(",") if t.strip()])
    options = settings.loop_options(max_steps=args.max_steps, auto_approve=True if args.auto else None)
    overrides = {key: getattr(args, key) for key in ("temperature", "max_tokens", "seed")}
    params = profile.sampling_params(**overrides) if profile else _params(overrides)
    system = args.system if args.system is not None else (profile.system_prompt if profile else None)
    policy = args.thinking_history or (profile.thinking_history if profile else DEFAULT_THINKING_HISTORY)
    with build_toolset(settings, args.workspace) as toolset:  # bad tool config fails before the model loads
        llm = llm_from_args(args, profile)
        if toolset.tools and not _template_mentions_tools(llm.tokenizer):
            print("tsterm: warning: this model's chat template does not mention tools: the model will not see "
                  "them", file=sys.stderr)
        engine = AsyncEngine(llm.engine)
        log = None if args.json else sys.stderr
        approve = _ask_on_terminal(toolset.workspace.root, log or sys.stderr) if sys.stdin.isatty() else None
        constrain = settings.constrain_tool_calls if args.constrain_tool_calls is None else args.constrain_tool_calls
        agent = Agent(engine, llm.tokenizer, toolset.tools, params, options=options, approve=approve,
                      system_prompt=system, history_policy=policy, stop_ids=llm.engine.eos_token_ids,
                      constrain_tool_calls=constrain)
        if agent.constraint_note:  # the grammar cannot be built: the session runs unconstrained, said once
            print(f"tsterm: warning: {agent.constraint_note}", file=sys.stderr)
        if any(tool.needs_approval for tool in toolset.tools):  # write or command tools: how they are confined
            print(f"tsterm: {toolset.sandbox}", file=sys.stderr)
        try:
            tasks = asyncio.run(_run(agent, [args.task, *follow_ups], log))
        finally:
            engine.shutdown()
    if args.trace:
        trace = agent.trace(model=str(llm.config.model))
        Path(args.trace).write_text(json.dumps(trace, indent=1) + "\n")
    if args.json:
        first = tasks[0]
        json.dump({**agent.to_json(first.done.answer), "reason": first.done.reason, "thinking_history": policy,
                   "constrained_tool_calls": agent.constrains_tool_calls,
                   "follow_ups": [task.to_json() for task in tasks[1:]]}, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        for n, task in enumerate(tasks):
            print(task.done.answer)
            if task.done.reason != "answer":
                which = f"follow-up {n}: " if n else ""
                print(f"tsterm: {which}the agent stopped before a final answer "
                      f"({_why(task.done, options.max_steps)})", file=sys.stderr)
    unsent = 1 + len(follow_ups) - len(tasks)
    if unsent:
        print(f"tsterm: {unsent} follow-up(s) not sent: the session was aborted", file=sys.stderr)
    return max(EXIT_CODES[task.done.reason] for task in tasks)


def _params(overrides: dict[str, Any]):
    from tsterm.config import SamplingParams
    return SamplingParams(**{k: v for k, v in overrides.items() if v is not None})


def _why(done: AgentFinished, max_steps: int) -> str:
    used = "its only step" if max_steps == 1 else f"all {max_steps} steps"
    return {"max_steps": f"it used {used}; raise --max-steps",
            "length": "its last reply hit max_tokens; raise --max-tokens",
            "aborted": "aborted"}.get(done.reason, done.reason)


def _template_mentions_tools(tokenizer) -> bool:
    return any("tools" in source for source in tokenizer.chat_templates.values())


@dataclasses.dataclass
class TaskRun:
    """One task of the session (the task or a follow-up): how it ended and the steps it took."""

    text: str
    done: AgentFinished
    steps: list[AgentStep]
    prior_tokens: int  # the session's kept ids when it started: what its first step could reuse at most

    def to_json(self) -> dict[str, Any]:
        """A follow-up's entry in --json: its answer, and what its first step reused of the session's history."""
        first = self.steps[0] if self.steps else None
        reuse = {"prompt_tokens": first.prompt_tokens, "cached_tokens": first.cached_tokens,
                 "new_tokens": first.new_tokens, "kept_tokens": first.kept_tokens, "miss": first.miss,
                 "diverged_at": first.diverged_at, "policy_applied": first.policy_applied,
                 "fallback_reason": first.fallback_reason} if first else {}
        return {"task": self.text, "answer": self.done.answer, "reason": self.done.reason,
                "first_step": first.index if first else None, "step_count": len(self.steps),
                "prior_tokens": self.prior_tokens, **reuse}


async def _run(agent: Agent, tasks: list[str], log: TextIO | None) -> list[TaskRun]:
    """The task and its follow-ups, one after the other in the agent's session; an aborted one ends the run."""
    runs: list[TaskRun] = []
    try:
        for n, text in enumerate(tasks):
            if n and log is not None:
                log.write(f"\n[follow-up {n}: {_clip(text, 200)}]\n")
            prior, first = len(agent.session.token_ids), len(agent.steps)
            done: AgentFinished | None = None
            async for event in agent.run(text):
                if isinstance(event, AgentFinished):
                    done = event
                elif log is not None:
                    _show(event, log)
            assert done is not None
            runs.append(TaskRun(text, done, agent.steps[first:], prior))
            if n and log is not None:
                _show_follow_up(n, runs[-1], log)
            if done.reason == "aborted":
                break
    finally:
        await agent.close()
    return runs


def _show_follow_up(n: int, run: TaskRun, log: TextIO) -> None:
    if not run.steps:
        return
    s = run.steps[0]
    share = f" ({100 * s.cached_tokens / run.prior_tokens:.1f}% of the session's {run.prior_tokens})" \
        if run.prior_tokens else ""
    log.write(f"[follow-up {n}: {s.cached_tokens} of {s.prompt_tokens} prompt tokens from the cache{share}; "
              f"thinking history: {_policy_text(s.policy_applied, s.fallback_reason)}]\n")
    log.flush()


def _policy_text(applied: str | None, fallback: str | None) -> str:
    return f"{applied}" + (f" (preserve could not apply: {fallback})" if fallback else "")


def _show(event, log: TextIO) -> None:
    if isinstance(event, StepStarted):
        miss = (f"; the chat template re-rendered the history from token {event.diverged_at}, so "
                f"{event.lost_tokens} tokens are computed again" if event.miss else "")
        log.write(f"[step {event.step}: {event.prompt_tokens} prompt tokens, history: "
                  f"{_policy_text(event.policy_applied, event.fallback_reason)}{miss}]\n")
    elif isinstance(event, TextChunk):
        log.write(event.text)
    elif isinstance(event, StepFinished):
        s = event.step
        log.write(f"\n[step {s.index}: {s.cached_tokens} of {s.prompt_tokens} prompt tokens from the cache, "
                  f"{s.new_tokens} computed; {s.generated_tokens} generated]\n")
    elif isinstance(event, ToolStarted):
        log.write(f"-> {_call_text(event.call)}\n")
    elif isinstance(event, ToolFinished):
        c = event.call
        if c.error is not None:
            log.write(f"   error: {c.error}\n")
        else:
            log.write(f"   = {_clip(c.result or '')} ({c.duration_s:.3f} s)\n")
    log.flush()


def _call_text(call: ToolCallRecord) -> str:
    return f"{call.name or '?'}({json.dumps(call.arguments, ensure_ascii=False)})"


def _clip(text: str, limit: int = 400) -> str:
    text = text.replace("\n", "\n     ")
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters)"


def _ask_on_terminal(root: Path, log: TextIO):
    async def approve(call: ToolCallRecord, tool: Tool) -> bool:
        def ask() -> bool:
            log.write(f"\nallow {_call_text(call)} in {root}? [y/N] ")
            log.flush()
            answer = sys.stdin.readline()
            return answer.strip().lower() in ("y", "yes")
        return await asyncio.to_thread(ask)
    return approve

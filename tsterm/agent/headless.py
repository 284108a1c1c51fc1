"""`tsterm agent "task"`: one agent task on the command line. Steps stream to stderr as they happen (the model's
text, each tool call and its result, the tokens each step reused); the final answer goes to stdout, or with --json
one JSON object: {"answer", "reason", "steps": [{"prompt_tokens", "cached_tokens", "text", "tool_calls": [...]}]}.

Tools that need approval are asked about on the terminal (y/N); without a terminal they are refused unless --auto
(or the profile's agent.auto_approve) allows them.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from tsterm.agent.loop import (Agent, AgentFinished, StepFinished, StepStarted, TextChunk, ToolCallRecord,
                               ToolFinished, ToolStarted)
from tsterm.agent.tools import Tool
from tsterm.agent.toolset import build_toolset
from tsterm.errors import ConfigError
from tsterm.profiles import AgentSettings

EXIT_CODES = {"answer": 0, "length": 1, "max_steps": 1, "aborted": 130}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("agent", help="run one agent task: the model calls tools until it answers")
    p.add_argument("task", help="what the agent should do")
    p.add_argument("--model", help="HF-format model directory (or demo:tiny)")
    p.add_argument("--profile", dest="profile", default=argparse.SUPPRESS, help="profile name or YAML path")
    p.add_argument("--max-steps", type=int, dest="max_steps", help="model calls at most (profile: agent.max_steps)")
    p.add_argument("--auto", action="store_true", help="run write and command tools without asking")
    p.add_argument("--workspace", help="the directory the tools work in (default: the profile's, else .)")
    p.add_argument("--tools", help="comma-separated built-in tools to offer (default: the profile's agent.tools, "
                   "else calculator,read_file,list_dir,grep)")
    p.add_argument("--system", help="system prompt")
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
    with build_toolset(settings, args.workspace) as toolset:  # bad tool config fails before the model loads
        llm = llm_from_args(args, profile)
        if toolset.tools and not _template_mentions_tools(llm.tokenizer):
            print("tsterm: warning: this model's chat template does not mention tools: the model will not see "
                  "them", file=sys.stderr)
        engine = AsyncEngine(llm.engine)
        log = None if args.json else sys.stderr
        approve = _ask_on_terminal(toolset.workspace.root, log or sys.stderr) if sys.stdin.isatty() else None
        agent = Agent(engine, llm.tokenizer, toolset.tools, params, options=options, approve=approve,
                      system_prompt=system)
        try:
            done = asyncio.run(_run(agent, args.task, log))
        finally:
            engine.shutdown()
    if args.trace:
        trace = agent.trace(model=str(llm.config.model))
        Path(args.trace).write_text(json.dumps(trace, indent=1) + "\n")
    if args.json:
        json.dump({**agent.to_json(done.answer), "reason": done.reason}, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        print(done.answer)
        if done.reason != "answer":
            print(f"tsterm: the agent stopped before a final answer ({_why(done, options.max_steps)})",
                  file=sys.stderr)
    return EXIT_CODES[done.reason]


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


async def _run(agent: Agent, task: str, log: TextIO | None) -> AgentFinished:
    done: AgentFinished | None = None
    async for event in agent.run(task):
        if isinstance(event, AgentFinished):
            done = event
        elif log is not None:
            _show(event, log)
    await agent.close()
    assert done is not None
    return done


def _show(event, log: TextIO) -> None:
    if isinstance(event, StepStarted):
        miss = (f"; the chat template re-rendered the history from token {event.diverged_at}, so "
                f"{event.lost_tokens} tokens are computed again" if event.miss else "")
        log.write(f"[step {event.step}: {event.prompt_tokens} prompt tokens{miss}]\n")
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

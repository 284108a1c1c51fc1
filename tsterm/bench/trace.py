"""Multi-turn agent traces: synthetic ones shaped like TokenSpeed's agentic benchmark, or recorded ones.

Synthetic: every session starts with the same long system prompt + tool schemas and a task of its own; each later
turn appends a tool result / user message of a few hundred tokens; every reply has a fixed length. Recorded: a
`tsterm agent --trace FILE` session, replayed with the token counts of each of its steps. Token ids are drawn
deterministically from the vocabulary (no text: the trace measures the engine, not the tokenizer).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tsterm.chat.session import TRACE_FORMAT, TRACE_VERSION  # what Session.trace / `tsterm agent --trace` write
from tsterm.errors import ConfigError


@dataclass(frozen=True)
class TraceTurn:
    """One request of a session: the ids it appends to what it keeps of the conversation, and its reply length."""

    new_ids: list[int]
    output_tokens: int
    keep: int | None = None  # leading ids of the previous prompt + reply kept (None: all; fewer: a template miss)


@dataclass(frozen=True)
class TraceSpec:
    sessions: int = 1
    turns: int = 8
    # Shared by every session: system prompt + tool schemas. Real agent traces open with ~10-20K of it and grow by
    # a few hundred tokens a turn; 4K (first turn 4096 with the task) keeps that "long first turn" shape on 2 cores.
    system_tokens: int = 4032
    task_tokens: int = 64  # per-session part of the first turn
    turn_tokens: int = 256  # new tokens per later turn (tool results, user messages)
    output_tokens: int = 32  # fixed reply length
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sessions", "turns", "system_tokens", "task_tokens", "turn_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"bench trace: {name} must be >= 1, got {getattr(self, name)}")
        if self.turns < 2:
            raise ConfigError("bench trace: turns must be >= 2 (reuse starts at turn 2)")

    def final_context(self) -> int:
        return self.system_tokens + self.task_tokens + (self.turns - 1) * self.turn_tokens + self.turns * self.output_tokens


Trace = list[list[TraceTurn]]  # trace[session][turn]


def make_trace(spec: TraceSpec, vocab_size: int, reserved: int = 16) -> Trace:
    """trace[session][turn]: the new (non-reply) tokens that turn appends to the conversation."""
    rng = random.Random(spec.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(reserved, vocab_size) for _ in range(n)]

    system = ids(spec.system_tokens)
    return [[TraceTurn(system + ids(spec.task_tokens), spec.output_tokens)]
            + [TraceTurn(ids(spec.turn_tokens), spec.output_tokens) for _ in range(spec.turns - 1)]
            for _ in range(spec.sessions)]


def load_agent_trace(path: str | Path) -> dict[str, Any]:
    """A recorded agent session (`tsterm agent --trace FILE`), checked: ConfigError names the file and the field."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"trace {path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"trace {path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        raise ConfigError(f"trace {path}: not a tsterm agent trace (write one with `tsterm agent --trace FILE`)")
    if data.get("version") != TRACE_VERSION:
        raise ConfigError(f"trace {path}: version {data.get('version')!r}; this tsterm reads version {TRACE_VERSION}")
    steps = data.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ConfigError(f"trace {path}: 'steps' must be a non-empty list")
    if len(steps) < 2:
        raise ConfigError(f"trace {path}: one step only; a replay measures reuse, which starts at step 2")
    full = 0  # prompt + reply of the previous step
    for i, step in enumerate(steps):
        where = f"trace {path}: steps[{i}]"
        if not isinstance(step, dict):
            raise ConfigError(f"{where} must be an object")
        for key in ("prompt_tokens", "kept_tokens", "generated_tokens"):
            if type(step.get(key)) is not int or step[key] < 0:
                raise ConfigError(f"{where}.{key} must be a non-negative integer, got {step.get(key)!r}")
        if step["prompt_tokens"] < 1 or step["generated_tokens"] < 1:
            raise ConfigError(f"{where}: prompt_tokens and generated_tokens must be >= 1")
        if step["kept_tokens"] > min(full, step["prompt_tokens"] - 1):
            raise ConfigError(f"{where}.kept_tokens={step['kept_tokens']} is more than the previous step left "
                              f"({full}) or than its own prompt allows")
        latencies = step.get("tool_latency_s", [])
        if not isinstance(latencies, list) or not all(isinstance(x, (int, float)) and x >= 0 for x in latencies):
            raise ConfigError(f"{where}.tool_latency_s must be a list of non-negative seconds")
        full = step["prompt_tokens"] + step["generated_tokens"]
    return data


def agent_trace(data: dict[str, Any], vocab_size: int, sessions: int = 1, seed: int = 0,
                reserved: int = 16) -> Trace:
    """A recorded session's shape as `sessions` independent sessions of random ids (each step keeps what it kept,
    appends what it appended and generates as many tokens as it did)."""
    rng = random.Random(seed)
    trace: Trace = []
    for _ in range(sessions):
        turns, full = [], 0
        for step in data["steps"]:
            kept = step["kept_tokens"]
            new = [rng.randrange(reserved, vocab_size) for _ in range(step["prompt_tokens"] - kept)]
            turns.append(TraceTurn(new, step["generated_tokens"], None if kept == full else kept))
            full = step["prompt_tokens"] + step["generated_tokens"]
        trace.append(turns)
    return trace


def tool_seconds(data: dict[str, Any]) -> float:
    """The time a recorded session spent in its tools (reported next to a replay, not replayed)."""
    return float(sum(sum(step.get("tool_latency_s", [])) for step in data["steps"]))


def theoretical_cached(previous_full: list[int], prompt: list[int], unit: int = 1) -> int:
    """The most a prefix cache can serve for `prompt` after `previous_full` was computed, in whole `unit`s of
    tokens (1: any token, as tsterm's full blocks and partial last block serve them; a hybrid model's block size:
    it resumes only where a state snapshot was kept, at block boundaries).

    The previous turn's last sampled token was never fed to the model, and the prompt's last token is always
    computed (for its logits): the shareable prefix is the common prefix capped by both.
    """
    limit = min(len(previous_full) - 1, len(prompt) - 1)
    common = 0
    while common < limit and previous_full[common] == prompt[common]:
        common += 1
    return common // unit * unit

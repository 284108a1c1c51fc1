"""Synthetic multi-turn agent traces, shaped like TokenSpeed's agentic benchmark.

Every session starts with the same long system prompt + tool schemas and a task of its own; each later turn
appends a tool result / user message of a few hundred tokens; every reply has a fixed length. Token ids are
drawn deterministically from the vocabulary (no text: the trace measures the engine, not the tokenizer).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from tsterm.errors import ConfigError


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


def make_trace(spec: TraceSpec, vocab_size: int, reserved: int = 16) -> list[list[list[int]]]:
    """trace[session][turn] = the new (non-reply) tokens that turn appends to the conversation."""
    rng = random.Random(spec.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(reserved, vocab_size) for _ in range(n)]

    system = ids(spec.system_tokens)
    return [[system + ids(spec.task_tokens)] + [ids(spec.turn_tokens) for _ in range(spec.turns - 1)]
            for _ in range(spec.sessions)]


def theoretical_cached(previous_full: list[int], prompt: list[int], block_size: int) -> int:
    """Block-aligned maximum a prefix cache can serve for `prompt` after `previous_full` was computed.

    The previous turn's last sampled token was never fed to the model, and the prompt's last token is always
    computed (for its logits): the shareable prefix is the common prefix capped by both.
    """
    limit = min(len(previous_full) - 1, len(prompt) - 1)
    common = 0
    while common < limit and previous_full[common] == prompt[common]:
        common += 1
    return common // block_size * block_size

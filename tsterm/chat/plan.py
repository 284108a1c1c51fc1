"""A turn's prompt: the session's exact kept ids followed by the ids of the newly rendered tail.

The tail comes from rendering the whole conversation with the chat template; when that rendering does not start
with the kept ids (the template rewrote history, or generated ids re-tokenise differently) the turn is a miss: it
falls back to the full rendering and records where the two first differ (DESIGN.md rule 7).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptPlan:
    """The ids to send for a turn and how they relate to what the session kept."""

    token_ids: list[int]
    kept_tokens: int  # leading ids taken verbatim from the session's kept ids
    miss: bool = False  # the fresh rendering did not start with the kept ids
    diverged_at: int | None = None  # on a miss: first position where rendering and kept ids differ


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """First index where `a` and `b` differ, counting a shorter list ending early; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def plan_prompt(kept: list[int], rendered: list[int]) -> PromptPlan:
    """kept + the rendered tail when `rendered` starts with `kept`; otherwise the full rendering (a miss)."""
    if not kept:
        return PromptPlan(list(rendered), 0)
    if len(rendered) >= len(kept) and rendered[:len(kept)] == kept:
        return PromptPlan(list(kept) + list(rendered[len(kept):]), len(kept))
    return PromptPlan(list(rendered), 0, miss=True, diverged_at=first_divergence(kept, rendered))

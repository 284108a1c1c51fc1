"""A turn's prompt: the session's exact kept ids, then the tokens of the text that the new messages add.

The kept ids (the last prompt + its generated ids) are never re-tokenised: a model's own output does not always
tokenise back to the ids it generated, and comparing ids with a fresh tokenisation of the whole history loses
prefix reuse on a plain chat (DESIGN.md rule 7). So the conversation is rendered to *text*, and the text the kept ids
stand for is their decoding with special tokens kept (exact for byte-level BPE). When the rendering starts with it,
the prompt is the kept ids + the encoding of the rest. When it does not, the template changed text the ids stand for
(a new system prompt, Qwen3 dropping an earlier `<think>` block, a reply cut at a stop string): a miss. The longest
run of kept ids whose text still starts the rendering is kept, the rest is encoded, and the first position where
the prompt differs from the kept ids is reported.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT = "\ufffd"  # what a decode shows for a character whose bytes are split across the cut


class TextCodec(Protocol):
    """The two tokenizer calls a plan needs (tsterm's Tokenizer, or a transformers tokenizer)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class PromptPlan:
    """The ids to send for a turn and how they relate to what the session kept."""

    token_ids: list[int]
    kept_tokens: int  # leading ids taken verbatim from the session's kept ids
    miss: bool = False  # the rendering changed text that the kept ids stand for
    diverged_at: int | None = None  # on a miss: first position where the prompt and the kept ids differ
    # the history policy (history.py) that made these ids: "template" (the template's rendering, as above) or
    # "preserve" (the kept ids + the new messages' text); `fallback_reason` says why a "preserve" turn was planned as
    # "template" instead
    policy_applied: str = "template"
    fallback_reason: str | None = None
    # a fingerprint of what the template renders around the messages (tools, its own system block), which a session
    # keeps with the ids: `preserve` applies only while it is the same (history.render_context); "" when not taken
    context: str = ""


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where `a` and `b` differ, counting a shorter list ending early; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def plan_prompt(kept: Sequence[int], rendered: str, tokenizer: TextCodec) -> PromptPlan:
    """`kept` + the encoding of the text `rendered` adds after the kept ids' text; on a miss, the longest run of
    kept ids whose text starts `rendered`, then the encoding of the rest. Costs a few decodes per turn."""
    kept = list(kept)
    if not kept:
        return PromptPlan(_encode(tokenizer, rendered), 0)
    text = _decode(tokenizer, kept)
    if rendered.startswith(text):
        return PromptPlan(kept + _encode(tokenizer, rendered[len(text):]), len(kept))
    n = _longest_text_prefix(kept, rendered, tokenizer)
    token_ids = kept[:n] + _encode(tokenizer, rendered[len(_decode(tokenizer, kept[:n])):])
    same = first_divergence(kept, token_ids)
    if same is None or same == len(kept):  # every kept id survives (only a split character decoded differently)
        return PromptPlan(token_ids, len(kept))
    return PromptPlan(token_ids, same, miss=True, diverged_at=same)


def _longest_text_prefix(kept: list[int], rendered: str, tokenizer: TextCodec) -> int:
    """The largest n whose `decode(kept[:n])` starts `rendered`. Binary search on the decoded text without a trailing
    split character (that test only fails past the divergence), then back to a cut between whole characters."""
    lo, hi = 0, len(kept)  # the test holds at lo (empty text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if rendered.startswith(_decode(tokenizer, kept[:mid]).rstrip(REPLACEMENT)):
            lo = mid
        else:
            hi = mid - 1
    while lo and not rendered.startswith(_decode(tokenizer, kept[:lo])):
        lo -= 1
    return lo


def _encode(tokenizer: TextCodec, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _decode(tokenizer: TextCodec, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)

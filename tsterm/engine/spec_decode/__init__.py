"""Speculative decoding's draft sources: model-free proposers of the next tokens of a decoding sequence.

The engine verifies what a source drafts in one step (`Engine` / `Scheduler`: a verify is an extend of the sequence's
last token plus its drafts, with logits at each position) and keeps the longest run the target model agrees with, plus
one token of its own; so a source only changes speed, never the output. Every source has the same small interface
(`DraftSource`): `propose` (at most `max_tokens` draft ids for a sequence, from its token ids), `observe` (how many of
the last draft were accepted) and `release` (the sequence is gone). Their indexes are incremental: a step costs
O(tokens appended since the last call), never O(context).

- `ngram` (`NgramSource`): prompt lookup, the baseline transformers and llama.cpp ship: the last n tokens (longest n
  first) matched in the sequence's own prompt and output, the tokens after the most recent match drafted.
- `suffix` (`SuffixSource`): SuffixDecoding-style: a suffix automaton per sequence over its own tokens and a bounded,
  least-recently-used set of automata over recent outputs of all sequences; the longest match wins, and the draft
  length follows the match length and the sequence's running acceptance rate, falling to 0 on text that does not
  repeat.
- `mtp` (`MtpSource`): the checkpoint's multi-token-prediction head (`tsterm.model.mtp`), run by the executor after
  each step over the target's hidden states of the positions it computed, chained for K drafts.
"""
from __future__ import annotations

from tsterm.config import SPECULATIVE_METHODS
from tsterm.engine.spec_decode.base import DraftSource
from tsterm.engine.spec_decode.mtp import MtpSource
from tsterm.engine.spec_decode.ngram import NgramSource
from tsterm.engine.spec_decode.suffix import SuffixAutomaton, SuffixSource

METHODS = SPECULATIVE_METHODS


def make_draft_source(method: str, num_tokens: int) -> DraftSource | None:
    """The draft source a config names (None for "off"); `num_tokens`: the most it drafts a step."""
    if method == "off":
        return None
    if method == "ngram":
        return NgramSource(num_tokens)
    if method == "suffix":
        return SuffixSource(num_tokens)
    if method == "mtp":  # (the executor loads the head and runs it: `ModelRunner.mtp_forward`)
        return MtpSource(num_tokens)
    raise ValueError(f"speculative_method must be one of {', '.join(METHODS)}, got {method!r}")


__all__ = ["METHODS", "DraftSource", "MtpSource", "NgramSource", "SuffixAutomaton", "SuffixSource", "make_draft_source"]

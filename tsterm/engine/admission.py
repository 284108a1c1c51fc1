"""Admission: everything about a request that can be checked before it is queued, checked there.

A request that passes cannot fail later because of a field it carries (a seed the generator refuses, a token id past
the embedding, a prompt the context cannot hold); one that does not pass raises a RequestError (a ValueError) whose
message names the field, its value and the range it must be in, and whose `param` is the field (a server answers it
as a 400). Nothing of the request is registered before these checks pass.
"""
from __future__ import annotations

from dataclasses import dataclass

from tsterm.config import SamplingParams
from tsterm.engine.structured import Grammar, GrammarCompiler
from tsterm.errors import ConfigError, RequestError


@dataclass(frozen=True, slots=True)
class Limits:
    """What an engine can serve: its vocabulary (the embedding's rows), its context and how many sequences it runs."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int


def check_request(prompt_ids: list[int], params: SamplingParams, limits: Limits,
                  strict_max_tokens: bool = False) -> None:
    """Raise RequestError naming the first field of the request that `limits` cannot serve.

    strict_max_tokens: a `max_tokens` past the room the prompt leaves in the context is an error (the caller asked
    for that many); otherwise it is a cap, and the reply also ends where the context does (finish_reason "length")."""
    try:
        params.validate()  # again: a field may have been set since the params were made
    except ConfigError as e:
        raise RequestError(str(e), param=e.param) from None
    if not prompt_ids:
        raise RequestError("the prompt is empty", param="prompt")
    vocab = limits.vocab_size
    bad = [t for t in prompt_ids if type(t) is not int or not 0 <= t < vocab]  # noqa: E721 (bool is no id)
    if bad:
        raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab}) of integer ids",
                           param="prompt")
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise RequestError(f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})", param="stop_token_ids")
    bad = [t for t in params.logit_bias or () if t >= vocab]
    if bad:
        raise RequestError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="logit_bias")
    if len(prompt_ids) >= limits.max_model_len:
        raise RequestError(f"the prompt has {len(prompt_ids)} tokens but the context holds {limits.max_model_len} "
                           "(prompt + at least one generated token); shorten it or raise max_model_len / the KV budget",
                           param="prompt")
    if params.n > limits.max_num_seqs:
        raise RequestError(f"n={params.n} samples run at once, but the engine runs at most max_num_seqs="
                           f"{limits.max_num_seqs} sequences; lower n or raise max_num_seqs", param="n")
    if strict_max_tokens:
        check_reply_room(len(prompt_ids), params.max_tokens, limits.max_model_len)


def check_reply_room(num_prompt_tokens: int, max_tokens: int, max_model_len: int, name: str = "max_tokens") -> None:
    """A RequestError (about field `name`) when `max_tokens` generated tokens do not fit in the context after the
    prompt."""
    room = max_model_len - num_prompt_tokens
    if max_tokens > room:
        raise RequestError(f"{name} is {max_tokens} but the prompt has {num_prompt_tokens} tokens and the context "
                           f"holds {max_model_len}, so {name} must be in [1, {room}]; lower it or shorten the prompt",
                           param=name)


def compile_structured(params: SamplingParams, compiler: GrammarCompiler) -> Grammar | None:
    """The grammar of the request's `structured_outputs` (None when it has none), or a RequestError whose `param` is
    the field (structured_outputs.json, .regex, .grammar, ...) and whose message says what llguidance could not
    compile (an unknown type, an unsupported regex construct, an undefined rule). Call after `check_request`."""
    if params.structured_outputs is None:
        return None
    return compiler.compile(params.structured_outputs)

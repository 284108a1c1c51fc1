"""Small probes of a running LLM for tests: greedy continuations, the whole logits row after a prompt, and the
comparisons of two models built on them."""
from __future__ import annotations

import torch

from tsterm import LLM, SamplingParams


def greedy(llm: LLM, prompt: list[int], new_tokens: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))[0].token_ids


def last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The [V] float32 logits after `prompt` (one engine step; the request is aborted after it)."""
    engine = llm.engine
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    try:
        return engine.executor.execute(engine.scheduler.schedule())[0].float()
    finally:
        engine.abort(request_id)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| as a share of max |ref|."""
    return float((ours - ref).abs().max() / ref.abs().max())


def decisive_steps_agree(ours: LLM, ref: LLM, prompt: list[int], new_tokens: int, tol: float) -> int:
    """Teacher-forced along `ref`'s greedy tokens: at every step where ref's top two logits are more than
    2 tol max|logit| apart (no error of relative size tol can swap them), `ours` must pick ref's token. Returns how
    many steps were that decisive. (Random tiny models have many near ties, where either choice is right.)"""
    tokens, decisive = greedy(ref, prompt, new_tokens), 0
    for i, token in enumerate(tokens):
        logits = last_logits(ref, prompt + tokens[:i])
        top = logits.topk(2).values
        if top[0] - top[1] > 2 * tol * logits.abs().max():
            assert int(last_logits(ours, prompt + tokens[:i]).argmax()) == token, (prompt, i)
            decisive += 1
    return decisive

"""Small probes of a running LLM for tests: greedy continuations and the whole logits row after a prompt."""
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

"""Sampling parameters that together run every stage of the sampler."""
from __future__ import annotations

from tsterm import SamplingParams


def every_sampler_stage(max_tokens: int) -> list[SamplingParams]:
    """Greedy; top-p + top-k; min-p with a seed; repetition/presence/frequency penalties; logprobs; logit_bias."""
    return [
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, seed=11, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3,
                       max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.7, logprobs=3, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.9, logit_bias={5: 3.0, 7: -100.0}, seed=3, max_tokens=max_tokens,
                       ignore_eos=True),
    ]

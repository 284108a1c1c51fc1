"""The all-greedy fast path of the Sampler picks each row's first maximum, as logits.argmax(dim=-1) does, for rows
full of ties, NaN, +inf and -inf, at one and two threads (on the CPU it runs max(dim), which is faster)."""
from __future__ import annotations

import pytest
import torch

from tsterm.config import SamplingParams
from tsterm.engine.sampler import Sampler, SamplingRow

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _rows(gen: torch.Generator, batch: int, vocab: int, case: str) -> torch.Tensor:
    logits = torch.randint(-2, 3, (batch, vocab), generator=gen).float()  # few values: many tied maxima
    if case == "nan":
        logits[torch.rand(batch, vocab, generator=gen) < 0.02] = float("nan")
    elif case == "inf":
        logits[torch.rand(batch, vocab, generator=gen) < 0.2] = float("inf")
    elif case == "-inf":
        logits[:] = float("-inf")
    return logits


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["ties", "nan", "inf", "-inf"])
def test_greedy_rows_take_the_first_maximum(case, threads):
    gen = torch.Generator().manual_seed(len(case) * 10 + threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for batch, vocab in [(1, 49152), (3, 1000), (4, 70001), (2, 1)]:
            logits = _rows(gen, batch, vocab, case)
            sampler = Sampler()
            out = sampler(logits, [SamplingRow(GREEDY, None, None, None) for _ in range(batch)])
            assert sampler.last_stages == ("argmax",)
            assert out.token_ids == logits.argmax(dim=-1).tolist(), (batch, vocab)
    finally:
        torch.set_num_threads(before)

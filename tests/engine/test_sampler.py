"""Sampler: greedy limits, distribution, truncation, penalties against references, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tsterm.config import SamplingParams
from tsterm.engine import sampler as sampler_module
from tsterm.engine.sampler import PenaltyState, Sampler, SamplerOutput, SamplingRow, has_penalty, seeded_generator

V = 50


def row_for(params: SamplingParams, prompt=(), output=(), generator=None, vocab_size: int = V) -> SamplingRow:
    """A row for a sequence of these ids, its penalty state built from them as the engine does at the first step."""
    return SamplingRow(params, PenaltyState.from_ids(params, list(prompt), list(output), vocab_size), generator)


def rows_for(params: SamplingParams | list[SamplingParams], batch: int = 1, prompt=(), output=()) -> list[SamplingRow]:
    plist = params if isinstance(params, list) else [params] * batch
    return [row_for(p, prompt, output) for p in plist]


@pytest.fixture
def logits() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(6, V, generator=gen) * 3  # [B, V]


def test_greedy_is_argmax(logits):
    out = Sampler()(logits, rows_for(SamplingParams(temperature=0), len(logits)))
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * len(logits)


def test_greedy_ties_take_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert Sampler()(logits, rows_for(SamplingParams(temperature=0))).token_ids == [1]
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert Sampler()(logits.expand(64, 4), rows_for(top1, 64)).token_ids == [1] * 64


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-4),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.5, top_p=1e-6),
    SamplingParams(temperature=2.0, min_p=1.0),
], ids=["temperature->0", "top_k=1", "top_p tiny", "min_p=1"])
def test_limits_equal_greedy(logits, params):
    logits = logits.clone()
    logits[torch.arange(len(logits)), logits.argmax(-1)] += 0.1  # a clear winner for the 1e-4 limit
    sampler = Sampler(seed=3)
    for _ in range(20):
        assert sampler(logits, rows_for(params, len(logits))).token_ids == logits.argmax(-1).tolist()


def _chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    support = expected > 0
    assert observed[~support].sum() == 0, "sampled a token of probability 0"
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    n = 20000
    out = Sampler(seed=11)(logits.expand(n, 8), rows_for(SamplingParams(temperature=temperature), n))
    # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4; the seed is fixed, so this is deterministic anyway
    assert _chi_square(out.token_ids, torch.softmax(logits / temperature, -1)) < 30


def test_top_k_distribution_is_renormalised():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    n = 20000
    out = Sampler(seed=5)(logits.expand(n, 8), rows_for(SamplingParams(temperature=1.0, top_k=3), n))
    kept = torch.full_like(logits, -math.inf)
    kept[[4, 7, 0]] = logits[[4, 7, 0]]
    assert _chi_square(out.token_ids, torch.softmax(kept, -1)) < 30


def _surely_excluded(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens the filters exclude with a margin (float64 reference; boundary cases are left out)."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: (-scaled[i], i))
    k = top_k if top_k > 0 else len(scaled)
    excluded = set(order[k:])
    top = order[:k]
    peak = max(scaled)
    total = sum(math.exp(scaled[i] - peak) for i in top)
    mass_before = 0.0
    for i in top:
        if top_p < 1.0 and mass_before > top_p + 1e-4:
            excluded.add(i)
        mass_before += math.exp(scaled[i] - peak) / total
    for i in range(len(scaled)):
        if min_p > 0 and math.exp(scaled[i] - peak) < min_p * (1 - 1e-4):
            excluded.add(i)
    return excluded


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=2, max_size=40, unique=True),
    temperature=st.sampled_from([0.3, 1.0, 2.0]),
    top_k=st.integers(-1, 6),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_truncation_never_samples_excluded(logits, temperature, top_k, top_p, min_p, seed):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    batch = 64
    out = Sampler(seed=seed)(torch.tensor(logits).expand(batch, -1), rows_for(params, batch))
    excluded = _surely_excluded(logits, temperature, top_k, top_p, min_p)
    assert not excluded & set(out.token_ids)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=gen) * 4
    history = torch.randint(0, V, (3, 12), generator=gen)  # prompt + output, rectangular for HF
    penalties = [1.3, 0.7, 1.0]
    rows = [row_for(SamplingParams(repetition_penalty=p), ids[:8].tolist(), ids[8:].tolist())
            for p, ids in zip(penalties, history)]
    ours = Sampler().apply_penalties(logits, rows)
    for b, p in enumerate(penalties):
        reference = RepetitionPenaltyLogitsProcessor(penalty=p)(history[b:b + 1], logits[b:b + 1].clone())
        torch.testing.assert_close(ours[b:b + 1], reference)


def test_presence_frequency_match_hand_reference():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, V, generator=gen)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-1.0, frequency_penalty=1.5)]
    prompts = [[1, 2, 3, 3], [4, 4]]  # prompt tokens do not count for presence / frequency
    outputs = [[3, 3, 9, 9, 9, 10], [4, 7]]
    rows = [row_for(p, pr, o) for p, pr, o in zip(params, prompts, outputs)]
    ours = Sampler().apply_penalties(logits, rows)
    expected = logits.clone()
    for b, (p, out) in enumerate(zip(params, outputs)):
        for token in set(out):
            expected[b, token] -= out.count(token) * p.frequency_penalty + p.presence_penalty
    torch.testing.assert_close(ours, expected)


def test_a_penalty_state_holds_only_what_its_penalties_read():
    prompt, output = [1, 2, 2, 7], [7, 9, 9, 9]
    assert PenaltyState.from_ids(SamplingParams(), prompt, output, V) is None
    assert PenaltyState.from_ids(SamplingParams(temperature=0.7, top_p=0.9), prompt, output, V) is None
    repetition = PenaltyState.from_ids(SamplingParams(repetition_penalty=1.4), prompt, output, V)
    assert repetition.counts is None and repetition.seen.nonzero().flatten().tolist() == [1, 2, 7, 9]
    occurrence = PenaltyState.from_ids(SamplingParams(frequency_penalty=0.3), prompt, output, V)
    assert occurrence.seen is None and occurrence.counts[[7, 9, 1, 2]].tolist() == [1, 3, 0, 0]
    assert occurrence.counts.sum() == len(output)
    # a row carries its state, never the sequence's ids: the engine builds one every step
    assert set(SamplingRow.__slots__) == {"params", "penalty", "generator"}


def test_penalties_do_not_modify_input(logits):
    before = logits.clone()
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.0)
    Sampler()(logits, rows_for(params, len(logits), prompt=[1, 2], output=[3, 3]))
    assert torch.equal(logits, before)


def test_seeded_rows_independent_of_batch_and_position():
    gen = torch.Generator().manual_seed(9)
    steps = [torch.randn(4, V, generator=gen) for _ in range(6)]

    def run(position: int, others: list[SamplingParams], sampler_seed: int, my_seed: int = 1234) -> list[int]:
        sampler = Sampler(seed=sampler_seed)
        seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=my_seed)
        mine = SamplingRow(seeded, None, seeded_generator(my_seed))
        tokens = []
        for step_logits in steps:
            rows = [SamplingRow(p, None, seeded_generator(p.seed) if p.seed is not None else None) for p in others]
            rows.insert(position, mine)
            batch = torch.cat([step_logits[1:1 + len(others)], step_logits[:1]])  # others first
            batch = torch.cat([batch[:position], batch[-1:], batch[position:-1]])  # mine at `position`
            tokens.append(sampler(batch, rows).token_ids[position])
        return tokens

    alone = run(0, [], 0)
    assert run(2, [SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(seed=7)], 1) == alone
    assert run(1, [SamplingParams(temperature=0.5, top_k=3), SamplingParams(seed=99)], 42) == alone
    # a different seed gives a different stream (overwhelmingly likely over 6 draws)
    assert run(0, [], 0, my_seed=4321) != alone


def test_unseeded_rows_follow_sampler_seed(logits):
    params = SamplingParams(temperature=1.0)
    first = Sampler(seed=4)(logits, rows_for(params, len(logits))).token_ids
    assert Sampler(seed=4)(logits, rows_for(params, len(logits))).token_ids == first


def test_logprobs_are_of_penalised_logits_before_temperature(logits):
    params = [SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=1.4, presence_penalty=0.3),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=2.0, top_k=4, logprobs=20, frequency_penalty=0.7)]
    rows = [row_for(p, [1, 2, 3], [4, 4, 5]) for p in params]
    sampler = Sampler(seed=8)
    expected = sampler.apply_penalties(logits[:4], rows).log_softmax(-1)
    out = sampler(logits[:4], rows)  # (this adds the sampled tokens to the rows' states: `expected` came before)
    assert out.logprobs[2] is None
    for b in (0, 1, 3):
        entry = out.logprobs[b]
        assert entry["token_id"] == out.token_ids[b]
        assert entry["logprob"] == pytest.approx(expected[b, out.token_ids[b]].item(), abs=1e-5)
        assert len(entry["top"]) == params[b].logprobs
        values = [lp for _, lp in entry["top"]]
        assert values == sorted(values, reverse=True)
        for token, lp in entry["top"]:
            assert lp == pytest.approx(expected[b, token].item(), abs=1e-5)
        if entry["top"]:
            assert entry["top"][0][0] == expected[b].argmax().item()
    assert out.token_ids[1] == expected[1].argmax().item()  # greedy reads the penalised logits


def test_mixed_batch_greedy_rows_stay_argmax(logits):
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    for seed in range(5):
        out = Sampler(seed=seed)(logits, rows_for(params))
        assert out.token_ids[0::2] == logits[0::2].argmax(-1).tolist()


def test_fast_path_builds_no_penalty_tensors(logits, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("penalty tensors built on the all-greedy path")

    monkeypatch.setattr(sampler_module, "_stack", fail)
    sampler = Sampler()
    out = sampler(logits, rows_for(SamplingParams(temperature=0), len(logits), prompt=[1, 2], output=[3]))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert sampler.last_stages == ("argmax",)
    sampler(logits, rows_for(SamplingParams(temperature=1.0, top_k=5), len(logits), prompt=[1], output=[2]))
    assert sampler.last_stages == ("sample",)


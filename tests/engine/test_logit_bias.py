"""logit_bias (OpenAI's): checked with the other fields, added to the logits before the penalties and the temperature,
in one scatter for the whole batch that reads nothing back on the host."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tsterm.config import SamplingParams
from tsterm.engine.admission import Limits, check_request
from tsterm.engine.sampler import PenaltyState, Sampler, SamplingRow
from tsterm.errors import ConfigError, RequestError

V = 50


def row(params: SamplingParams, output=()) -> SamplingRow:
    return SamplingRow(params, PenaltyState.from_ids(params, [1, 2], list(output), V))


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 3  # [B, V]


def reference(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> torch.Tensor:
    """From scratch: a dense bias per row added to the raw logits, then the penalties as OpenAI states them
    (presence / frequency over the output tokens)."""
    scores = logits.clone()
    for b, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            scores[b, token] += bias
        for token in set(outputs[b]):
            count = outputs[b].count(token)
            scores[b, token] -= count * p.frequency_penalty + p.presence_penalty
    return scores


def test_a_batch_with_biased_and_free_rows_equals_the_reference(logits):
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={best[0]: -100.0}, logprobs=3),  # the greedy token banned
              SamplingParams(temperature=0, logprobs=3),  # free, in the same batch
              SamplingParams(temperature=0, logit_bias={7: 2.5, 9: -1.0}, presence_penalty=0.5,
                             frequency_penalty=0.25, logprobs=3),
              SamplingParams(temperature=0, logit_bias={11: 100.0}, logprobs=3)]  # forced
    outputs = [[], [], [7, 7, 9], []]
    before = logits.clone()
    out = Sampler()(logits, [row(p, o) for p, o in zip(params, outputs)])
    expected = reference(logits, params, outputs)
    assert torch.equal(logits, before)  # the input is not modified
    assert out.token_ids == expected.argmax(-1).tolist()
    assert out.token_ids[0] == logits[0].sort(descending=True).indices[1].item()  # the runner-up
    assert out.token_ids[1] == best[1] and out.token_ids[3] == 11
    log_softmax = expected.log_softmax(-1)
    for b, entry in enumerate(out.logprobs):
        assert entry["logprob"] == pytest.approx(log_softmax[b, out.token_ids[b]].item(), abs=1e-5)
        assert [t for t, _ in entry["top"]] == log_softmax[b].topk(3).indices.tolist()


def test_a_plus_100_bias_forces_a_sampled_token_whatever_the_temperature(logits):
    params = SamplingParams(temperature=1.5, top_p=0.9, logit_bias={int(logits[0].argmin()): 100.0})
    sampler = Sampler(seed=5)
    for _ in range(20):
        assert sampler(logits[:1], [row(params)]).token_ids == [int(logits[0].argmin())]


class HostReads(TorchDispatchMode):
    """Every op that reads a tensor's value on the host (on a GPU each waits for the device)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
             torch.ops.aten.is_nonzero.default, torch.ops.aten.nonzero.default, torch.ops.aten.equal.default}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_bias_stage_reads_nothing_back(logits):
    with HostReads() as probe:
        torch.tensor(1.0).item()
    assert probe.seen  # the probe sees a host read
    sampler = Sampler()
    params = [SamplingParams(temperature=0, logit_bias={3: 5.0}), SamplingParams(temperature=0),
              SamplingParams(temperature=0.7, logit_bias={4: -3.0, 5: 1.0}), SamplingParams(temperature=0)]
    with HostReads() as probe:
        sampler(logits, [row(p) for p in params])
    assert probe.seen == [] and "logit_bias" in sampler.last_stages


def test_a_batch_without_a_bias_skips_the_stage(logits):
    sampler = Sampler()
    sampler(logits, [row(SamplingParams(temperature=0, logit_bias={})) for _ in logits])
    assert sampler.last_stages == ("argmax",)


@pytest.mark.parametrize("bias, fragment", [
    ({1: 100.5}, "logit_bias[1] must be a number in [-100, 100]"),
    ({1: float("nan")}, "logit_bias[1] must be a number"),
    ({-1: 1.0}, "keys must be token ids"),
    ({"1": 1.0}, "keys must be token ids"),
    ({i: 1.0 for i in range(301)}, "301 entries; at most 300"),
    ([1, 2], "must be None or a dict"),
])
def test_bad_biases_name_the_field(bias, fragment):
    with pytest.raises(ConfigError) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.param == "logit_bias" and fragment in str(err.value)


def test_admission_checks_the_ids_against_the_vocabulary():
    limits = Limits(vocab_size=V, max_model_len=64, max_num_seqs=4)
    check_request([1, 2], SamplingParams(logit_bias={V - 1: 1.0}), limits)
    with pytest.raises(RequestError) as err:
        check_request([1, 2], SamplingParams(logit_bias={V: 1.0}), limits)
    assert err.value.param == "logit_bias" and f"token id {V} is outside the vocabulary [0, {V})" in str(err.value)

"""The cost-aware draft length (tsterm/engine/spec_decode/adaptive.py): the step-cost estimate, the acceptance
estimate scored on every proposed draft (verified or not), and in the engine: drafts that are never right stop being
verified at once, drafts that become right start being verified again, and greedy output never changes.

The engine tests give the engine a fixed cost model (no wall time: the suite runs on busy machines)."""
from __future__ import annotations

import random

import pytest

from tests.engine.test_spec_decode import Scripted, greedy, make_llm, run
from tests.helpers.checkpoints import make_checkpoint
from tsterm.engine.spec_decode.adaptive import DraftLength, StepCost


class FixedCost(StepCost):
    """A step of r rows costs 1 + slope * (r - 1) seconds, whatever the engine measures."""

    def __init__(self, slope: float):
        super().__init__()
        self.slope = slope

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def time(self, rows: int) -> float:
        return 1.0 + self.slope * (rows - 1)


# ---- the estimates ---------------------------------------------------------------------------------------------------

def test_step_cost_interpolates_measured_sizes_and_extrapolates_cautiously():
    cost = StepCost(weight=0.5, prior_row_cost=0.5)
    assert cost.time(1) is None
    cost.observe(1, 0.010)
    assert cost.time(1) == 0.010
    assert cost.time(3) == pytest.approx(0.010 + 2 * 0.5 * 0.010)  # (one measured size: the prior slope)
    cost.observe(5, 0.014)
    assert cost.time(3) == pytest.approx(0.012)  # (between measured sizes: linear)
    assert cost.time(7) == pytest.approx(0.014 + 2 * 0.5 * 0.014 / 5)  # (beyond: the prior, steeper than measured)
    cost.observe(5, 0.018)
    assert cost.time(5) == pytest.approx(0.016)  # (an average, not the last measurement)
    cost.observe(0, 1.0)
    cost.observe(2, float("nan"))
    assert sorted(cost.seconds) == [1, 5]


def test_draft_length_follows_acceptance_scored_on_unverified_drafts():
    policy = DraftLength()
    policy.cost = FixedCost(0.1)
    text = list(range(100, 160))
    # a draft that the text goes on to contradict, every step: its rate falls, and no draft is verified
    ids = text[:10]
    chosen = []
    for t in range(10, 30):
        chosen.append(policy.choose(1, ids, [7, 7, 7, 7], decoding=1))
        ids = text[:t + 1]
    assert chosen[-1] == [] and sum(map(len, chosen[-10:])) == 0 and policy.rate(1) < 0.1
    # the text starts matching its drafts: scored though none was verified, the rate rises and drafts come back
    for t in range(30, 50):
        chosen.append(policy.choose(1, ids, text[t:t + 4], decoding=1))
        ids = text[:t + 1]
    assert chosen[-1] == text[49:53] and policy.rate(1) > 0.8
    # a new sequence starts from what all sequences had (the prior), not from nothing
    assert 0.5 < policy.rate(2) < policy.rate(1)
    policy.release(1)
    assert policy.rate(1) == policy.rate(2)


def test_draft_length_weighs_the_verify_cost():
    """The same acceptance pays for a long draft where rows are cheap, a short one where they cost more, none where
    a row costs as much as a step; and more so in a batch, where the draft adds to the other sequences' step."""
    def length(slope: float, p_hits: int, decoding: int = 1) -> int:
        policy = DraftLength(decay=1.0)
        policy.cost = FixedCost(slope)
        ids = [1, 2, 3]
        for i in range(10):  # p_hits of 10 first positions right
            policy.choose(1, ids, [50 + i] if i < p_hits else [99], decoding)
            ids = ids + [50 + i]
        return len(policy.choose(1, ids, list(range(8)), decoding))

    assert length(0.02, 9) == 8
    assert 0 < length(0.3, 9) < 8
    assert length(1.0, 9) == 0
    assert length(0.2, 2) == 0 and length(0.02, 2) < length(0.02, 9)
    assert length(0.3, 9, decoding=8) < length(0.3, 9, decoding=1)


# ---- in the engine ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("adaptive") / "moe", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return str(path)


def test_wrong_drafts_stop_being_verified_and_right_ones_come_back(moe):
    """Drafts of each reply wrong at their first token for its first 20 tokens, right after: the engine verifies a
    few at the start (the prior), none while they stay wrong, and verifies again once they are right (scored in the
    shadow meanwhile); the replies equal the replies without drafts."""
    rng = random.Random(3)
    prompts = [[rng.randrange(8, 380) for _ in range(9)] for _ in range(3)]
    ref, _ = run(make_llm(moe), prompts, [greedy(60)] * 3)
    futures = {tuple(p): p + r for p, r in zip(prompts, ref)}
    lengths = {tuple(p): len(p) for p in prompts}

    class Turning(Scripted):
        def propose(self, seq_id, token_ids, max_tokens):
            self.wrong = (lambda rng: 0) if len(token_ids) - lengths[tuple(token_ids[:9])] < 20 else (lambda rng: None)
            return super().propose(seq_id, token_ids, max_tokens)

    llm = make_llm(moe, "ngram", 4)
    source = Turning(4, futures)
    llm.engine.drafter = source
    llm.engine.draft_length.cost = FixedCost(0.1)
    out, _ = run(llm, prompts, [greedy(60)] * 3)
    assert out == ref
    wrong_phase = [d for d, a in source.observed if a == 0]
    right_phase = [a for d, a in source.observed if a > 0]
    assert len(wrong_phase) <= 2 * 3  # (the first steps, on the prior, per request)
    assert sum(right_phase) > 60  # (verified again, and accepted, once right)
    assert llm.stats()["used"] == 0


def test_mtp_chains_only_as_far_as_the_measured_length_pays():
    """The MTP head's catch-up forward makes a first draft anyway; its chain of further drafts runs only as far as
    the draft length is worth verifying: none when a row costs a whole step, all K when rows are free."""
    from pathlib import Path

    from tsterm import LLM, SamplingParams

    demo = Path(__file__).resolve().parents[2] / "tsterm" / "models" / "moe_demo"
    prompts = [[5, 17, 33, 9, 250, 71, 12, 8]]

    def head_forwards(slope: float) -> tuple[int, int, list[int]]:
        llm = LLM(str(demo), dtype="float32", device="cpu", speculative_method="mtp", num_speculative_tokens=3)
        llm.engine.draft_length.cost = FixedCost(slope)
        runner, calls = llm.engine.executor, []
        forward = runner.mtp_forward
        runner.mtp_forward = lambda step, hidden: calls.append(len(step.sample_rows)) or forward(step, hidden)
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        chained = len(calls) - llm.engine.num_steps  # (each step's first head forward is its catch-up; the last
        # step's sequence finished: it has none)
        return chained, llm.stats()["spec_num_drafts"], list(out[0].outputs[0].token_ids)

    costly_chained, costly_verifies, costly = head_forwards(1.0)
    cheap_chained, cheap_verifies, cheap = head_forwards(0.0)
    assert costly == cheap  # (what is verified never changes the tokens)
    assert costly_verifies == 0 and costly_chained <= 0  # at most one head forward a step: the catch-up
    assert cheap_verifies > 0 and cheap_chained > cheap_verifies  # the chains ran (K - 1 = 2 forwards a step)

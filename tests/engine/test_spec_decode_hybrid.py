"""Speculative decoding on the hybrids (Qwen3-Next, Qwen3.5: Gated DeltaNet layers with a recurrent state per
sequence): a verify step runs a sequence's last token and its drafts through the linear-attention layers one
position after the other, keeping the state after each in a slot of its own, and after acceptance the sequence's
state is the one at its last accepted token (its slot taken, nothing copied); the rejected drafts' slots go back.

Held to greedy without drafts, token for token, in mixed batches (plain, sampled, penalised, n = 2, prefill chunks)
with the real draft sources, and with scripted drafts wrong from every position; to the prefix cache (a later turn
resumes from the snapshots the verify steps left, as a fresh recompute answers); to the slot pool after 1,000 steps
of random accepts and rejects; to the copy ledger (`state_copy_bytes`); and through the Triton kernels.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from tsterm import LLM

from tests.engine.test_spec_decode import Scripted, greedy, mixed_batch, run
from tests.helpers.checkpoints import make_hybrid_checkpoint

BLOCK = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory) -> str:
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("spec_hybrid") / request.param, request.param)
    return str(path)


@pytest.fixture(scope="module")
def next_model(tmp_path_factory) -> str:
    """A two-layer Qwen3-Next (one Gated DeltaNet layer, one full attention): for the long runs."""
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("spec_hybrid") / "next", "qwen3_next",
                                     dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    return str(path)


def make_llm(path: str, method: str = "off", k: int = 4, **options) -> LLM:
    options = dict(dict(block_size=BLOCK, num_kv_blocks=512, max_num_batched_tokens=48), **options)
    llm = LLM(path, dtype="float32", device="cpu", speculative_method=method, num_speculative_tokens=k, **options)
    llm.engine.draft_length = None  # (every draft verified: no cut by measured step times, which would vary by run)
    return llm


def check_state_slots(llm: LLM) -> None:
    """Between steps: the pool is consistent, no verify step's draft slot is held any more, and every held state slot
    is a running sequence's (its state, its snapshot), a pending restore's or a cached block's snapshot: nothing else
    (no rejected draft's state) is left behind."""
    engine = llm.engine
    pool, scheduler = engine.kv.pool, engine.scheduler
    pool.check_invariants()
    seqs = list(scheduler.running) + list(scheduler.waiting)
    assert all(not engine.kv.draft_state_slots(seq) for seq in seqs)
    live = [slot for seq in scheduler.running for slot in (seq.state_slot, seq.snapshot_slot) if slot >= 0]
    assert len(live) == len(set(live))
    restores = {seq.state_restore for seq in seqs if seq.state_restore >= 0}
    attached = {block.snapshot for block in pool.blocks if block.snapshot is not None}
    held = {slot for slot in range(pool.num_state_slots) if pool.state_slot_refs(slot)}
    assert held == set(live) | restores | attached, (held, live, restores, attached)


@pytest.fixture(scope="module")
def reference(hybrid):
    """The mixed batch and its follow-up turns, greedy without drafts (the follow-ups without the prefix cache)."""
    prompts, params = mixed_batch()
    ref, ref_outs = run(make_llm(hybrid), prompts, params)
    rng = random.Random(9)
    follow = [prompts[i] + ref[i] + [rng.randrange(8, 380) for _ in range(5)] for i in (0, 1, 6, 7)]
    expect, _ = run(make_llm(hybrid, enable_prefix_caching=False), follow, [greedy(16)] * 4)
    return prompts, params, ref, ref_outs, follow, expect


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_with_drafts_equals_greedy_without(hybrid, reference, method):
    """The mixed batch twice on one engine (the second time `suffix` drafts from the first round's outputs, which it
    accepts), then follow-up turns of four of its requests that
    resume from the snapshots the verify steps left: every greedy reply equals the reference's, both samples of the
    n = 2 request too."""
    prompts, params, ref, ref_outs, follow, expect = reference
    llm = make_llm(hybrid, method)
    # per sequence that may run: its state, its snapshot, a restore, and one slot per draft
    assert llm.engine.executor.num_state_slots == llm.engine.config.max_num_seqs * (3 + 4)
    for _ in range(2):
        out, outs = run(llm, prompts, params)
        out[3] = None  # (the seeded sampled request: its own output with drafts)
        assert out == ref[:3] + [None] + ref[4:]
        assert [list(c.token_ids) for c in outs[4].outputs] == [list(c.token_ids) for c in ref_outs[4].outputs]
        # (to float32 rounding only: a hybrid's prompt split in other chunks, as drafts taking the step's budget split
        # it, runs the chunked rule over other chunks; the verified positions themselves are bit for bit the decode's,
        # `test_the_state_ends_at_the_last_accepted_token`)
        got, want = outs[6].outputs[0].logprobs, ref_outs[6].outputs[0].logprobs
        assert [lp["token_id"] for lp in got] == [lp["token_id"] for lp in want]
        assert torch.allclose(torch.tensor([lp["logprob"] for lp in got]), torch.tensor([lp["logprob"] for lp in want]),
                              atol=1e-5, rtol=0)
        check_state_slots(llm)
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    if method == "suffix":  # (the second round drafts the first round's replies)
        assert stats["spec_accepted_tokens"] > 20
    got, outs = run(llm, follow, [greedy(16)] * 4)
    assert got == expect
    assert all(o.num_cached_tokens >= len(p) // 2 for o, p in zip(outs, follow))
    assert llm.stats()["used"] == 0
    check_state_slots(llm)


class Counting(Scripted):
    """Scripted drafts that also count the verify steps whose accepted run ends on a block boundary: there the state
    after the run is both the sequence's live state and its snapshot's, the one state a verify step copies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lengths: dict[int, int] = {}
        self.boundary_ends = 0

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        draft = super().propose(seq_id, token_ids, max_tokens)
        if draft:
            self.lengths[seq_id] = len(token_ids)  # the tokens whose state the verify step starts after, + 1
        return draft

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        super().observe(seq_id, num_drafted, num_accepted)
        self.boundary_ends += (self.lengths.pop(seq_id) + num_accepted) % BLOCK == 0


def scripted(path: str, futures, k: int, wrong, **options) -> tuple[LLM, Counting]:
    llm = make_llm(path, "ngram", k, **options)
    source = Counting(k, futures, wrong)
    llm.engine.drafter = source  # (the scheduler asks the engine, which asks its drafter)
    return llm, source


def test_the_state_ends_at_the_last_accepted_token(hybrid):
    """Drafts of the reference, wrong from a random position (or not at all), k = 5 over blocks of 4: every accepted
    length, and runs ending anywhere in a block. The replies equal the reference's, their logprobs to float32
    rounding (a state one token off or a rejected draft's state kept would move them by far more: 1e-2 and up);
    each verify accepted what was right; the copy ledger holds one state per run that ended on a block boundary, and
    nothing for the others (the state and the snapshot at a boundary inside the run are taken by their slots).
    (Not bit for bit: the hybrid's CPU forward is not batch-invariant in the last bits, a request alone and in a
    batch differ there too; the verify's recurrent steps themselves are the decode's exactly, tests/kernels/
    test_gated_delta_out_of_place.py.)"""
    rng = random.Random(1)
    prompts = [[rng.randrange(8, 380) for _ in range(rng.randrange(5, 14))] for _ in range(4)]
    params = [greedy(40, logprobs=2)] * 4
    ref, ref_outs = run(make_llm(hybrid), prompts, params)
    futures = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm, source = scripted(hybrid, futures, 5, lambda r: r.choice([None, 0, 1, 2, 3, 4]))
    out, outs = run(llm, prompts, params)
    assert out == ref
    for got, want in zip(outs, ref_outs):
        assert torch.allclose(torch.tensor([lp["logprob"] for lp in got.outputs[0].logprobs]),
                              torch.tensor([lp["logprob"] for lp in want.outputs[0].logprobs]), atol=1e-5, rtol=0)
    assert source.observed == source.expected and len(source.observed) > 15
    assert {a for _, a in source.observed} == {0, 1, 2, 3, 4, 5}
    stats = llm.stats()
    assert source.boundary_ends > 0
    assert stats["state_copy_bytes"] == source.boundary_ends * llm.engine.executor.state_bytes_per_slot
    check_state_slots(llm)


def test_pool_and_state_slots_after_many_random_accepts_and_rejects(next_model):
    """1,000+ steps of scripted drafts wrong from random positions, over requests that share a prefix, in a pool
    small enough to preempt: after every step the blocks and the state slots are consistent and nothing is held but
    the running sequences' slots and the cached snapshots; every reply equals the reference; and a later turn of
    each from the cache (resuming from snapshots the verify steps kept) equals a recompute."""
    rng = random.Random(3)
    shared = [rng.randrange(8, 380) for _ in range(11)]
    prompts = [shared + [rng.randrange(8, 380) for _ in range(rng.randrange(1, 9))] for _ in range(10)]
    lengths = [rng.randrange(10, 50) for _ in prompts]
    ref, _ = run(make_llm(next_model), prompts, [greedy(n) for n in lengths])
    futures = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm, source = scripted(next_model, futures, 6, lambda r: r.choice([None, 0, 0, 1, 2, 3, 4, 5]),
                           num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=6)
    engine = llm.engine
    finals: dict[str, list[int]] = {}
    steps = 0
    while steps < 1000:
        ids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, lengths)]
        finished: list[str] = []  # this round's, in the order they finished
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
                    finished.append(out.request_id)
            check_state_slots(llm)
            steps += 1
        assert [finals[i][len(p):] for i, p in zip(ids, prompts)] == ref
    stats = llm.stats()
    assert stats["preemptions"] > 0 and stats["used"] == 0 and stats["state_snapshots"] > 0
    assert sum(a for _, a in source.observed) < sum(d for d, _ in source.observed)
    # the last to finish first: its snapshot is still cached (a prompt's blocks are evicted tail first, and the tail
    # block holds the snapshot), the others' may be gone by its turn
    follow = [finals[i] + [rng.randrange(8, 380) for _ in range(3)] for i in reversed(finished[-4:])]
    expect, _ = run(make_llm(next_model, enable_prefix_caching=False), follow, [greedy(10)] * 4)
    engine.drafter = None  # (plain decoding now: only what the cache holds is under test)
    engine.scheduler.proposer = None
    got, outs = zip(*(run(llm, [prompt], [greedy(10)]) for prompt in follow))
    assert [g[0] for g in got] == expect and outs[0][0].num_cached_tokens >= len(follow[0]) - 3 - BLOCK


def test_verify_steps_through_the_triton_kernels(tmp_path):
    """The Triton conv update and delta-rule step (interpreted) writing each position's state into its own slot: the
    same replies as the torch twins' plain decoding."""
    path, model = make_hybrid_checkpoint(tmp_path / "m", "qwen3_5_moe_text",
                                         dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    rng = random.Random(4)
    prompts = [[rng.randrange(8, 380) for _ in range(n)] for n in (9, 5)]
    params = [greedy(10, logprobs=1)] * 2
    ref, ref_outs = run(make_llm(str(path), num_kv_blocks=32), prompts, params)
    futures = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm, source = scripted(str(path), futures, 3, lambda r: r.choice([None, 0, 1, 2]), num_kv_blocks=32,
                           kernels="triton")
    assert llm.engine.executor.kernels == "triton"
    out, outs = run(llm, prompts, params)
    assert out == ref and source.observed == source.expected
    for got, want in zip(outs, ref_outs):  # (the two kernel sets agree to float32 rounding)
        assert torch.allclose(torch.tensor([lp["logprob"] for lp in got.outputs[0].logprobs]),
                              torch.tensor([lp["logprob"] for lp in want.outputs[0].logprobs]), atol=1e-4, rtol=0)
    assert sum(a for _, a in source.observed) > 0
    check_state_slots(llm)


def test_a_reply_that_stops_inside_an_accepted_run_leaves_no_slot(next_model):
    """A stop token among the accepted drafts ends the reply there; its verify step's slots all go back."""
    rng = random.Random(2)
    prompt = [rng.randrange(8, 380) for _ in range(10)]
    ref = run(make_llm(next_model), [prompt], [greedy(24)])[0][0]
    stop_at = next(i for i in range(3, 12) if ref[i] not in ref[:i])
    llm, source = scripted(next_model, {tuple(prompt): prompt + ref}, 8, lambda r: None)
    out = llm.generate([prompt], [greedy(24, stop_token_ids=[ref[stop_at]])])[0].outputs[0]
    assert list(out.token_ids) == ref[:stop_at + 1] and out.finish_reason == "stop"
    assert source.observed[0] == (8, 8)
    check_state_slots(llm)
    held = {slot for slot in range(llm.engine.kv.pool.num_state_slots) if llm.engine.kv.pool.state_slot_refs(slot)}
    assert held == {block.snapshot for block in llm.engine.kv.pool.blocks if block.snapshot is not None}



def test_several_ranks_refuse_speculation_on_a_hybrid(next_model):
    """A multi-rank executor's step does not carry the verify's per-position state slots to the other ranks yet:
    refused, naming the option, before any weight loads (a plain hybrid on several ranks is not refused here)."""
    from pathlib import Path
    from types import SimpleNamespace

    from tsterm.config import EngineConfig, ModelConfig
    from tsterm.engine.executor import ExecutorSpec
    from tsterm.engine.model_runner import ModelRunner
    from tsterm.errors import ConfigError
    from tsterm.model.parallel import ParallelLayout

    par = SimpleNamespace(layout=ParallelLayout(tp_size=2))
    config = EngineConfig(next_model, speculative_method="suffix", num_speculative_tokens=3, device="cpu")
    spec = ExecutorSpec(config, ModelConfig.from_dir(Path(next_model)), Path(next_model), torch.float32,
                        torch.device("cpu"))
    with pytest.raises(ConfigError, match="hybrid model runs in one process") as error:
        ModelRunner(spec, par)
    assert error.value.param == "speculative_method"


def test_a_verify_steps_plan_chains_each_position_from_the_previous_ones_slot():
    """The recurrent plan of a step with two verify sequences (3 and 2 positions) beside a decode and a prompt chunk:
    the verify rows go position by position (`waves`), each reading the slot the position before wrote (the first
    its sequence's own) and writing the slot its state is kept in; the decode and the prompt are planned as ever."""
    from tsterm_kernels.metadata import plan_recurrent_step

    # seq 0: decode at 9 (slot 4); seq 1: verify of 3 rows at 12.. (slot 1, drafts' slots 7, 8); seq 2: a 3-token
    # prompt chunk at 5.. (slot 2); seq 3: verify of 2 rows at 6.. (slot 3, draft slot 9)
    shape, values = plan_recurrent_step([0, 1, 4, 7, 9], [10, 15, 8, 8], [4, 1, 2, 3], None,
                                        [-1, 1, 7, 8, -1, -1, -1, 3, 9])
    assert shape.waves == (2, 2, 1) and not shape.every_decode
    offsets = shape.offsets()
    got = {name: values[start:start + size] for name, (start, size) in offsets.items() if size}
    assert got == dict(decode_slots=[4], decode_rows=[0], prefill_slots=[2], prefill_bounds=[4, 7],
                       verify_rows=[1, 7, 2, 8, 3], verify_src=[1, 3, 1, 3, 7], verify_dst=[1, 3, 7, 9, 8])

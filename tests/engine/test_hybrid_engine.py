"""A hybrid model (linear-attention layers with per-sequence state) through the engine: each running sequence holds
a state slot and a snapshot slot, given back when it finishes or is preempted (the snapshot stays with the block it
ends at, for reuse); a later turn resumes from that snapshot and its cached prefix, with the same tokens as a fresh
engine; the slots' bytes come off the KV budget; n > 1 forks the state; prompts that share only a start resume
from the snapshots a sequence leaves every state_snapshot_interval tokens."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.metrics import scrape
from tsterm import LLM, SamplingParams
from tsterm.errors import RequestError

from tests.helpers.checkpoints import make_hybrid_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound


@pytest.fixture(scope="module")
def hybrid_and_oracle(tmp_path_factory):
    path, model = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid") / "m", "qwen3_next")
    return str(path), model


@pytest.fixture(scope="module")
def hybrid(hybrid_and_oracle):
    return hybrid_and_oracle[0]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (5 + 3 * i,), generator=gen).tolist() for i in range(n)]


def alone(model: str, prompt: list[int]) -> list[int]:
    """What a fresh engine without prefix caching answers."""
    return LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
               enable_prefix_caching=False).generate([prompt], GREEDY)[0].token_ids


def test_each_running_sequence_holds_its_own_slot_and_gives_it_back(hybrid):
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=2)
    engine = llm.engine
    assert engine.executor.num_state_slots == 6  # per running sequence: its state and its snapshot; + 2 kept
    ps = prompts(3)
    for p in ps:
        engine.add_request(p, GREEDY)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
        slots = [s for seq in engine.scheduler.running for s in (seq.state_slot, seq.snapshot_slot)]
        assert len(set(slots)) == len(slots) and all(0 <= s < 6 for s in slots)
        assert all(seq.state_slot == seq.snapshot_slot == -1 for seq in engine.scheduler.waiting)
        engine.kv.pool.check_invariants()
    assert engine.stats()["state_snapshots"] == 3  # each finished sequence's last block boundary, kept
    # the third prompt ran in a slot another sequence had used: it started from zeros all the same
    assert [outputs[f"req-{i}"] for i in range(3)] == [alone(hybrid, p) for p in ps]


def test_preempted_sequences_recompute_their_state(hybrid):
    # 9 blocks of 4 tokens for three sequences growing to 17-23 tokens: some are preempted and start over
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=9, block_size=4, max_num_seqs=3)
    ps = prompts(3, seed=1)
    outs = llm.generate(ps, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [alone(hybrid, p) for p in ps]


def test_each_turn_resumes_from_the_last_ones_snapshot(hybrid):
    """Turns 2 and 3 of a conversation take every full block of the previous turn from the cache (the block-aligned
    maximum) and its recurrent state from the snapshot kept at that block's end, and answer as a fresh engine."""
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4)
    conversation = prompts(1, seed=2)[0]
    for turn in range(3):
        out = llm.generate([conversation], GREEDY)[0]
        if turn:
            computed_before = len(previous) - 1  # the last sampled token of a turn is never computed
            assert out.num_cached_tokens == computed_before // 4 * 4
        assert out.token_ids == alone(hybrid, conversation), f"turn {turn + 1}"
        previous = conversation + out.token_ids
        conversation = previous + [11 + turn, 12, 13, 14, 15][:3 + turn]  # the user's next message
    stats = llm.stats()
    executor = llm.engine.executor
    assert stats["state_copy_bytes"] == 2 * executor.state_bytes // executor.num_state_slots  # two slots restored
    llm.engine.kv.pool.check_invariants()
    per_slot = executor.state_bytes // executor.num_state_slots
    assert stats["state_bytes"] == executor.state_bytes and stats["state_snapshots"] >= 1
    assert stats["state_snapshot_bytes"] > 0 and stats["state_snapshot_bytes"] % per_slot == 0  # whole slots copied
    exposition = scrape(llm.engine)  # the same counters for a scrape of /metrics
    assert exposition["tsterm:state_copy_bytes_total"] == stats["state_copy_bytes"]
    assert exposition["tsterm:state_pool_bytes"] == stats["state_bytes"]
    assert exposition["tsterm:state_snapshots"] == stats["state_snapshots"]
    assert exposition["tsterm:state_snapshot_bytes_total"] == stats["state_snapshot_bytes"]


def test_a_snapshot_taken_inside_a_prefill_chunk_resumes_right(hybrid):
    """A one-token answer: the turn's last block boundary (8) lies inside a prefill chunk (5..10), where the layer
    splits the chunk to keep the state."""
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=5)
    prompt = prompts(3, seed=4)[2]  # 11 tokens: chunks 0..5, 5..10, 10..11
    answer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].token_ids
    turn2 = prompt + answer + [21, 22, 23]
    with_logprobs = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    out = llm.generate([turn2], with_logprobs)[0]
    fresh = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
                enable_prefix_caching=False).generate([turn2], with_logprobs)[0]
    assert out.num_cached_tokens == 8 and out.token_ids == fresh.token_ids
    torch.testing.assert_close(torch.tensor([lp["logprob"] for lp in out.outputs[0].logprobs]),
                               torch.tensor([lp["logprob"] for lp in fresh.outputs[0].logprobs]), atol=1e-5, rtol=1e-4)


def test_snapshots_make_way_for_live_sequences(hybrid):
    """With every slot taken, a new sequence takes the least recently used snapshot's slot; its block stays cached
    but no longer resumes a hybrid prefix, which then starts over and still answers right."""
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=1)  # 3 slots
    # first: its state and snapshot slots, the snapshot kept (2 free); second: the 2 free ones (1 free); third: the
    # free one and first's snapshot's slot
    first, second, third = (p + llm.generate([p], GREEDY)[0].token_ids + [7] for p in prompts(3, seed=3))
    stats = llm.stats()
    assert stats["state_snapshot_evictions"] == 1 and stats["state_snapshots"] == 2
    resumed = llm.generate([third], GREEDY)[0]  # third's next turn: from its snapshot
    assert resumed.num_cached_tokens == (len(third) - 2) // 4 * 4 and resumed.token_ids == alone(hybrid, third)
    again = llm.generate([first], GREEDY)[0]  # first's next turn: its blocks are cached, its state is not
    assert again.num_cached_tokens == 0 and again.token_ids == alone(hybrid, first)
    llm.engine.kv.pool.check_invariants()


def test_a_pinned_conversation_keeps_its_snapshot(hybrid):
    """A pin (an agent waiting on a tool) protects its prefix's snapshot too: a live sequence that needs a slot
    takes an unpinned snapshot's, even a more recent one, and the pinned conversation resumes where it was."""
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=1)  # 3 slots
    first, second = (p + llm.generate([p], GREEDY)[0].token_ids + [7] for p in prompts(2, seed=11))
    llm.engine.pin(first[:-1])  # first is the least recently used snapshot; the third sequence needs one slot
    llm.generate([prompts(3, seed=11)[2]], GREEDY)
    stats = llm.stats()
    assert stats["state_snapshot_evictions"] == 1 and stats["state_snapshots"] == 2
    resumed = llm.generate([first], GREEDY)[0]
    assert resumed.num_cached_tokens == (len(first) - 2) // 4 * 4 and resumed.token_ids == alone(hybrid, first)
    llm.engine.kv.pool.check_invariants()


def test_several_samples_of_one_prompt_fork_the_state(hybrid_and_oracle):
    """n = 3: the prompt is computed once; each sample starts from a copy of its state (counted) and goes its own
    way. Each sample's logprobs are those transformers computes for its whole token sequence from scratch."""
    hybrid, oracle = hybrid_and_oracle
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=3)
    prompt = prompts(3, seed=6)[2]  # 11 tokens
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=10, ignore_eos=True, logprobs=0)
    out = llm.generate([prompt], params)[0]
    samples = [c.token_ids for c in out.outputs]
    assert len(samples) == 3 and len({tuple(t) for t in samples}) > 1, samples
    executor = llm.engine.executor
    stats = llm.stats()
    assert stats["prefill_tokens"] == len(prompt)  # the prompt once, not once per sample
    assert stats["state_copy_bytes"] == 2 * executor.state_bytes // executor.num_state_slots  # two forks
    for completion in out.outputs:
        ids = prompt + completion.token_ids
        with torch.no_grad():
            reference = torch.log_softmax(oracle(torch.tensor([ids])).logits[0].float(), dim=-1)
        expected = reference[len(prompt) - 1:-1].gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([lp["logprob"] for lp in completion.logprobs]), expected,
                                   atol=1e-4, rtol=1e-4)
    llm.engine.kv.pool.check_invariants()


@pytest.fixture(scope="module")
def long_hybrid(tmp_path_factory):
    """The tiny hybrid with positions for a 2,000-token prompt."""
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("long_hybrid") / "m", "qwen3_next",
                                     overrides={"max_position_embeddings": 4096})
    return str(path)


def test_forked_samples_start_from_the_fork_while_a_long_prompt_prefills(long_hybrid):
    """n = 4 seeded samples of a short prompt while a 2,000-token prompt is prefilled in chunks: decodes go first,
    the long prompt takes the rest of each 64-token budget, and samples 1..3 wait ~32 steps while sample 0 decodes on
    from the state they fork from (and interval snapshots take free slots). Each sample is token for token the one
    computed alone: a fresh engine, n = 1, seeded as sample i is (seed + i)."""
    gen = torch.Generator().manual_seed(12)
    short = torch.randint(0, 300, (20,), generator=gen).tolist()
    long = torch.randint(0, 300, (2000,), generator=gen).tolist()
    sampling = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    engine = LLM(long_hybrid, dtype="float32", device="cpu", num_kv_blocks=160, block_size=16, max_num_seqs=5,
                 max_num_batched_tokens=64, state_snapshot_interval=256).engine
    forked = engine.add_request(short, SamplingParams(n=4, seed=3, **sampling))
    engine.add_request(long, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine.step()  # the short prompt and the long one's first 44 tokens; the short one forks
    engine.step()
    parent, *children = [seq for seq in engine.scheduler.running if seq.request_id == forked]
    assert len(children) == 3 and all(seq.num_computed_tokens == len(short) for seq in children)
    assert parent.num_computed_tokens == len(short) + 1  # it advanced; they wait for the long prefill
    outputs = {}
    while engine.has_unfinished():
        outputs.update((out.request_id, out) for out in engine.step() if out.finished)
    assert engine.stats()["state_interval_snapshots"] > 0
    solo = LLM(long_hybrid, dtype="float32", device="cpu", num_kv_blocks=160, block_size=16,
               enable_prefix_caching=False)
    alone_samples = [solo.generate([short], SamplingParams(n=1, seed=3 + i, **sampling))[0].token_ids
                     for i in range(4)]
    assert [completion.token_ids for completion in outputs[forked].outputs] == alone_samples
    engine.kv.pool.check_invariants()
    assert engine.kv.pool.num_free_state_slots + engine.stats()["state_snapshots"] == engine.num_state_slots


def test_samples_wait_until_they_can_all_run(hybrid):
    """A prompt of n samples is admitted only when all n fit under max_num_seqs (each holds state slots); n above
    max_num_seqs is refused outright."""
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=3)
    engine = llm.engine
    with pytest.raises(RequestError, match=r"n=4 samples run at once, but .*max_num_seqs=3"):
        engine.add_request([1, 2, 3], SamplingParams(n=4))
    first, second = prompts(2, seed=7)
    engine.add_request(first, GREEDY)
    engine.add_request(second, SamplingParams(temperature=0, n=3, max_tokens=4, ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 1 and len(engine.scheduler.waiting) == 1  # 1 + 3 > 3: it waits
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
        assert len(engine.scheduler.running) <= 3
    assert outputs["req-1"] == [alone(hybrid, second)[:4]] * 3  # greedy: every sample is the one answer


def test_prompts_sharing_a_start_resume_from_an_interval_snapshot(hybrid):
    """With state_snapshot_interval 8 and prompt chunks of 10, a 22-token prompt keeps its states at 8 (chunk 0..10)
    and 16 (chunk 10..20: its last interval boundary, not its last block boundary 20), and leaves them behind; the
    chunks are not cut for it. A second prompt sharing only its first 17 tokens resumes at 16, and both answer as
    fresh engines."""
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, state_snapshot_interval=8,
              max_num_batched_tokens=10)
    engine = llm.engine
    gen = torch.Generator().manual_seed(8)
    shared = torch.randint(0, 300, (17,), generator=gen).tolist()
    first, second = shared + [5, 6, 7, 8, 9], shared + [10, 11, 12]
    engine.add_request(first, GREEDY)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps == 3 + GREEDY.max_tokens - 1  # prefill in 10 + 10 + 2: no chunk cut at an interval boundary
    assert engine.stats()["state_interval_snapshots"] == 2
    out = llm.generate([second], GREEDY)[0]
    assert out.num_cached_tokens == 16 and out.token_ids == alone(hybrid, second)
    assert llm.generate([first], GREEDY)[0].token_ids == alone(hybrid, first)
    engine.kv.pool.check_invariants()


def test_interval_snapshots_take_only_free_slots(hybrid):
    """With every spare slot kept by turn-end snapshots, a long prompt leaves no interval snapshot behind (it would
    have to evict one), and still answers right."""
    llm = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=1,
              state_snapshot_interval=8, max_num_batched_tokens=10)  # 3 slots
    engine = llm.engine
    short = prompts(1, seed=9)[0]  # 5 tokens + 12 generated: its turn-end snapshot kept, at 16 (none in a reply)
    llm.generate([short], GREEDY)
    assert engine.stats()["state_snapshots"] == 1 and engine.stats()["state_interval_snapshots"] == 0
    llm.generate([[3] + short], GREEDY)  # another kept: one slot is free, and the next sequence holds two
    before = engine.stats()
    assert before["state_snapshots"] == 2
    long = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(10)).tolist()
    out = llm.generate([long], GREEDY)[0]
    after = engine.stats()
    assert after["state_interval_snapshots"] == before["state_interval_snapshots"]
    assert out.token_ids == alone(hybrid, long)


def test_the_recurrent_state_traffic_per_decoded_token_does_not_grow_with_context(hybrid):
    """The copy audit labels the state's reads and writes `linear_state`: a fixed number of bytes per decoded
    token, whatever the context (the attention layers read their KV in place)."""
    engine = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4,
                 enable_prefix_caching=False).engine  # (no snapshots: every decode step moves the same bytes)
    assert engine.executor.num_state_slots == 64
    per_token = []
    for context in (6, 60):
        engine.add_request(list(range(1, context + 1)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.step()  # the prefill (and the first token)
        audit = engine.enable_copy_audit()  # from here on: decode steps only
        while engine.has_unfinished():
            engine.step()
        state_bytes = sum(n for (phase, _), n in audit.copy_bytes.items() if phase == "linear_state")
        per_token.append(state_bytes / audit.audited_tokens)
    # per linear layer: the conv state shifted by one in its slot; the delta-rule state, the largest, is updated
    # in place (never gathered out of its slot and scattered back)
    assert 0 < per_token[0] == per_token[1] < engine.executor.state_bytes_per_slot


def test_the_copy_audit_counts_the_snapshots_kept(hybrid):
    """The states kept at block boundaries are the audit's `state_snapshot` phase: each one read out of its slot and
    written into the snapshot slot, as many as the engine's state_snapshot_bytes counter says."""
    engine = LLM(hybrid, dtype="float32", device="cpu", num_kv_blocks=64, block_size=4).engine
    engine.add_request(list(range(1, 7)), SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    engine.step()  # the prefill: its boundary at 4
    before = engine.stats()["state_snapshot_bytes"]
    audit = engine.enable_copy_audit()
    while engine.has_unfinished():  # decode tokens completing blocks at 8 and 12
        engine.step()
    kept = engine.stats()["state_snapshot_bytes"] - before
    assert kept == 2 * engine.executor.state_bytes_per_slot
    assert sum(n for (phase, _), n in audit.copy_bytes.items() if phase == "state_snapshot") == 2 * kept

"""What a step sends the workers (gloo CPU ranks): a decode step's bytes on the control group depend on the batch, not
on how long the contexts are or how many blocks they hold (only a step that starts a new block sends its id), and
the workers' block-table mirrors, fed only each step's changes, equal rank 0's at every step of a run with
preemption, forks (n > 1) and requests finishing at different times; the tokens equal one process's."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.engine.sequence import SequenceStatus

from tests.helpers.checkpoints import make_checkpoint

BLOCK = 4
WORD = 8  # bytes: the control group carries int64 words
NEW_BLOCK_WORDS = 4  # [row, keep, count=1, block id]
OPTIONS = dict(dtype="float32", device="cpu", block_size=BLOCK, distributed_timeout_s=30)
TOKENS = 160


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("tables") / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2))
    return path


def test_a_decode_step_sends_the_same_bytes_at_any_context_length(checkpoint):
    llm = LLM(str(checkpoint), num_kv_blocks=96, tensor_parallel_size=2, **OPTIONS)
    executor = llm.engine.executor
    prompt_lens = [9, 14]
    sent = {}  # tokens out -> the bytes of the step that sampled them (both requests decode in the same steps)

    def record(out):
        sent.setdefault(len(out.token_ids), executor.last_step_bytes)

    try:
        outs = llm.generate([list(range(20, 20 + n)) for n in prompt_lens],
                            SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True), on_output=record)
        blocks_held = [len(table) for table in executor.block_tables().values()]
    finally:
        llm.engine.shutdown()
    assert all(len(out.token_ids) == TOKENS for out in outs)
    assert min(blocks_held) >= 10 * -(-max(prompt_lens) // BLOCK)  # the contexts grew tenfold in blocks
    # the step that samples token n (n >= 2) feeds token n-1 at position len + n - 2: a new block when that
    # position starts one. Take those block ids away and every decode step sent the same bytes.
    base = {sent[n] - WORD * NEW_BLOCK_WORDS * sum((length + n - 2) % BLOCK == 0 for length in prompt_lens)
            for n in range(2, TOKENS + 1)}
    assert len(base) == 1, sorted(base)
    assert sent[2] < sent[1]  # the prefill sent the prompts' whole tables


def check_tables(executor) -> set[int]:
    """Every worker's mirror equals rank 0's record, and rank 0's record is each running sequence's table (the
    blocks its computed context uses); the sequence ids recorded."""
    recorded = executor.block_tables()
    assert executor.worker_block_tables() == [recorded] * (executor.layout.world_size - 1)
    for seq, table in executor.tables.sent.values():
        if seq.status == SequenceStatus.RUNNING:
            assert table == seq.block_table[:-(-seq.num_computed_tokens // BLOCK)]
    return set(recorded)


def workload(llm: LLM, on_output=None):
    """8 prompts of 8 tokens (one of 10) in a pool too small for all (22 blocks of 4: some are preempted and
    recomputed), one request with n=2 (a fork, its partial last block copied on write), and lengths that finish
    requests at different steps."""
    prompts = [[(7 * i + j) % 300 + 1 for j in range(10 if i == 3 else 8)] for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i % 4 * 2, ignore_eos=True, logprobs=0,
                             n=2 if i == 3 else 1) for i in range(8)]
    outs = llm.generate(prompts, params, on_output=on_output)
    return outs, [(c.token_ids, [lp["logprob"] for lp in c.logprobs]) for out in outs for c in out.outputs]


def test_workers_tables_equal_rank0s_through_preemption_forks_and_finished_requests(checkpoint):
    _, want = workload(LLM(str(checkpoint), num_kv_blocks=22, **OPTIONS))
    llm = LLM(str(checkpoint), num_kv_blocks=22, tensor_parallel_size=2, **OPTIONS)
    executor = llm.engine.executor
    seen: set[int] = set()
    try:
        outs, got = workload(llm, on_output=lambda out: seen.update(check_tables(executor)))
        assert any(out.metrics.num_preemptions for out in outs)  # the pool was too small: some were preempted
        assert len(got) == 9 and executor.counters()["cow_bytes"] > 0  # the fork's samples, its copy-on-write
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        last = check_tables(executor)
    finally:
        llm.engine.shutdown()
    assert len(seen) >= 9  # every sequence of the run was in the mirrors at some step
    assert not seen & last  # and none is left once they finished
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4)

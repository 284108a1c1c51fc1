"""A hybrid model (Gated DeltaNet + gated attention) on expert-parallel gloo CPU ranks: each rank keeps every
sequence's recurrent state in its own state pool (the linear-attention layers are replicated), the engine on rank 0
hands out the slots for all of them, and the tokens and logprobs equal one process's. Tensor parallelism is refused
for these layers before any worker starts (not implemented yet)."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_hybrid_checkpoint

OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=40, distributed_timeout_s=30)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_parallel") / "m", "qwen3_next",
                                     dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    return str(path)


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([list(range(30, 43)), [7, 300, 12, 99, 5], [3]], params)
    return [(o.token_ids, [lp["logprob"] for lp in o.outputs[0].logprobs]) for o in outs]


def test_expert_parallel_hybrid_equals_one_process(hybrid):
    one = LLM(hybrid, **OPTIONS)
    want = run(one)
    llm = LLM(hybrid, expert_parallel_size=2, **OPTIONS)
    try:
        got = run(llm)
        stats, single = llm.stats(), one.stats()
    finally:
        llm.engine.shutdown()
    # every rank holds each slot of the replicated layers and keeps its snapshots: twice one process's bytes
    assert stats["state_bytes"] == 2 * single["state_bytes"] > 0
    assert stats["state_snapshot_bytes"] == 2 * single["state_snapshot_bytes"] > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4)


def test_tensor_parallel_hybrid_is_refused_before_starting_workers(hybrid):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: tensor parallelism does not split qwen3_next's "
                                          r"linear-attention and gated-attention layers yet; use expert_parallel_size"):
        LLM(hybrid, tensor_parallel_size=2, **OPTIONS)

"""The host tier on a GPU (`scripts/gpu_check.sh` runs this; skipped without CUDA): a block's copy out of the pool is
an asynchronous copy into pinned memory on the tier's copy stream, ordered after the kernel that wrote the block and
before any later kernel that overwrites it, with no host wait; reading it back gives the block's exact bytes. An
engine on the GPU with a small pool resumes an evicted session from host memory with the tokens of a pool that never
evicted it."""
from __future__ import annotations

import random

import pytest
import torch

from tsterm import LLM
from tsterm.config import SamplingParams
from tsterm.engine.block_pool import BlockPool
from tsterm.engine.kv_host import HostKVCache
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.kv_tier import KVTier
from tsterm.engine.sequence import Sequence

from tests.helpers.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
B = 16


def test_the_copy_out_is_ordered_between_the_write_and_a_later_overwrite_on_the_device():
    device = torch.device("cuda")
    L, H, D, N = 4, 8, 128, 32
    kv = torch.zeros((L, 2, N, B, H, D), dtype=torch.bfloat16, device=device)
    pool = BlockPool(N, B, fingerprint="gpu-host-test")
    tier = KVTier(None, kv, pool.root_hash, host=HostKVCache(N * kv[:, :, 0].numel() * 2))
    manager = KVCacheManager(pool, tier=tier)
    assert tier._copy_out(64, lambda flat: None)[0].is_pinned()
    tokens = list(range(100, 100 + 2 * B + 1))
    seq = Sequence(tokens, SamplingParams())
    manager.match_prefix(seq)
    manager.allocate_slots(seq, 2 * B)
    big = torch.randn((4096, 4096), device=device)
    expected = []
    for i, block_id in enumerate(seq.block_table[:2]):
        # the block's data comes out of a long kernel chain, still running when the copy out is queued
        value = (big @ big).sum() * 0 + i + 1
        kv[:, :, block_id] = value.to(torch.bfloat16) * torch.arange(L * 2 * B * H * D, device=device).view(
            L, 2, B, H, D).to(torch.bfloat16) % 7
        expected.append(kv[:, :, block_id].clone())
    seq.num_computed_tokens = 2 * B
    manager.commit(seq)  # the copies out: queued on the copy stream, no host wait
    for block_id in seq.block_table[:2]:
        kv[:, :, block_id].fill_(-1)  # a later kernel overwrites the blocks: it must wait for the copies
    manager.free(seq)
    taken = [pool.allocate() for _ in range(pool.num_free)]  # evicted from the pool
    for block_id in taken:
        pool.release(block_id)
    again = Sequence(tokens, SamplingParams())
    assert manager.match_prefix(again) == 2 * B
    assert tier.host_hit_blocks == 2
    for block_id, data in zip(again.block_table, expected):
        assert torch.equal(kv[:, :, block_id], data)


def test_an_engine_on_the_gpu_resumes_an_evicted_session_from_host_memory(tmp_path):
    path, _ = make_checkpoint(tmp_path / "qwen3moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2))
    options = dict(dtype="float32", device="cuda", block_size=4)
    reference = LLM(str(path), num_kv_blocks=128, **options)
    llm = LLM(str(path), num_kv_blocks=16, kv_host_bytes=1 << 22, **options)
    rng = random.Random(0)
    history = [rng.randrange(8, 300) for _ in range(22)]
    other = [rng.randrange(8, 300) for _ in range(60)]
    tail = [rng.randrange(8, 300) for _ in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    turns = {}
    for name, engine in (("reference", reference), ("tiered", llm)):  # the same calls: the same kernels' results
        first = engine.generate(history, greedy)[0]
        engine.generate(other, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        turns[name] = (first.token_ids, engine.generate(history + first.token_ids + tail, greedy)[0])
    assert turns["tiered"][0] == turns["reference"][0]
    out = turns["tiered"][1]
    assert out.token_ids == turns["reference"][1].token_ids
    resumed = len(history) + len(turns["tiered"][0]) - 1
    assert out.num_cached_tokens == resumed == llm.stats()["kv_host_hit_tokens"]

"""Cache salts (`Engine.add_request(..., cache_salt=)`, vLLM's name): prompts of different salts never share cached KV
blocks, full or partial; prompts of one salt do; unsalted prompts hash as they always did.

The engine tests run a tiny random checkpoint on the CPU; the others drive a KVCacheManager on a bare BlockPool.
"""
from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from tsterm import LLM, SamplingParams
from tsterm.engine.block_pool import BlockPool
from tsterm.engine.kv_manager import KVCacheManager
from tsterm.engine.sequence import Sequence
from tsterm.errors import RequestError

from tests.helpers.checkpoints import make_checkpoint

BLOCK = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("salt") / "qwen3moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2))
    return path


@pytest.fixture
def llm(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", device="cpu", block_size=BLOCK, num_kv_blocks=128)
    yield llm
    llm.engine.shutdown()


def greedy(n: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(llm: LLM, prompt: list[int], salt: str | None = None, params: SamplingParams | None = None):
    """One request to its end; its final output."""
    engine = llm.engine
    rid = engine.add_request(prompt, params or greedy(), cache_salt=salt)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                engine.kv.pool.check_invariants()
                return out


def prompt_ids(seed: int, n: int = 22) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8, 380) for _ in range(n)]


def test_a_salt_shares_blocks_only_with_its_own_salt(llm):
    system = prompt_ids(1, 16)  # four full blocks of a shared "system prompt"
    first = run(llm, system + prompt_ids(2, 6), salt="alice")
    assert first.num_cached_tokens == 0
    assert run(llm, system + prompt_ids(3, 6), salt="bob").num_cached_tokens == 0  # another salt: nothing
    assert run(llm, system + prompt_ids(4, 6)).num_cached_tokens == 0  # no salt reads no salted block
    assert run(llm, system + prompt_ids(5, 6), salt="alice").num_cached_tokens == 16  # its own: the system blocks
    assert run(llm, system + prompt_ids(6, 6), salt="bob").num_cached_tokens == 16
    assert run(llm, system + prompt_ids(7, 6)).num_cached_tokens == 16  # the unsalted chain, as before salts


def test_a_salted_prompt_reads_no_unsalted_block(llm):
    system = prompt_ids(8, 16)
    assert run(llm, system + prompt_ids(9, 6)).num_cached_tokens == 0
    assert run(llm, system + prompt_ids(10, 6)).num_cached_tokens == 16
    assert run(llm, system + prompt_ids(11, 6), salt="carol").num_cached_tokens == 0


def test_the_next_turn_continues_only_its_own_salts_partial_block(llm):
    """A finished request leaves its last, partly filled block cached for the prompt that goes on from it (the next
    turn): only a prompt of the same salt takes it."""
    prompt = prompt_ids(12, 10)  # 2 full blocks + 2 tokens: the reply fills the third block's rest partly
    out = run(llm, prompt, salt="dave", params=greedy(1))
    turn = prompt + out.outputs[0].token_ids + prompt_ids(13, 5)
    assert run(llm, turn, salt="erin").num_cached_tokens == 0
    assert run(llm, turn, salt="dave").num_cached_tokens == 10  # 2 full blocks + the partial block's 2 prompt tokens
    short = prompt_ids(17, 2)  # a first turn inside one block: its partial block is the first, after the salt's root
    out = run(llm, short, salt="dave", params=greedy(1))
    turn = short + out.outputs[0].token_ids + prompt_ids(18, 1)
    assert run(llm, turn, salt="erin").num_cached_tokens == 0
    assert run(llm, turn).num_cached_tokens == 0
    assert run(llm, turn, salt="dave").num_cached_tokens == 2


def test_a_salted_cache_hit_generates_what_a_fresh_prompt_does(llm):
    prompt = prompt_ids(14, 21)
    fresh = run(llm, prompt, params=greedy(6)).outputs[0].token_ids
    run(llm, prompt, salt="frank", params=greedy(6))
    again = run(llm, prompt, salt="frank", params=greedy(6))
    assert again.num_cached_tokens == 20
    assert again.outputs[0].token_ids == fresh


def test_every_sample_of_a_request_keeps_its_salt(llm):
    """n > 1: the samples fork from sample 0's blocks and commit their replies under the request's salt."""
    prompt = prompt_ids(15, 13)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True)
    out = run(llm, prompt, salt="grace", params=params)
    continued = prompt + out.outputs[2].token_ids  # sample 2's sequence: 21 tokens, 20 computed: five full blocks
    assert run(llm, continued + [9], salt="grace").num_cached_tokens == 20
    assert run(llm, continued + [9], salt="heidi").num_cached_tokens == 0


@pytest.mark.parametrize("salt", ["", 7, b"bytes"])
def test_a_salt_that_is_not_a_non_empty_string_is_refused(llm, salt):
    with pytest.raises(RequestError, match="cache_salt must be a non-empty string") as caught:
        llm.engine.add_request(prompt_ids(16), greedy(), cache_salt=salt)
    assert caught.value.param == "cache_salt"
    assert not llm.engine.requests


# ---- the KV manager: hashes and pins -----------------------------------------------------------------------------


def kv_manager() -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(32, BLOCK, fingerprint="test-model")
    return pool, KVCacheManager(pool)


def admit(kv: KVCacheManager, tokens: list[int], salt: str | None = None) -> tuple[Sequence, int]:
    """What the scheduler and the runner do: match the cached prefix, compute the rest, commit."""
    seq = Sequence(tokens, SamplingParams())
    if salt is not None:
        seq.cache_salt = salt  # what Request.create does
    hit = kv.match_prefix(seq)
    kv.allocate_slots(seq, seq.num_uncomputed_tokens)
    seq.num_computed_tokens = len(tokens)
    kv.commit(seq)
    return seq, hit


def test_unsalted_chain_hashes_are_those_before_salts():
    """The chain of an unsalted prompt, derived here from the hash's definition (blake2b-128 of the parent's 16
    bytes, the model fingerprint's for the first block, and the block's int64 token ids): bit for bit."""
    pool, kv = kv_manager()
    tokens = list(range(40, 52))
    seq, _ = admit(kv, tokens)
    parent = hashlib.blake2b(b"test-model", digest_size=16).digest()
    expected = []
    for i in range(3):
        parent = hashlib.blake2b(parent + array("q", tokens[i * BLOCK:(i + 1) * BLOCK]).tobytes(),
                                 digest_size=16).digest()
        expected.append(int.from_bytes(parent, "little"))
    assert [pool.blocks[b].block_hash for b in seq.block_table] == expected
    salted, _ = admit(kv, tokens, salt="x")
    assert not {pool.blocks[b].block_hash for b in salted.block_table} & set(expected)
    pool.check_invariants()


def test_a_preempted_salted_sequence_is_matched_under_its_salt():
    pool, kv = kv_manager()
    tokens = list(range(60, 73))
    seq, _ = admit(kv, tokens, salt="ivan")
    kv.free(seq)  # preempted: its blocks stay cached, and it is admitted again later
    assert kv.match_prefix(seq) == 12  # (the last token is always computed)
    other = Sequence(tokens, SamplingParams())
    other.cache_salt = "judy"
    assert kv.match_prefix(other) == 0
    pool.check_invariants()


def test_pins_find_a_salted_prefix_only_under_its_salt():
    pool, kv = kv_manager()
    tokens = list(range(80, 92))
    admit(kv, tokens, salt="kim")
    admit(kv, list(range(100, 108)))
    assert kv.pin("unsalted", tokens, expires_at=1e9) == (0, 0)
    assert kv.pin("other salt", tokens, expires_at=1e9, cache_salt="lee") == (0, 0)
    assert kv.pin("its salt", tokens, expires_at=1e9, cache_salt="kim") == (3, 3)
    assert kv.pin("an agent session", list(range(100, 108)), expires_at=1e9) == (2, 2)  # unsalted pins as before
    pool.check_invariants()


def test_a_hybrid_resumes_only_its_own_salts_state_snapshot(tmp_path):
    """A hybrid (linear-attention) model resumes a cached prefix from the state snapshot kept with its last block:
    found through the salted chain only."""
    from tests.helpers.checkpoints import make_hybrid_checkpoint

    path, _ = make_hybrid_checkpoint(tmp_path / "hybrid", "qwen3_next")
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=BLOCK)
    try:
        prompt = prompt_ids(19, 13)
        first = run(llm, prompt, salt="mallory", params=greedy(4))  # 16 computed: a snapshot at the 4th block's end
        turn = prompt + first.outputs[0].token_ids + prompt_ids(20, 3)
        fresh = run(llm, turn, salt="niaj", params=greedy(4))
        assert fresh.num_cached_tokens == 0
        assert run(llm, turn, params=greedy(4)).num_cached_tokens == 0
        again = run(llm, turn, salt="mallory", params=greedy(4))
        assert again.num_cached_tokens == 16
        assert again.outputs[0].token_ids == fresh.outputs[0].token_ids
    finally:
        llm.engine.shutdown()

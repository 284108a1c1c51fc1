"""Speculative decoding: one verify path, lossless for greedy requests, whatever the draft source.

A verify step feeds a decoding sequence's last token and its drafts as one extend; the engine keeps the longest run
the target's greedy tokens agree with plus one token of the target's own. These tests hold it to greedy without
drafts, token for token, in mixed batches (plain, sampled and penalised requests, prefill chunks) on every non-hybrid
family's checkpoint and on the default profile's quantized model; to stops, max_tokens and EOS inside an accepted
run; and to the pool: rejected drafts leave no block behind, and no unverified token reaches the prefix cache.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from tsterm import LLM, SamplingParams
from tsterm.config import EngineConfig
from tsterm.engine.spec_decode import DraftSource, NgramSource, SuffixAutomaton, SuffixSource
from tsterm.errors import ConfigError

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint

BLOCK = 4


# Every non-hybrid family, as its parity checkpoint in tests/model/test_parity.py has it (shared experts, clip_qkv,
# one KV head, attention biases), with 2 layers (the hybrids: tests/engine/test_hybrid_engine.py): its config overrides
# and the forms of a verify step its float32 CPU model runs: its positions as one-token rows on the decode stack, where
# the family has one (not OLMoE's q/k norm over the whole projection, GLM's and MiniMax's sigmoid routers and partial
# rotary), and as one extend.
BOTH = ("decode_rows", "extend")
FAMILIES = {
    "qwen3_moe": (dict(num_experts=5, num_experts_per_tok=2), BOTH),
    "qwen2_moe": (dict(num_experts=3, num_experts_per_tok=2, shared_expert_intermediate_size=24), BOTH),
    "mixtral": (dict(num_local_experts=3, num_experts_per_tok=2, num_key_value_heads=1), BOTH),
    "olmoe": (dict(num_experts=5, num_experts_per_tok=2, clip_qkv=4.0, head_dim=8), ("extend",)),
    "qwen3": (dict(), BOTH),
    "llama": (dict(attention_bias=True), BOTH),
    "glm4_moe": (dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
                      n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                      num_attention_heads=5, num_key_value_heads=1, partial_rotary_factor=0.5), ("extend",)),
    "minimax_m2": (dict(num_local_experts=6, num_experts_per_tok=2, num_attention_heads=3, num_key_value_heads=1,
                        rotary_dim=8), ("extend",)),
    "gpt_oss": (dict(num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5, num_key_value_heads=1,
                     sliding_window=3), ("extend",)),
    "deepseek_v3": (dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
                         n_shared_experts=1, num_attention_heads=5, num_key_value_heads=5, q_lora_rank=20,
                         kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10), ("extend",)),
    "kimi_k2": (dict(n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=3,
                     num_key_value_heads=3, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=12,
                     qk_rope_head_dim=8, v_head_dim=10), ("extend",)),
}
FORMS = [(family, form) for family, (_, forms) in FAMILIES.items() for form in forms]


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory):
    """The family named by the test's parameter (indirect)."""
    family = request.param
    path, _ = make_checkpoint(tmp_path_factory.mktemp("spec") / family, family,
                              dict(FAMILIES[family][0], num_hidden_layers=2))
    return str(path)


def test_every_non_hybrid_family_is_checked():
    """A family added to the registry without a checkpoint here would not be held to lossless speculation."""
    from tsterm.model.arch import ARCHITECTURES, LINEAR_ATTENTION

    assert {name for name, spec in ARCHITECTURES.items() if LINEAR_ATTENTION not in spec.mixers} == set(FAMILIES)


def make_llm(path: str, method: str = "off", k: int = 4, **options) -> LLM:
    options = dict(dict(block_size=BLOCK, num_kv_blocks=512, max_num_batched_tokens=48), **options)
    return LLM(path, dtype="float32", device="cpu", speculative_method=method, num_speculative_tokens=k, **options)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def mixed_batch(seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """8 requests: prompts that repeat (drafts from the prompt are accepted) and ones that do not, greedy ones with
    and without logprobs, n = 2, a seeded sampled one, penalised ones, prompts longer than the step's token budget
    (prefill chunks beside verify steps)."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(8):
        base = [rng.randrange(8, 380) for _ in range(rng.randrange(6, 18))]
        prompts.append(base * 4 if i % 2 == 0 else base)
        params.append(greedy(40 + i))
    params[3] = SamplingParams(temperature=0.9, seed=7, max_tokens=30, ignore_eos=True)  # (drafts too)
    # penalised ones: each verified position is penalised with the drafts before it counted
    params[5] = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=30, ignore_eos=True)
    params[2] = SamplingParams(temperature=0, frequency_penalty=0.4, presence_penalty=0.2, max_tokens=40,
                               ignore_eos=True)
    params[6] = greedy(35, logprobs=2)
    # (its samples fork after the prompt, then each verifies its own drafts)
    params[4] = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)
    return prompts, params


def run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    return [list(out.outputs[0].token_ids) for out in outs], outs


@pytest.mark.parametrize("checkpoint,form", FORMS, indirect=["checkpoint"], ids=[f"{f}-{form}" for f, form in FORMS])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_with_drafts_equals_greedy_without(checkpoint, method, form):
    """Both forms of a verify step: its positions as one-token rows (the CPU's decode stack runs them) and as one
    extend (the layer-by-layer path over the paged prefix). The seeded sampled request speculates too, and draws
    exactly what it draws without speculation."""
    prompts, params = mixed_batch()
    ref, ref_outs = run(make_llm(checkpoint), prompts, params)
    llm = make_llm(checkpoint, method)
    # (the float32 CPU model of a family with a decode stack runs both forms)
    assert llm.engine.executor.verify_as_decode_rows == ("decode_rows" in FAMILIES[Path(checkpoint).name][1])
    llm.engine.executor.verify_as_decode_rows = form == "decode_rows"
    # every proposed draft verified whole: the cost-aware cut (which only shortens drafts) would make what is verified
    # depend on the machine's timings
    llm.engine.draft_length = None
    out, outs = run(llm, prompts, params)
    again = make_llm(checkpoint, method)
    again.engine.executor.verify_as_decode_rows = form == "decode_rows"
    again.engine.draft_length = None
    assert run(again, prompts[3:4], params[3:4])[0] == out[3:4]  # a seeded request reproduces, in any batch
    assert out == ref  # the seeded sampled one too: its generator is rewound to its last kept row
    assert [list(c.token_ids) for c in outs[4].outputs] == [list(c.token_ids) for c in ref_outs[4].outputs]
    # logprobs at the verified positions are the decode's
    got, want = list(outs[6].outputs[0].logprobs), list(ref_outs[6].outputs[0].logprobs)
    assert got == want
    stats = llm.stats()
    # drafts were verified, some accepted and some rejected: both paths of acceptance ran
    assert stats["spec_num_drafts"] > 0
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["used"] == 0
    llm.engine.kv.pool.check_invariants()


@pytest.fixture(scope="module")
def default_model() -> tuple[str, dict]:
    """The shipped default profile's model (SmolLM2-135M-Instruct, its Q4_1 GGUF imported with its blocks kept) and
    engine options, read from the shipped file (a user's own `default` must not change the test)."""
    from tsterm.launch import engine_config
    from tsterm.profiles import SHIPPED_DIR, load_profile

    profile = load_profile(str(SHIPPED_DIR / "default.yaml"))
    return engine_config(profile).model, profile.engine_options()


def test_the_default_profiles_quantized_model_decodes_the_same_with_drafts(default_model):
    """The mixed batch of 8 on the model `tsterm` opens with, in a step budget that cuts its prompts into prefill
    chunks: each method's greedy replies (penalised, n = 2 and logprobs ones included) equal the replies without
    speculation, token for token."""
    path, options = default_model
    options = dict(options, device="cpu", max_num_batched_tokens=48, speculative_method="off")  # (the profile's: suffix)
    prompts, params = mixed_batch()
    plain = LLM(path, **options)
    assert plain.engine.model_config.quant_method == "gguf_blocks"  # (the quantized weights, as shipped)
    ref, ref_outs = run(plain, prompts, params)
    for method in ("ngram", "suffix"):
        llm = LLM(path, **dict(options, speculative_method=method, num_speculative_tokens=4))
        llm.engine.draft_length = None  # (drafts verified whole, whatever the step times)
        out, outs = run(llm, prompts, params)
        assert out == ref, method  # (the seeded sampled one too)
        assert [list(c.token_ids) for c in outs[4].outputs] == [list(c.token_ids) for c in ref_outs[4].outputs]
        assert list(outs[6].outputs[0].logprobs) == list(ref_outs[6].outputs[0].logprobs)
        stats = llm.stats()
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], method  # accepts and rejects ran
        assert stats["used"] == 0


# ---- a scripted draft source: drafts the reference continuation, wrong from a chosen position on ---------------------

class Scripted(DraftSource):
    """Drafts the tokens the target will produce (from `futures`: request's full greedy ids), with the draft token at
    offset `wrong(step)` changed (None: all right), so each verify accepts exactly that many."""

    name = "scripted"

    def __init__(self, num_tokens: int, futures: dict[tuple[int, ...], list[int]], wrong=lambda rng: None,
                 seed: int = 0):
        super().__init__(num_tokens)
        self.futures, self.wrong, self.rng = futures, wrong, random.Random(seed)
        self.expected: list[tuple[int, int]] = []  # (drafted, accepted by construction)
        self.observed: list[tuple[int, int]] = []

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        for prompt, full in self.futures.items():
            if tuple(token_ids[:len(prompt)]) == prompt and list(token_ids) == full[:len(token_ids)]:
                draft = full[len(token_ids):len(token_ids) + min(max_tokens, self.num_tokens)]
                if not draft:
                    return []
                bad = self.wrong(self.rng)
                if bad is not None and bad < len(draft):
                    draft = draft[:bad] + [(draft[bad] + 1) % 300 + 8] + draft[bad + 1:]
                    if draft[bad] == full[len(token_ids) + bad]:
                        draft[bad] += 1
                self.expected.append((len(draft), bad if bad is not None and bad < len(draft) else len(draft)))
                return draft
        return []

    def observe(self, seq_id: int, num_drafted: int, num_accepted: int) -> None:
        self.observed.append((num_drafted, num_accepted))


def scripted_llm(path: str, futures, k: int = 4, wrong=lambda rng: None, **options) -> tuple[LLM, Scripted]:
    llm = make_llm(path, "ngram", k, **options)
    source = Scripted(k, futures, wrong)
    llm.engine.drafter = source  # (the scheduler asks the engine, which asks its drafter)
    llm.engine.draft_length = None  # (each of its drafts verified whole: no cost-aware cut)
    return llm, source


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("spec") / "moe", "qwen3_moe",
                              dict(num_experts=5, num_experts_per_tok=2, num_hidden_layers=2))
    return str(path)


def test_accepts_exactly_the_agreeing_run_plus_one(moe):
    rng = random.Random(1)
    prompts = [[rng.randrange(8, 380) for _ in range(9)] for _ in range(3)]
    ref, _ = run(make_llm(moe), prompts, [greedy(30)] * 3)
    futures = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm, source = scripted_llm(moe, futures, k=4, wrong=lambda r: r.choice([None, 0, 1, 2, 3]))
    out, _ = run(llm, prompts, [greedy(30)] * 3)
    assert out == ref
    assert source.observed == source.expected and len(source.observed) > 10
    stats = llm.stats()
    assert stats["spec_accepted_tokens"] == sum(a for _, a in source.expected)
    assert stats["spec_draft_tokens"] == sum(d for d, _ in source.expected)
    # every step appends the accepted drafts plus one: the steps after the prompt are the tokens over (accepted + 1)
    assert stats["generated_tokens"] == 90


def test_penalised_requests_count_the_drafts_before_each_position(moe):
    """A verify step's position j is penalised with the request's history plus its first j drafts (repetition over
    the prompt and output, presence and frequency over the output), as decoding them one step each would be; the
    request's history after the step is what it appended. Drafts of the penalised reference, wrong from random
    positions: the replies equal the reference's."""
    rng = random.Random(8)
    prompts = [[rng.randrange(8, 380) for _ in range(7)] * 2 for _ in range(3)]
    params = [SamplingParams(temperature=0, repetition_penalty=1.6, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.5, max_tokens=30,
                             ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.8, max_tokens=30,
                             ignore_eos=True)]
    ref, _ = run(make_llm(moe), prompts, params)
    unpenalised, _ = run(make_llm(moe), prompts, [greedy(30)] * 3)
    assert ref != unpenalised  # (the penalties change these replies)
    futures = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm, source = scripted_llm(moe, futures, k=4, wrong=lambda r: r.choice([None, 1, 2, 3]))
    out, _ = run(llm, prompts, params)
    assert out == ref
    assert source.observed == source.expected and sum(a for _, a in source.observed) > 20


def test_seeded_sampled_requests_draw_what_they_draw_without_speculation(moe):
    """A seeded request's generator draws one row per verified position and is set back to its state after the last
    row it keeps: with drafts of its own reply, wrong from random positions (rejections at every offset), each
    seeded reply (n = 2, penalties, top-p) equals its reply without speculation, token for token."""
    rng = random.Random(5)
    prompts = [[rng.randrange(8, 380) for _ in range(8)] for _ in range(3)]
    params = [SamplingParams(temperature=1.0, seed=11, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=12, frequency_penalty=0.5, max_tokens=30,
                             ignore_eos=True),
              SamplingParams(temperature=1.2, seed=13, n=2, max_tokens=30, ignore_eos=True)]
    _, ref_outs = run(make_llm(moe), prompts, params)
    ref = [[list(c.token_ids) for c in out.outputs] for out in ref_outs]
    futures = {tuple(p): p + r[0] for p, r in zip(prompts, ref)}  # (drafts follow each request's first sample)
    llm, source = scripted_llm(moe, futures, k=4, wrong=lambda r: r.choice([None, 0, 1, 2, 3]))
    _, outs = run(llm, prompts, params)
    assert [[list(c.token_ids) for c in out.outputs] for out in outs] == ref
    assert sum(d - a for d, a in source.observed) > 10 and sum(a for _, a in source.observed) > 10  # both ran


def test_stops_inside_an_accepted_run_cut_there(moe):
    rng = random.Random(2)
    prompt = [rng.randrange(8, 380) for _ in range(10)]
    ref, ref_outs = run(make_llm(moe), [prompt], [greedy(24)])
    ref = ref[0]
    futures = {tuple(prompt): prompt + ref}
    tokenizer = make_llm(moe).engine.tokenizer

    # max_tokens in the middle of a fully accepted run: K = 4 drafts a step, 5 tokens a step, max_tokens 7
    llm, source = scripted_llm(moe, futures, k=4)
    out = llm.generate([prompt], [greedy(7)])[0].outputs[0]
    assert list(out.token_ids) == ref[:7] and out.finish_reason == "length"
    assert all(a == d for d, a in source.observed) and source.observed
    assert llm.stats()["used"] == 0

    # the end of the context: drafts never reach past it, and the reply ends there ("length")
    llm, source = scripted_llm(moe, futures, k=8, max_model_len=len(prompt) + 7)
    engine = llm.engine
    engine.add_request(prompt, greedy(100), request_id="ctx")
    while engine.has_unfinished():
        final = [out for out in engine.step() if out.finished] or None
    out = final[0].outputs[0]
    assert list(out.token_ids) == ref[:7] and out.finish_reason == "length"
    assert source.observed == [(5, 5)]  # (7 tokens in all: the prefill's, then 5 drafts + 1)
    assert llm.stats()["used"] == 0

    # a stop token inside an accepted run: the run ends at it
    stop_at = next(i for i in range(3, 12) if ref[i] not in ref[:i])
    llm, source = scripted_llm(moe, futures, k=8)
    out = llm.generate([prompt], [greedy(24, stop_token_ids=[ref[stop_at]])])[0].outputs[0]
    assert list(out.token_ids) == ref[:stop_at + 1] and out.finish_reason == "stop"
    assert source.observed[0] == (8, 8)  # the run it stopped in was accepted whole
    assert llm.stats()["used"] == 0

    # EOS inside an accepted run (ignore_eos off)
    llm, source = scripted_llm(moe, futures, k=8)
    llm.engine.eos_token_ids = {ref[stop_at]}
    out = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=24)])[0].outputs[0]
    assert list(out.token_ids) == ref[:stop_at + 1] and out.finish_reason == "stop"

    # a stop string inside an accepted run: the text is cut before it, the tokens end with the one completing it
    text = tokenizer.decode(ref)
    stop_text = next(tokenizer.decode(ref[:i + 1])[len(tokenizer.decode(ref[:i])):]
                     for i in range(3, 12) if len(tokenizer.decode(ref[:i + 1])) > len(tokenizer.decode(ref[:i])))
    cut = text.find(stop_text)
    plain = make_llm(moe).generate([prompt], [greedy(24, stop=[stop_text])])[0].outputs[0]
    llm, source = scripted_llm(moe, futures, k=8)
    out = llm.generate([prompt], [greedy(24, stop=[stop_text])])[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:cut] == plain.text
    assert list(out.token_ids) == list(plain.token_ids)
    assert len(out.token_ids) <= 10  # inside the first verify's run (the prefill's token, then 8 drafts + 1)
    assert llm.stats()["used"] == 0


def test_pool_invariants_after_many_random_accepts_and_rejects(moe):
    """1,000+ steps of random drafts, each wrong from a random position, over requests that share prefixes, in a pool
    small enough to preempt: after every step the pool is consistent; at the end no block is referenced, and every
    block in the prefix cache holds only verified tokens (its chain is a prefix of some request's final tokens); a
    later request continuing a finished one from the cache answers as a recompute does."""
    rng = random.Random(3)
    shared = [rng.randrange(8, 380) for _ in range(11)]
    prompts = [shared + [rng.randrange(8, 380) for _ in range(rng.randrange(1, 9))] for _ in range(12)]
    lengths = [rng.randrange(10, 60) for _ in prompts]
    ref, _ = run(make_llm(moe), prompts, [greedy(n) for n in lengths])
    futures = {tuple(p): p + r for p, r in zip(prompts, ref)}
    llm, source = scripted_llm(moe, futures, k=6, wrong=lambda r: r.choice([None, 0, 0, 1, 2, 3, 4, 5]),
                               num_kv_blocks=48, max_num_batched_tokens=24)
    engine, pool = llm.engine, llm.engine.kv.pool
    # what verified tokens the cache may hold: full blocks chained along a request's final tokens, and partly filled
    # blocks holding the tokens that follow such a chain
    verified: set[int] = set()
    starts: dict[int | None, list[list[int]]] = {}  # chain hash (None: the root) -> the tokens that follow it
    for tokens in futures.values():
        parent = None
        for i in range(len(tokens) // BLOCK + 1):
            starts.setdefault(parent, []).append(tokens[i * BLOCK:(i + 1) * BLOCK])
            parent = pool.hash_block(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
            verified.add(parent)
    finals: dict[str, list[int]] = {}
    steps = partials_seen = 0
    while steps < 1000:
        ids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, lengths)]
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
            pool.check_invariants()
            steps += 1
            held = {block for seq in engine.scheduler.running for block in seq.block_table}
            assert pool.stats()["used"] == len(held)  # no block leaked: the running tables hold every used one
            for seq in engine.scheduler.running:  # rejected drafts' blocks are given back at once
                assert len(seq.block_table) <= -(-len(seq.token_ids) // BLOCK), seq
            for block in pool.blocks:  # nothing unverified in the prefix cache, full or partial
                assert block.block_hash is None or block.block_hash in verified, block
                if block.partial_ids is not None:
                    partials_seen += 1
                    assert any(tuple(after[:len(block.partial_ids)]) == block.partial_ids
                               for after in starts.get(block.partial_parent, ())), block
        assert [finals[i][len(p):] for i, p in zip(ids, prompts)] == ref
    assert llm.stats()["preemptions"] > 0  # (the pool was tight: preemption ran beside the drafts)
    assert all(block.ref_cnt == 0 for block in pool.blocks) and llm.stats()["used"] == 0
    assert partials_seen and any(block.block_hash is not None for block in pool.blocks)
    assert source.observed and sum(a for _, a in source.observed) < sum(d for d, _ in source.observed)
    # the next turn of each request, from the cache, equals a recompute
    follow = [finals[i] + [rng.randrange(8, 380) for _ in range(3)] for i in ids[:4]]
    fresh = make_llm(moe, enable_prefix_caching=False)
    expect, _ = run(fresh, follow, [greedy(12)] * 4)
    engine.drafter = None  # (plain decoding now: only the cache's content is under test)
    engine.scheduler.proposer = None
    got, outs = run(llm, follow, [greedy(12)] * 4)
    assert got == expect and all(out.num_cached_tokens > 0 for out in outs)


# ---- sampling: the output distribution is the target's ---------------------------------------------------------------

class ModeDraft(DraftSource):
    """After the prompt's first sampled token t0, drafts the target's likeliest next token (`modes[t0]`): accepted
    with probability p(mode), so both the accepted and the rejected branch are taken often."""

    name = "mode"

    def __init__(self, prompt_len: int, modes: dict[int, int]):
        super().__init__(1)
        self.prompt_len, self.modes = prompt_len, modes

    def propose(self, seq_id: int, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        return [self.modes[token_ids[-1]]] if len(token_ids) == self.prompt_len + 1 else []


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("spec") / "dense", "qwen3", dict(num_hidden_layers=2))


def test_sampled_output_has_the_target_distribution(dense):
    """Speculative sampling on a 4-token vocabulary (top_k = 4, temperature 1): 3 tokens per reply, the second
    verified against a draft (accept: the draft and a bonus token; reject: the target's other token, then one more).
    The joint law of the 3 tokens over 4,000 seeded replies against the exact one (the reference model's
    probabilities): a chi-square test; plain sampling is held to the same test."""
    import torch

    path, model = dense
    prompt = random.Random(7).sample(range(8, 380), 6)
    TOP = 4

    def law(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([prefix])).logits[0, -1].double()
        top = logits.topk(TOP)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    expected: dict[tuple[int, ...], float] = {}
    modes: dict[int, int] = {}
    for t0, p0 in law(prompt).items():
        first = law(prompt + [t0])
        modes[t0] = max(first, key=first.get)
        for t1, p1 in first.items():
            for t2, p2 in law(prompt + [t0, t1]).items():
                expected[(t0, t1, t2)] = p0 * p1 * p2
    n = 4000
    params = [SamplingParams(temperature=1.0, top_k=TOP, max_tokens=3, ignore_eos=True, seed=i) for i in range(n)]

    def p_value(llm: LLM) -> float:
        counts: dict[tuple[int, ...], int] = {}
        for out in llm.generate([prompt] * n, params):
            key = tuple(out.outputs[0].token_ids)
            assert key in expected, key  # (only tokens of the top 4)
            counts[key] = counts.get(key, 0) + 1
        cells = sorted(expected, key=expected.get, reverse=True)
        big = [c for c in cells if expected[c] * n >= 5]
        observed = [counts.get(c, 0) for c in big] + [n - sum(counts.get(c, 0) for c in big)]
        want = [expected[c] * n for c in big] + [n - sum(expected[c] * n for c in big)]
        if want[-1] < 5:  # (nothing left over worth a cell of its own)
            observed, want = observed[:-2] + [observed[-2] + observed[-1]], want[:-2] + [want[-2] + want[-1]]
        stat = sum((o - e) ** 2 / e for o, e in zip(observed, want))
        return float(torch.special.gammaincc(torch.tensor((len(want) - 1) / 2), torch.tensor(stat / 2)))

    options = dict(block_size=BLOCK, num_kv_blocks=1024, max_num_seqs=128, max_num_batched_tokens=512)
    assert p_value(LLM(str(path), dtype="float32", device="cpu", **options)) > 1e-3
    llm = LLM(str(path), dtype="float32", device="cpu", speculative_method="ngram", num_speculative_tokens=1,
              **options)
    llm.engine.drafter = ModeDraft(len(prompt), modes)
    llm.engine.draft_length = None
    # unseeded: the shared generator's draws, which no rewind aligns with decoding's (a seeded request's tokens
    # equal its tokens without speculation: test_seeded_sampled_requests_draw_what_they_draw_without_speculation)
    params = [SamplingParams(temperature=1.0, top_k=TOP, max_tokens=3, ignore_eos=True) for _ in range(n)]
    assert p_value(llm) > 1e-3
    stats = llm.stats()
    assert stats["spec_num_drafts"] == n and 0.1 * n < stats["spec_accepted_tokens"] < 0.9 * n


# ---- turning it on ---------------------------------------------------------------------------------------------------

def test_config_names_a_bad_method_or_length():
    with pytest.raises(ConfigError, match="speculative_method"):
        EngineConfig("m", speculative_method="eagle")
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig("m", speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        EngineConfig("m", speculative_method="ngram", num_speculative_tokens=True)


def test_hybrid_model_speculates(tmp_path):
    """A hybrid (Gated DeltaNet layers, a recurrent state per sequence) drafts and verifies too, its state ending at
    the last accepted draft: the same reply as without drafts, drafts verified, nothing held after
    (tests/engine/test_spec_decode_hybrid.py holds it to much more)."""
    path, _ = make_hybrid_checkpoint(tmp_path / "hybrid", "qwen3_next",
                                     dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
    prompt = random.Random(10).sample(range(8, 380), 8) * 3  # (a repeat: suffix drafts from the first step on)
    plain = make_llm(str(path)).generate([prompt], [greedy(16)])[0].outputs[0].token_ids
    llm = make_llm(str(path), "suffix")
    llm.engine.draft_length = None  # (every draft verified, whatever the steps' times)
    assert list(llm.generate([prompt], [greedy(16)])[0].outputs[0].token_ids) == list(plain)
    stats = llm.stats()
    assert stats["spec_num_drafts"] > 0 and stats["used"] == 0
    pool = llm.engine.kv.pool
    pool.check_invariants()
    assert {s for s in range(pool.num_state_slots) if pool.state_slot_refs(s)} == \
        {b.snapshot for b in pool.blocks if b.snapshot is not None}


# ---- the draft sources -----------------------------------------------------------------------------------------------

def test_suffix_automaton_finds_the_longest_earlier_repeat():
    rng = random.Random(4)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        automaton = SuffixAutomaton(tokens)
        n, end = automaton.repeat()
        L = len(tokens)
        best = max((m for m in range(1, L) if any(tokens[i - m + 1:i + 1] == tokens[L - m:]
                                                   for i in range(m - 1, L - 1))), default=0)
        assert n == best
        if n:
            assert end < L - 1 and tokens[end - n + 1:end + 1] == tokens[L - n:]


def test_ngram_prefers_the_longest_n_and_the_latest_match():
    source = NgramSource(3, min_n=1, max_n=3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 7, 5, 2, 3]
    # [2, 3] occurs at 1..2 and 4..5; the 3-gram [5, 2, 3] nowhere before; the latest 2-gram match (4..5) wins
    assert source.propose(0, tokens, 10) == [7, 5, 2]
    tokens += [7]  # incremental: [2, 3, 7] matched at 4..6
    assert source.propose(0, tokens, 10) == [5, 2, 3]
    assert source.propose(0, tokens, 2) == [5, 2]
    assert NgramSource(3).propose(1, [1, 2, 3, 4], 3) == []


def test_suffix_drafts_the_longest_match_and_stops_on_text_that_does_not_repeat():
    source = SuffixSource(8)
    rng = random.Random(5)
    text = [rng.randrange(1000) for _ in range(40)]
    tokens = text + text[:10]  # a repeat of 10 tokens: drafts what followed them
    draft = source.propose(0, tokens, 8)
    assert draft and draft == text[10:10 + len(draft)]
    # text that does not repeat drafts nothing
    novel = list(range(5000, 5400))
    assert not any(source.propose(1, novel[:i], 8) for i in range(1, len(novel)))
    # a sequence that keeps rejecting stops drafting on short matches
    source = SuffixSource(8)
    loop = [1, 2, 3, 1, 2, 3, 1, 2]
    assert source.propose(2, loop, 8)
    for _ in range(4):
        source.observe(2, 3, 0)
    assert source.propose(2, loop, 8) == []


def test_suffix_global_index_serves_other_requests_and_is_bounded():
    source = SuffixSource(6, max_outputs=2)
    rng = random.Random(6)
    outputs = [[rng.randrange(1000) for _ in range(30)] for _ in range(3)]
    source.release(0, [7, 7] + outputs[0], 2)  # (its output only: the 2 prompt tokens are left out)
    source.release(2, outputs[1], 0)
    prompt = [rng.randrange(1000, 2000) for _ in range(5)] + outputs[0][:8]
    draft = source.propose(1, prompt, 6)  # another request's output drafts for this one
    assert draft and draft == outputs[0][8:8 + len(draft)]
    source.release(3, outputs[2], 0)  # the third pushes out the least recently used: outputs[1] (0 was just used)
    assert source.stats()["outputs"] == 2
    assert source.propose(4, [5000] + outputs[1][:8], 6) == []
    assert source.propose(5, [5001] + outputs[0][:8], 6)


def test_profile_keys_and_run_flags(moe, tmp_path, capsys, monkeypatch):
    """The profile keys (flat: speculative_method, num_speculative_tokens) load and are checked where they are
    written; `tsterm run --speculative METHOD --num-speculative-tokens K --json` decodes the same tokens as without
    and reports the drafted and accepted tokens."""
    import json

    import tsterm.launch
    from tsterm.cli import main
    from tsterm.profiles import load_profile

    loaded = []
    load_llm = tsterm.launch.load_llm
    monkeypatch.setattr(tsterm.launch, "load_llm", lambda *a, **kw: loaded.append(load_llm(*a, **kw)) or loaded[-1])

    good = tmp_path / "spec.yaml"
    good.write_text(f"model: {moe}\nspeculative_method: suffix\nnum_speculative_tokens: 6\n")
    assert load_profile(str(good)).engine_options() == {"speculative_method": "suffix", "num_speculative_tokens": 6}
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {moe}\nspeculative_method: eagle\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2.*speculative_method must be off, ngram or suffix"):
        load_profile(str(bad))

    prompt = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"
    base = ["run", "--model", moe, "--prompt", prompt, "--raw", "--max-tokens", "40", "--temperature", "0",
            "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["spec_draft_tokens"] == plain["spec_accepted_tokens"] == plain["spec_num_drafts"] == 0
    assert plain["spec_accepted_per_pos"] == []
    assert main(base + ["--speculative", "ngram", "--num-speculative-tokens", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    config = loaded[-1].engine.config
    assert (config.speculative_method, config.num_speculative_tokens) == ("ngram", 3)
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["spec_draft_tokens"] > 0 and 0 < spec["spec_accepted_tokens"] <= spec["spec_draft_tokens"]
    # per position (K = 3 of them): a verify that accepted position i accepted the ones before it
    per_pos = spec["spec_accepted_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == spec["spec_accepted_tokens"]
    assert spec["spec_num_drafts"] >= per_pos[0] >= per_pos[1] >= per_pos[2]
    with pytest.raises(SystemExit):
        main(base + ["--speculative", "eagle"])

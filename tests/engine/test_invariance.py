"""Reuse is invisible: a request's tokens and log-probabilities are the same bits whether its prompt came from the
prefix cache or was computed, alone or batched with 2, 7 or 31 others, whatever the prefill chunk size and the
thread count, after a fork (n > 1) and after a preemption (README "Same answer whatever the cache or the batch").

The matrix runs on the default profile (SmolLM2, int4 / int8 GGUF blocks, the native CPU kernels), on a float32
MoE (Qwen2-MoE: routed experts and a gated shared expert), on the same MoE run with dtype bfloat16 (its linears through
csrc/bf16.c: AMX tiles where the OS grants them) and on OLMoE (q/k norms over the whole projection, clip_qkv, a head
size the C attention kernels do not take). Each case is compared with the same request run alone on a
fresh engine (its oracle: nothing cached, nothing beside it); both greedy and seeded sampling, with logprobs.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint, make_hybrid_checkpoint
from tsterm.config import SamplingParams
from tsterm.launch import engine_config
from tsterm.llm import LLM
from tsterm.profiles import SHIPPED_DIR, load_profile

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, ignore_eos=True, logprobs=2, seed=11)
BATCHES = (1, 3, 8, 32)
CHUNKS = (16, 64, 512)  # max_num_batched_tokens: the prefill chunk (and where its boundaries fall)


def _default_model():
    profile = load_profile(str(SHIPPED_DIR / "default.yaml"))
    options = dict(profile.engine_options(), kv_cache_memory=None, num_kv_blocks=512, max_model_len=2048)
    return engine_config(profile).model, options


def _float_moe(root: Path):
    sizes = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, head_dim=16, num_hidden_layers=2,
                 num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=64,
                 max_position_embeddings=2048)
    path, _ = make_checkpoint(root / "qwen2moe", "qwen2_moe", sizes)
    return str(path), dict(dtype="float32", device="cpu", block_size=16, num_kv_blocks=512)


def _olmoe(root: Path):
    """OLMoE: q/k norms over the whole projection (before the head split), clip_qkv, and a head size of 8, which the C
    attention kernels do not take (torch_ops runs such heads row by row)."""
    sizes = dict(num_hidden_layers=2, num_experts=5, num_experts_per_tok=2, clip_qkv=4.0, head_dim=8,
                 max_position_embeddings=2048)
    path, _ = make_checkpoint(root / "olmoe", "olmoe", sizes)
    return str(path), dict(dtype="float32", device="cpu", block_size=16, num_kv_blocks=512)


def _bfloat16_moe(root: Path):
    """The float32 MoE's checkpoint run in bfloat16 on the CPU: every linear (attention, router, routed and shared
    experts, LM head) in csrc/bf16.c's arithmetic, the ops between them in float32 by the C kernels."""
    path, options = _float_moe(root)
    return path, dict(options, dtype="bfloat16")


FLOAT_MODELS = {"float32-moe": _float_moe, "bfloat16-moe": _bfloat16_moe, "olmoe": _olmoe}


@pytest.fixture(scope="module", params=["default-profile", "float32-moe", "bfloat16-moe", "olmoe"])
def model(request, tmp_path_factory):
    """(model dir, engine options, prompts): the first prompt is the one checked; the rest are its neighbours. One
    prompt is long enough to cross several of attention's 128-position splits."""
    if request.param == "default-profile":
        path, options = _default_model()
    else:
        path, options = FLOAT_MODELS[request.param](tmp_path_factory.mktemp("inv"))
    rng = random.Random(3)
    vocab = 4000 if request.param == "default-profile" else 380
    lengths = [37, 700] + [rng.randrange(5, 120) for _ in range(30)]
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    return path, options, prompts


def _outputs(llm: LLM, prompts, params) -> list[tuple[list[int], str]]:
    return [(c.token_ids, repr(c.logprobs)) for o in llm.generate(prompts, params) for c in o.outputs]


def _solo(model, params, index: int = 0) -> tuple[list[int], str]:
    """The oracle: the prompt alone on a fresh engine, default chunking and threads."""
    path, options, prompts = model
    return _outputs(LLM(path, **options), [prompts[index]], params)[0]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_cached_and_batched_requests_give_the_solo_bits(model, params):
    path, options, prompts = model
    solo = {i: _solo(model, params, i) for i in (0, 1)}
    llm = LLM(path, **options)
    for index in (0, 1):  # the short prompt, and the one past several 128-position splits
        assert _outputs(llm, [prompts[index]], params)[0] == solo[index]  # cold on this engine
        again = llm.generate([prompts[index]], params)[0]
        assert again.num_cached_tokens > 0
        assert _outputs(llm, [prompts[index]], params)[0] == solo[index]  # cached
    for batch in BATCHES:
        assert _outputs(llm, prompts[:1] + prompts[2:batch + 1], params)[0] == solo[0], f"batch of {batch}"
    assert _outputs(llm, prompts[1:4], params)[0] == solo[1]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_any_prefill_chunking_gives_the_solo_bits(model, chunk):
    path, options, prompts = model
    solo = [_solo(model, params, 1) for params in (GREEDY, SEEDED)]
    llm = LLM(path, **dict(options, max_num_batched_tokens=chunk))
    for params, want in zip((GREEDY, SEEDED), solo):
        assert _outputs(llm, [prompts[1]], params)[0] == want
        assert _outputs(llm, prompts[1:4], params)[0] == want  # chunks shared with neighbours


def test_one_thread_gives_the_bits_of_two(model):
    path, options, prompts = model
    solo = [_solo(model, params, 1) for params in (GREEDY, SEEDED)]
    before = torch.get_num_threads()
    try:
        llm = LLM(path, **options)
        llm.engine.executor.cpu_threads = None  # the thread governor off: one thread, however idle the machine
        torch.set_num_threads(1)  # torch's and the C kernels' OpenMP threads (one libgomp)
        for params, want in zip((GREEDY, SEEDED), solo):
            assert _outputs(llm, prompts[1:4], params)[0] == want
    finally:
        torch.set_num_threads(before)


def test_forked_samples_are_their_seeds_solo_runs(model):
    """n = 3 forks one prompt (shared blocks, copy-on-write tail); sample i is seed + i run alone."""
    path, options, prompts = model
    llm = LLM(path, **options)
    forked = llm.generate(prompts[:1] + prompts[2:5], SamplingParams(**{**_fields(SEEDED), "n": 3}))[0]
    for i, sample in enumerate(forked.outputs):
        want = _solo(model, SamplingParams(**{**_fields(SEEDED), "seed": SEEDED.seed + i}))
        assert (sample.token_ids, repr(sample.logprobs)) == want, f"sample {i}"


def test_preempted_requests_resume_to_the_solo_bits(model):
    """A pool too small for eight sequences at once: the newest are preempted and recomputed from their cached
    prefix, and finish with the bits they have alone."""
    path, options, prompts = model
    batch = [p for p in prompts[2:] if len(p) >= 40][:8]
    llm = LLM(path, **dict(options, num_kv_blocks=24, max_model_len=256))
    params = SamplingParams(**{**_fields(GREEDY), "max_tokens": 24})
    got = _outputs(llm, batch, params)
    assert llm.stats()["preemptions"] > 0, "the pool held every sequence: nothing was preempted"
    fresh = LLM(path, **dict(options, max_model_len=256))
    for prompt, out in zip(batch, got):
        assert _outputs(fresh, [prompt], params) == [out]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def test_deterministic_false_lets_a_quantized_prefill_take_the_float_gemm():
    """The profile option for speed over invariance (the default profile's int4 / int8 blocks): a long prompt then
    runs the float32 GEMM, whose logits differ from the int8-row path's that decode and short tails take."""
    path, options = _default_model()
    prompt = [random.Random(5).randrange(10, 4000) for _ in range(300)]
    fast, exact = (_outputs(LLM(path, **dict(options, deterministic=flag)), [prompt], GREEDY)[0] for flag in (False, True))
    assert fast[1] != exact[1]


# ---- the hybrids (Gated DeltaNet + gated attention) ------------------------------------------------------------------
# A prompt's recurrent state is computed by the chunked rule over each piece of it the scheduler cuts (a prefill chunk,
# or the rest after a prefix-cache hit), and a decode step's by the per-token rule: the two round differently, so a
# hybrid's bits depend on where its prompt is cut. What holds is the rest: the same cuts give the same bits whatever
# the batch (the neighbours' prompts and decodes, 1 to 8 of them: 8 sequences of 4 value heads fill torch's vector
# loops, fewer run their scalar tails) and the thread count.


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def hybrid(request, tmp_path_factory):
    path, _ = make_hybrid_checkpoint(tmp_path_factory.mktemp("inv_hybrid") / request.param, request.param)
    rng = random.Random(4)
    prompts = [[rng.randrange(10, 380) for _ in range(rng.randrange(20, 40))] for _ in range(9)]
    return str(path), dict(dtype="float32", device="cpu", block_size=16, num_kv_blocks=256), prompts


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_hybrids_request_has_its_solo_bits_in_any_batch(hybrid, params):
    """Every prompt fits the step's budget (one piece each, the same cuts alone and batched): the checked request's
    tokens and logprobs alone on a fresh engine equal those beside 2 and 8 others, on one thread and on two."""
    path, options, prompts = hybrid
    solo = _outputs(LLM(path, **options), prompts[:1], params)[0]
    llm = LLM(path, **options)
    for batch in (3, 9):
        assert _outputs(llm, prompts[:batch], params)[0] == solo, f"batch of {batch}"
    before = torch.get_num_threads()
    try:
        llm.engine.executor.cpu_threads = None
        torch.set_num_threads(1)
        assert _outputs(llm, prompts[:9], params)[0] == solo, "one thread"
    finally:
        torch.set_num_threads(before)

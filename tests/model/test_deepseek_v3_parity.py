"""DeepSeek-V3 / Kimi-K2 (`deepseek_v3`) against transformers' DeepseekV3ForCausalLM on tiny random checkpoints with
odd shapes: Multi-head Latent Attention with q_lora_rank set and null, interleaved and plain RoPE layouts, DeepSeek's
YaRN (mscale / mscale_all_dim: the rotation's magnitude and the softmax scale), attention biases, odd head counts,
dense first layers, a shared expert, sigmoid group-limited routing with a randomised selection bias, and
routed_scaling_factor. Greedy 32 tokens on three prompts, the first step's log-probabilities and the last logits of one
prefill, both with every chunk absorbed (the default) and with a 70-token prompt chunk through the expanded form
(`deterministic: false`); and multi-turn reuse of the latent blocks (the later turns' suffixes over the reused blocks)
equal to a fresh recompute."""
from __future__ import annotations

import random

import pytest

from tsterm import LLM, SamplingParams
from tsterm.config import ModelConfig

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import assert_greedy_matches, assert_last_logits_close, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound

NEW_TOKENS = 32
MLA_SHAPE = dict(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)

# (name, config overrides)
CASES = [
    ("q-lora-groups-dense-first-shared-bias",
     dict(MLA_SHAPE, q_lora_rank=20, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
          first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
          attention_bias=True, num_attention_heads=5, num_key_value_heads=5)),
    ("no-q-lora-yarn-mscale-plain-rope",
     dict(MLA_SHAPE, q_lora_rank=None, kv_lora_rank=20, n_routed_experts=6, num_experts_per_tok=2, n_group=1,
          topk_group=1, first_k_dense_replace=2, num_hidden_layers=4, n_shared_experts=2, routed_scaling_factor=1.5,
          norm_topk_prob=False, num_attention_heads=3, num_key_value_heads=3, rope_interleave=False,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                               mscale=1.0, mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0))),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def checkpoint(request, tmp_path_factory):
    name, overrides = request.param
    return make_checkpoint(tmp_path_factory.mktemp("deepseek_v3") / name, "deepseek_v3", overrides)


def test_the_checkpoint_has_what_the_case_is_about(checkpoint):
    """The family's parts are there (so the parity below covers them)."""
    model_dir, hf_model = checkpoint
    cfg = ModelConfig.from_dir(model_dir)
    hf = hf_model.config
    assert cfg.scoring_func == "sigmoid" and cfg.num_attention_heads % 2 == 1
    assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim) == (hf.kv_lora_rank, hf.qk_nope_head_dim,
                                                                         hf.v_head_dim)
    assert cfg.head_dim == cfg.rotary_dim == cfg.qk_rope_head_dim == hf.qk_rope_head_dim
    assert cfg.q_lora_rank == (hf.q_lora_rank or 0) and cfg.rope_interleave == hf.rope_interleave
    assert [cfg.is_moe_layer(i) for i in range(cfg.first_k_dense_replace + 1)] == \
        [False] * cfg.first_k_dense_replace + [True]
    assert cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size * hf.n_shared_experts
    if cfg.rope.rope_type == "yarn":
        assert cfg.rope.mscale == 1.0 and cfg.rope.mscale_all_dim == 0.8
    biases = [b for n, b in hf_model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)


@pytest.mark.parametrize("deterministic", [True, False], ids=["absorbed", "expanded"])
def test_greedy_and_logits_match_transformers(checkpoint, deterministic):
    model_dir, hf_model = checkpoint
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=128,
              deterministic=deterministic)
    prompts = random_prompts(hf_model.config.vocab_size, (11, 5, 70))
    assert_greedy_matches(llm, hf_model, prompts, NEW_TOKENS)
    assert_last_logits_close(llm, hf_model, prompts[2])  # the last position's logits of one 70-token prefill


def test_multi_turn_reuse_equals_a_fresh_recompute(checkpoint):
    model_dir, _ = checkpoint
    options = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=192)
    llm, fresh = LLM(str(model_dir), **options), LLM(str(model_dir), enable_prefix_caching=False, **options)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rng = random.Random(0)
    history = [rng.randrange(8, 380) for _ in range(70)]
    previous_full = None
    for turn in range(4):
        out = llm.generate(history, greedy)[0]
        assert out.token_ids == fresh.generate(history, greedy)[0].token_ids, f"turn {turn}"
        if previous_full is not None:  # every token the previous turn computed came from the latent cache
            assert out.num_cached_tokens == len(previous_full) - 1
        previous_full = history + out.token_ids
        history = previous_full + [rng.randrange(8, 380) for _ in range(rng.randrange(2, 7))]


BAD_BASE = dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=8,
                intermediate_size=16, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8)


@pytest.mark.parametrize("change, field", [
    (dict(kv_lora_rank=None), "kv_lora_rank"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(qk_nope_head_dim=None), "qk_nope_head_dim"),
    (dict(v_head_dim=0), "v_head_dim"),
    (dict(qk_rope_head_dim=7), "partial_rotary_factor|rotated dims"),  # an odd RoPE width
    (dict(q_lora_rank=-1), "q_lora_rank"),
])
def test_a_bad_mla_field_is_named(change, field):
    from tsterm.errors import ModelLoadError

    ModelConfig.from_dict(BAD_BASE)  # the base is fine
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict({k: v for k, v in {**BAD_BASE, **change}.items() if v is not None})

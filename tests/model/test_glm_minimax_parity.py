"""GLM-4.5 / 4.6 (`glm4_moe`) and MiniMax-M2 (`minimax_m2`) against transformers on tiny random checkpoints with odd
shapes: odd head counts, partial RoPE, dense first layers, a shared expert without a gate, sigmoid routing with a
selection-only bias (randomised: transformers starts it at zero), group-limited choice, routed_scaling_factor,
q/k norms per head (GLM) or over the whole projection (MiniMax). Greedy 32 tokens on three prompts, the first
step's log-probabilities, and multi-turn reuse of the prefix cache equal to a fresh recompute."""
from __future__ import annotations

import random

import pytest

from tsterm import LLM, SamplingParams
from tsterm.config import ModelConfig
from tsterm.model.arch import ARCHITECTURES

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import assert_greedy_matches, assert_last_logits_close, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound

NEW_TOKENS = 32

# (name, model_type, config overrides)
CASES = [
    ("glm-groups-dense-first-shared", "glm4_moe",
     dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
          n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
          num_attention_heads=5, num_key_value_heads=1, partial_rotary_factor=0.5)),
    ("glm-air-no-qk-norm-two-dense", "glm4_moe",  # GLM-4.5-Air's shape: no q/k norm, one group
     dict(n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=2,
          num_hidden_layers=4, n_shared_experts=2, routed_scaling_factor=1.0, norm_topk_prob=False,
          attention_bias=True, use_qk_norm=False, num_attention_heads=3, num_key_value_heads=3,
          partial_rotary_factor=0.5)),
    ("minimax-rotary-dim", "minimax_m2",
     dict(num_local_experts=6, num_experts_per_tok=2, num_attention_heads=3, num_key_value_heads=1, rotary_dim=8)),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def checkpoint(request, tmp_path_factory):
    name, model_type, overrides = request.param
    return make_checkpoint(tmp_path_factory.mktemp("glm_minimax") / name, model_type, overrides)


def test_the_checkpoint_has_what_the_case_is_about(checkpoint):
    """The family's parts are there (so the parity below covers them): a router bias that moves the choice, dense
    first layers, groups, partial rotary."""
    model_dir, hf_model = checkpoint
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.scoring_func == "sigmoid" and cfg.rotary_dim == cfg.head_dim // 2
    assert cfg.num_attention_heads % 2 == 1
    if cfg.model_type == "glm4_moe":
        assert [cfg.is_moe_layer(i) for i in range(cfg.first_k_dense_replace + 1)] == \
            [False] * cfg.first_k_dense_replace + [True]
        assert cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size * hf_model.config.n_shared_experts
        assert ARCHITECTURES["glm4_moe"].for_config(cfg).qk_norm == ("head" if cfg.use_qk_norm else "none")
    biases = [b for n, b in hf_model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)


def test_greedy_and_logits_match_transformers(checkpoint):
    model_dir, hf_model = checkpoint
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    prompts = random_prompts(hf_model.config.vocab_size, (11, 5, 17))
    assert_greedy_matches(llm, hf_model, prompts, NEW_TOKENS)
    assert_last_logits_close(llm, hf_model, prompts[2])  # the last position's logits of one prefill


def test_multi_turn_reuse_equals_a_fresh_recompute(checkpoint):
    model_dir, _ = checkpoint
    options = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=128)
    llm, fresh = LLM(str(model_dir), **options), LLM(str(model_dir), enable_prefix_caching=False, **options)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    rng = random.Random(0)
    history = [rng.randrange(8, 380) for _ in range(13)]
    previous_full = None
    for turn in range(4):
        out = llm.generate(history, greedy)[0]
        assert out.token_ids == fresh.generate(history, greedy)[0].token_ids, f"turn {turn}"
        if previous_full is not None:  # every token the previous turn computed came from the cache
            assert out.num_cached_tokens == len(previous_full) - 1
        previous_full = history + out.token_ids
        history = previous_full + [rng.randrange(8, 380) for _ in range(rng.randrange(2, 7))]


@pytest.mark.parametrize("change, field", [
    (dict(n_group=3), "n_group"),  # 8 experts do not split in 3
    (dict(n_group=8), "n_group"),  # groups of one expert
    (dict(topk_group=5), "topk_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),  # one group of two gives two
    (dict(scoring_func="tanh"), "scoring_func"),
    (dict(routed_scaling_factor=0), "routed_scaling_factor"),
    (dict(rotary_dim=7, partial_rotary_factor=None), "partial_rotary_factor"),  # odd rotated width
])
def test_a_bad_routing_or_rotary_field_is_named(change, field):
    from tsterm.errors import ModelLoadError

    raw = dict(model_type="glm4_moe", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
               moe_intermediate_size=8, intermediate_size=16, partial_rotary_factor=0.5)
    ModelConfig.from_dict(raw)  # the base is fine
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict({k: v for k, v in {**raw, **change}.items() if v is not None})

"""gpt-oss (`gpt_oss`) against transformers' GptOssForCausalLM (float32, eager attention: its own sink softmax) on
tiny random checkpoints with odd shapes: odd head counts, a sliding window shorter than every prompt (alternating
with full-attention layers), attention sinks, q/k/v/o biases, YaRN RoPE without truncation, a router with a bias,
experts with biases and the clamped SwiGLU (the sinks and biases randomised: transformers starts some at zero).
Greedy 32 tokens on three prompts, the first step's log-probabilities, the last logits of a prefill, and multi-turn
reuse of the prefix cache equal to a fresh recompute across the window's edge. Also an MXFP4 checkpoint (experts as
`_blocks` / `_scales`, kept as MXFP4 blocks at load) against the same model with those weights in float."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tsterm import LLM, SamplingParams
from tsterm.config import ModelConfig
from tsterm.model.arch import ARCHITECTURES

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import assert_greedy_matches, assert_last_logits_close, random_prompts, reference_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound

NEW_TOKENS = 32
PROMPT_LENGTHS = (11, 5, 17)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=32)

# (name, config overrides)
CASES = [
    ("window-4-odd-heads", dict(num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5,
                                num_key_value_heads=1, sliding_window=4, num_hidden_layers=3, rope_parameters=YARN)),
    ("window-3-full-first-gqa", dict(num_local_experts=4, num_experts_per_tok=3, num_attention_heads=3,
                                     num_key_value_heads=3, sliding_window=3, num_hidden_layers=4,
                                     layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                  "full_attention"], rope_parameters=YARN, swiglu_limit=1.5)),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def checkpoint(request, tmp_path_factory):
    name, overrides = request.param
    return make_checkpoint(tmp_path_factory.mktemp("gpt_oss") / name, "gpt_oss", overrides)


def test_the_checkpoint_has_what_the_case_is_about(checkpoint):
    """The family's parts are there, so the parity below covers them: sinks and biases far from zero, sliding layers
    with a window shorter than every prompt beside full ones, YaRN without truncation, a clamp that bites."""
    model_dir, hf_model = checkpoint
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.num_attention_heads % 2 == 1 and cfg.attention_bias
    assert cfg.sliding_window < min(PROMPT_LENGTHS)
    layer_types = ARCHITECTURES["gpt_oss"].layer_types(cfg)
    windows = {t.window for t in layer_types}
    assert windows == {None, cfg.sliding_window} and {t.mixer for t in layer_types} == {"full_attention"}
    assert cfg.rope.rope_type == "yarn" and cfg.rope.truncate is False
    params = dict(hf_model.named_parameters())
    for suffix in ("sinks", "gate_up_proj_bias", "down_proj_bias", "router.bias", "q_proj.bias", "o_proj.bias"):
        assert all(p.abs().max() > 0.1 for n, p in params.items() if n.endswith(suffix)), suffix


def test_greedy_and_logits_match_transformers(checkpoint):
    model_dir, hf_model = checkpoint
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    assert llm.engine.executor.model.stack is None  # sinks / windows: layer by layer, not the C stack
    prompts = random_prompts(hf_model.config.vocab_size, PROMPT_LENGTHS)
    assert_greedy_matches(llm, hf_model, prompts, NEW_TOKENS)
    assert_last_logits_close(llm, hf_model, prompts[2])  # the last position's logits of one prefill


def test_multi_turn_reuse_equals_a_fresh_recompute(checkpoint):
    """Each turn's prompt reuses the previous turn's blocks (its new tokens attend over cached positions on both sides
    of the window's edge) and gives what a recompute from scratch gives."""
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


FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # e2m1 magnitudes; code | 8 is the negative


def _random_mxfp4(gen: torch.Generator, experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
    """(blocks [E, rows, cols/32, 16] uint8, scales [E, rows, cols/32] uint8, the floats they mean [E, rows, cols]),
    the floats worked out value by value from the codes (sign bit, magnitude table, 2 ** (scale - 127))."""
    codes = torch.randint(0, 16, (experts, rows, cols), generator=gen)
    scales = torch.randint(118, 123, (experts, rows, cols // 32), generator=gen)  # 2 ** -9 .. 2 ** -5
    magnitude = torch.tensor(FP4)[codes % 8]
    values = torch.where(codes >= 8, -magnitude, magnitude)
    values = values * (2.0 ** (scales.double() - 127)).repeat_interleave(32, dim=-1).float()
    pairs = codes.view(experts, rows, cols // 32, 16, 2)
    blocks = (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8)  # the first of two values in the low nibble
    return blocks, scales.to(torch.uint8), values


def test_an_mxfp4_checkpoint_matches_its_float_weights(tmp_path):
    """The experts shipped as MXFP4 `_blocks` / `_scales` (as gpt-oss-20b is): kept as blocks at load, the model gives
    transformers' tokens for the same model with those expert weights in float."""
    overrides = dict(CASES[0][1], hidden_size=64, moe_intermediate_size=32)
    model_dir, hf_model = make_checkpoint(tmp_path / "mxfp4", "gpt_oss", overrides)
    gen = torch.Generator().manual_seed(7)
    weights = load_file(str(model_dir / "model.safetensors"))
    E, H, inter = 5, 64, 32
    for i in range(hf_model.config.num_hidden_layers):
        experts = hf_model.model.layers[i].mlp.experts
        p = f"model.layers.{i}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * inter, H), ("down_proj", H, inter)):
            blocks, scales, values = _random_mxfp4(gen, E, rows, cols)
            with torch.no_grad():  # transformers' layout is [E, in, out]: the transpose of the blocks'
                getattr(experts, name).copy_(values.transpose(1, 2))
            del weights[p + name]
            weights[p + name + "_blocks"], weights[p + name + "_scales"] = blocks, scales
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    assert raw["num_local_experts"] == E
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [  # as gpt-oss-20b's
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(raw))
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    prompt = torch.randint(0, hf_model.config.vocab_size, (9,), generator=gen).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == reference_greedy(hf_model, prompt, 12)[0]
    assert_last_logits_close(llm, hf_model, prompt)  # and the last logits of a prefill, close


@pytest.mark.parametrize("change, field", [
    (dict(sliding_window=0), "sliding_window"),  # sliding layers without a window
    (dict(swiglu_limit=0), "swiglu_limit"),
    (dict(layer_types=["sliding_attention", "linear_attention"]), "layer 1"),
])
def test_a_bad_gpt_oss_field_is_named(change, field):
    from tsterm.errors import ModelLoadError

    raw = dict(model_type="gpt_oss", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
               sliding_window=8, layer_types=["sliding_attention", "full_attention"], attention_bias=True)
    ModelConfig.from_dict(raw)  # the base is fine
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict({**raw, **change})

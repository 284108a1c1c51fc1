"""The hybrid families (Gated DeltaNet + gated attention: qwen3_next, qwen3_5_moe_text, qwen3_5_moe) against
transformers on tiny random checkpoints, through tsterm's normal LLM path: greedy tokens for 32 new tokens on
several prompts (prefill in chunks, decode batched over sequences, each sequence's state in its own slot), and the
last-position logits of a prompt within 1e-4 relative error."""
from __future__ import annotations

import pytest
import torch

from tsterm import LLM, SamplingParams

from tests.helpers.checkpoints import make_hybrid_checkpoint

NEW_TOKENS = 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound

# (name, model_type, config overrides, engine options): head counts and dims, conv kernel sizes and layer mixes vary
CASES = [
    ("next-default-mix", "qwen3_next", {}, dict(block_size=4)),
    ("next-gqa-k2-conv2-linear-first", "qwen3_next",
     dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=4,
          linear_conv_kernel_dim=2, num_key_value_heads=1, num_hidden_layers=3,
          layer_types=["full_attention", "linear_attention", "linear_attention"]),
     dict(block_size=8, max_num_batched_tokens=7)),  # prompts prefilled in chunks of up to 7 tokens
    ("q35text-conv3-half-rope", "qwen3_5_moe_text",
     dict(linear_conv_kernel_dim=3, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
          linear_value_head_dim=16, head_dim=8, num_attention_heads=4, num_key_value_heads=4,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
          layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
     dict(block_size=4)),
    ("q35-multimodal-release", "qwen3_5_moe",
     dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
     dict(block_size=4)),
]


def reference_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers as the oracle: full-sequence forward every step (no cache), argmax."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name,model_type,overrides,options", CASES, ids=[c[0] for c in CASES])
def test_hybrid_greedy_tokens_and_logits_match_transformers(tmp_path, name, model_type, overrides, options):
    model_dir, hf_model = make_hybrid_checkpoint(tmp_path / name, model_type, overrides)
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4, **options)
    engine = llm.engine
    assert engine.executor.num_state_slots == 12 and engine.executor.state_bytes > 0  # 4 states, 4 + 4 snapshots
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in (11, 1, 20)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(hf_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"

    prompt = prompts[2]  # the last position's logits, after a prefill in as many chunks as the token budget makes
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
    seq = engine.scheduler.waiting[0]
    while seq.num_computed_tokens < len(prompt):
        batch = engine.scheduler.schedule()
        ours = engine.executor.execute(batch)  # [1, V] once the prompt's last token is in, else [0, V]
        seq.num_computed_tokens += batch.num_new[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1]
    rel = (ours[0] - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"relative error {rel:.2e}"

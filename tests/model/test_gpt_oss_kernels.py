"""gpt-oss's sink / sliding-window attention runs through the C attention kernels on the CPU (csrc/prefill.c and
decode.c's `_sw` entry points, via `torch_ops.paged_attention(sinks=, window=)`), never the torch twin, and still
gives transformers' greedy tokens: a prompt shorter than a 128-position split, and one of 150 tokens prefilled in
chunks of 64 whose decode rows skip the first split whole (window 4)."""
from __future__ import annotations

import pytest

from tsterm import LLM, SamplingParams
from tsterm_kernels import cpu_native, cpu_select, torch_ops

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import random_prompts, reference_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    overrides = dict(num_local_experts=5, num_experts_per_tok=2, num_attention_heads=5, num_key_value_heads=1,
                     sliding_window=4, num_hidden_layers=2, max_position_embeddings=512)
    return make_checkpoint(tmp_path_factory.mktemp("gpt_oss_kernels") / "m", "gpt_oss", overrides)


def test_gpt_oss_attention_runs_the_c_kernels_and_matches_transformers(checkpoint, monkeypatch):
    model_dir, hf_model = checkpoint
    monkeypatch.setenv(cpu_select.ENV, "c-avx2")  # the C kernels for every class, whatever this machine measured
    calls = {"prefill_attention_sw": 0, "decode_attention_sw": 0}
    for build in {id(b): b for b in (cpu_native.load(), cpu_native.load_variant("avx2")) if b is not None}.values():
        for name in calls:
            def counted(*args, _fn=getattr(build, name), _name=name):
                calls[_name] += 1
                return _fn(*args)
            monkeypatch.setattr(build, name, counted)

    def twin(*args, **kwargs):
        raise AssertionError("the torch twin ran instead of the C kernels")
    monkeypatch.setattr(torch_ops, "_sink_window_attention", twin)

    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=64)
    prompts = random_prompts(hf_model.config.vocab_size, (11, 150), seed=3)
    new_tokens = 6
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(hf_model, prompt, new_tokens)[0], f"prompt of {len(prompt)}"
    # every layer's attention of every step went to C: prompts (chunked) through prefill.c, the rest through decode.c
    assert calls["prefill_attention_sw"] >= 2 * 4 and calls["decode_attention_sw"] >= 2 * (new_tokens - 1)

"""gpt-oss with its experts kept MXFP4 (`_blocks` / `_scales`, as gpt-oss-20b ships them): the loader keeps them as
"mxfp4" QuantizedWeights (down_proj's blocks read in place from the file mapping), csrc/mxfp4.c runs them, and the
model is token-exact with transformers loading the very same directory (transformers reads MXFP4 on the CPU by
dequantizing the blocks itself: an independent reader of the nibble order and the scale bias). A request's tokens and
log-probabilities are the same alone or batched. Asking for another quantization re-quantizes the experts."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from tsterm_kernels.quant import QuantizedWeight

from tsterm import LLM, SamplingParams
from tsterm.bench.measure import model_weight_bytes

from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.parity import assert_greedy_matches, assert_last_logits_close, random_prompts
from tests.model.test_gpt_oss_parity import CASES, _random_mxfp4

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: op-overhead bound

E, H, INTER = 5, 64, 96  # I = 96: three blocks of 32 along down_proj's inputs
OPTIONS = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=96)


def write_mxfp4_checkpoint(path):
    """A tiny gpt-oss (sinks, a window of 4, YaRN, biases, the clamped SwiGLU) at `path` whose experts are random
    MXFP4 bytes (`_blocks` / `_scales`, quantization_config as gpt-oss-20b's); returns its directory."""
    overrides = dict(CASES[0][1], hidden_size=H, moe_intermediate_size=INTER)
    model_dir, hf_model = make_checkpoint(path, "gpt_oss", overrides)
    assert hf_model.config.num_local_experts == E
    gen = torch.Generator().manual_seed(17)
    weights = load_file(str(model_dir / "model.safetensors"))
    for i in range(hf_model.config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * INTER, H), ("down_proj", H, INTER)):
            blocks, scales, _ = _random_mxfp4(gen, E, rows, cols)
            del weights[p + name]
            weights[p + name + "_blocks"], weights[p + name + "_scales"] = blocks, scales
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [  # as gpt-oss-20b's
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(raw))
    return model_dir


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    return write_mxfp4_checkpoint(tmp_path_factory.mktemp("mxfp4") / "gpt_oss")


@pytest.fixture(scope="module")
def reference(mxfp4_dir):
    """transformers' GptOssForCausalLM read from the MXFP4 directory (it dequantizes the blocks on the CPU)."""
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(mxfp4_dir), dtype=torch.float32,
                                                                  attn_implementation="eager")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape == (E, H, 2 * INTER)
    return model.eval()


def _file_mappings(path) -> list[tuple[int, int]]:
    """The address ranges this process maps `path` at (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                lo, hi = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def test_the_experts_stay_mxfp4_and_down_proj_is_read_in_place(mxfp4_dir):
    llm = LLM(str(mxfp4_dir), **OPTIONS)
    model = llm.engine.executor.model
    mapped = _file_mappings(mxfp4_dir / "model.safetensors")
    for _, _, _, mlp in model.layers:
        assert isinstance(mlp.w13, QuantizedWeight) and mlp.w13.kind == "mxfp4" and mlp.w13.dims == (E, 2 * INTER, H)
        assert isinstance(mlp.w2, QuantizedWeight) and mlp.w2.kind == "mxfp4" and mlp.w2.dims == (E, H, INTER)
        # down_proj's blocks and scales are views of the file's mapping (gate_up's rows are regrouped: a copy)
        for t in (mlp.w2.data, mlp.w2.scale):
            assert any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in mapped)
        assert not any(lo <= mlp.w13.data.data_ptr() < hi for lo, hi in mapped)
    experts = sum(mlp.w13.nbytes + mlp.w2.nbytes for _, _, _, mlp in model.layers)
    assert experts * 8 == len(model.layers) * E * 3 * INTER * H * 4.25  # 4.25 bits a weight
    dequantized = LLM(str(mxfp4_dir), quantization="int8", **OPTIONS).engine.executor.model
    assert model_weight_bytes(model) < model_weight_bytes(dequantized)


def test_greedy_and_logits_match_transformers_reading_the_same_blocks(mxfp4_dir, reference):
    llm = LLM(str(mxfp4_dir), **OPTIONS)
    prompts = random_prompts(reference.config.vocab_size, (11, 5, 17))
    assert_greedy_matches(llm, reference, prompts, 32)
    assert_last_logits_close(llm, reference, prompts[2])


def test_a_request_is_the_same_alone_or_batched(mxfp4_dir):
    """The MXFP4 kernel's rows do not depend on the rows beside them: a prompt's greedy tokens and log-probabilities
    are the same bits alone, batched with others (decode steps of several rows, a prefill of many) and recomputed."""
    prompts = random_prompts(384, (9, 14, 6, 21), seed=3)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    batched = LLM(str(mxfp4_dir), **OPTIONS).generate(prompts, params)
    alone = LLM(str(mxfp4_dir), enable_prefix_caching=False, **OPTIONS)
    for prompt, out in zip(prompts, batched):
        one = alone.generate([prompt], params)[0]
        assert one.token_ids == out.token_ids
        assert repr(one.outputs[0].logprobs) == repr(out.outputs[0].logprobs)


def test_another_quantization_requantizes_the_experts(mxfp4_dir):
    model = LLM(str(mxfp4_dir), quantization="int4", **OPTIONS).engine.executor.model
    for _, _, _, mlp in model.layers:
        assert mlp.w13.kind == "int4" and mlp.w2.kind == "int4"

"""Every mistake a user can make with a model directory, a request or an option gets one clear error.

Each broken checkpoint is a copy of one tiny random checkpoint with a single thing wrong; the error must be a
`TstermError` whose one-line message names the file, tensor or field at fault.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tsterm import LLM, SamplingParams
from tsterm.errors import ConfigError, ModelLoadError, RequestError, TstermError

from tests.helpers.checkpoints import make_checkpoint

WEIGHTS = "model.safetensors"
VOCAB = 384  # make_checkpoint's vocabulary (the tokenizer has 320 tokens)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2))
    return path


@pytest.fixture(scope="module")
def llm(base_dir) -> LLM:
    return load(base_dir, max_model_len=32)


def load(model_dir: Path, **options) -> LLM:
    options = dict(dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64), **options)
    return LLM(str(model_dir), **options)


# --------------------------------------------------------------------------------------------------
# broken model directories: each mutation gets a fresh copy of the base checkpoint

def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / WEIGHTS
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def write_safetensors(path: Path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def missing_tensor(d):
    edit_tensors(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))


def extra_tensor(d):
    edit_tensors(d, lambda t: t.update({"model.layers.0.mlp.experts.9.gate_proj.weight": torch.ones(24, 32)}))


def wrong_shape(d):
    edit_config(d, hidden_size=48)


def truncated(d):
    path = d / WEIGHTS
    path.write_bytes(path.read_bytes()[:-100])


def truncated_in_header(d):
    path = d / WEIGHTS
    path.write_bytes(path.read_bytes()[:20])


def corrupt_header(d):
    path = d / WEIGHTS
    raw = bytearray(path.read_bytes())
    raw[9:17] = b"\xff\x00garbag"
    path.write_bytes(bytes(raw))


def malformed_entry(d):  # valid JSON, wrong structure, in a second shard
    entry = {"dtype": "F32", "shape": [2], "data_offsets": "0-8"}
    write_safetensors(d / "model-extra.safetensors", {"x.weight": entry}, bytes(8))


def unsupported_dtype(d):
    write_safetensors(d / "model-extra.safetensors", {"x.weight": {"dtype": "F8_E9M9", "shape": [2],
                                                                    "data_offsets": [0, 2]}}, bytes(2))


def mis_sized_entry(d):  # 8 bytes for a shape of three floats
    entry = {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}
    write_safetensors(d / "model-extra.safetensors", {"x.weight": entry}, bytes(8))


def overlapping_tensors(d):  # two tensors over the same bytes
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    write_safetensors(d / "model-extra.safetensors", {"x.weight": entry, "y.weight": entry}, bytes(8))


def bytes_after_last_tensor(d):
    path = d / WEIGHTS
    path.write_bytes(path.read_bytes() + bytes(64))


def integer_weight(d):  # a valid file, but int8 is no weight dtype (its quantization scales would be missing)
    edit_tensors(d, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)}))


def fp8_block_scales(d):  # a fine-grained FP8 checkpoint ships a scale per weight block
    edit_tensors(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1, 1)}))


def duplicate_tensor(d):
    shutil.copy(d / WEIGHTS, d / "model-copy.safetensors")


def unknown_model_type(d):
    edit_config(d, model_type="gpt_unknown")


def no_model_type(d):
    cfg = json.loads((d / "config.json").read_text())
    del cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))


def longrope(d):
    edit_config(d, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                    "long_factor": [2.0] * 8})


def dynamic_rope(d):  # not implemented by tsterm.model.rope: refused at load, not at the first forward
    edit_config(d, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})


def bad_field_type(d):
    edit_config(d, num_hidden_layers="three")


def bad_gqa(d):
    edit_config(d, num_key_value_heads=3)


def bad_top_k(d):
    edit_config(d, num_experts_per_tok=9)


def invalid_config_json(d):
    (d / "config.json").write_text('{"model_type": "qwen3_moe",\n  "hidden_size": 32,,\n}')


def missing_config(d):
    (d / "config.json").unlink()


def missing_shard(d):
    (d / WEIGHTS).rename(d / "model-00001-of-00002.safetensors")
    names = list(load_file(d / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map[names[-1]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def bad_index(d):
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))


def tokenizer_larger_than_embedding(d):
    # only the tokenizer check can fire: config and tensors agree on 300 rows, the tokenizer has 320 tokens
    edit_config(d, vocab_size=300)
    rows = ("model.embed_tokens.weight", "lm_head.weight")
    edit_tensors(d, lambda t: t.update({k: t[k][:300].clone() for k in rows}))


# (mutation, error type, substrings the message must contain)
CASES = [
    (missing_tensor, ModelLoadError, ["'model.layers.1.self_attn.k_proj.weight'", WEIGHTS]),
    (extra_tensor, ModelLoadError, ["model.layers.0.mlp.experts.9.gate_proj.weight", WEIGHTS, "config.json"]),
    (wrong_shape, ModelLoadError, ["'model.embed_tokens.weight'", "[384, 32]", "[384, 48]", "config.json"]),
    (truncated, ModelLoadError, [WEIGHTS, "truncated"]),
    (truncated_in_header, ModelLoadError, [WEIGHTS, "truncated"]),
    (corrupt_header, ModelLoadError, [WEIGHTS, "corrupt safetensors header"]),
    (malformed_entry, ModelLoadError, ["model-extra.safetensors", "'x.weight'", "data_offsets"]),
    (unsupported_dtype, ModelLoadError, ["model-extra.safetensors", "'x.weight'", "F8_E9M9"]),
    (mis_sized_entry, ModelLoadError, ["model-extra.safetensors", "'x.weight'", "[0, 8)", "12 bytes", "[3]"]),
    (overlapping_tensors, ModelLoadError, ["model-extra.safetensors", "'y.weight'", "overlapping"]),
    (bytes_after_last_tensor, ModelLoadError, [WEIGHTS, "64 bytes after its last tensor"]),
    (integer_weight, ModelLoadError, [WEIGHTS, "'model.norm.weight'", "I8", "F8_E4M3"]),
    (fp8_block_scales, ModelLoadError, [WEIGHTS, "'model.layers.0.self_attn.q_proj.weight_scale_inv'", "dequantize"]),
    (duplicate_tensor, ModelLoadError, [WEIGHTS, "model-copy.safetensors"]),
    (unknown_model_type, ModelLoadError, ["config.json", "'gpt_unknown'", "qwen3_moe"]),
    (no_model_type, ModelLoadError, ["config.json", "model_type"]),
    (longrope, ModelLoadError, ["config.json", "'longrope'", "yarn"]),
    (dynamic_rope, ModelLoadError, ["config.json", "'dynamic'"]),
    (bad_field_type, ModelLoadError, ["config.json", "'num_hidden_layers'", "'three'"]),
    (bad_gqa, ModelLoadError, ["config.json", "num_key_value_heads (3)"]),
    (bad_top_k, ModelLoadError, ["config.json", "num_experts_per_tok (9)"]),
    (invalid_config_json, ModelLoadError, ["config.json", "invalid JSON", "line 2"]),
    (missing_config, ModelLoadError, ["no config.json"]),
    (missing_shard, ModelLoadError, ["model.safetensors.index.json", "model-00002-of-00002.safetensors"]),
    (bad_index, ModelLoadError, ["model.safetensors.index.json", "weight_map"]),
    (tokenizer_larger_than_embedding, ModelLoadError, ["tokenizer.json", "320", "300"]),
]


@pytest.mark.parametrize("mutate,error,expected", CASES, ids=[c[0].__name__ for c in CASES])
def test_broken_model_dir_gets_one_clear_error(base_dir, tmp_path, mutate, error, expected):
    model_dir = tmp_path / "model"
    shutil.copytree(base_dir, model_dir)
    mutate(model_dir)
    with pytest.raises(TstermError) as info:
        load(model_dir)
    assert type(info.value) is error
    message = str(info.value)
    assert "\n" not in message, message
    for part in expected:
        assert part in message, f"{part!r} not in: {message}"


def test_pickle_checkpoint_is_refused_without_unpickling(base_dir, tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    shutil.copytree(base_dir, model_dir)
    torch.save(load_file(model_dir / WEIGHTS), model_dir / "pytorch_model.bin")
    (model_dir / WEIGHTS).unlink()

    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load must never be called on a user's checkpoint")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(torch.serialization, "load", no_unpickling)
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*safetensors"):
        load(model_dir)


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nowhere")


# --------------------------------------------------------------------------------------------------
# bad requests and options: the engine stays usable afterwards

def test_prompt_longer_than_context(llm):
    with pytest.raises(RequestError, match=r"40 tokens .* 32"):
        llm.generate([5] * 40, SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="32 tokens"):  # a prompt must leave room for one generated token
        llm.generate([5] * 32, SamplingParams(max_tokens=1))
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    with pytest.raises(RequestError, match=r"max_tokens must be in \[1, 1\]"):  # asked for more than fits
        llm.generate([5] * 31, SamplingParams(temperature=0, max_tokens=4))
    engine = llm.engine  # the engine's own API takes max_tokens as a cap: the context ends the generation
    engine.add_request([5] * 31, SamplingParams(temperature=0, max_tokens=4))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 1


@pytest.mark.parametrize("prompt,bad", [([1, 2, VOCAB], VOCAB), ([1, -1], -1), ([10**9], 10**9), ([1, 1.5], 1.5),
                                        ([True, 2], True)])
def test_token_ids_outside_the_vocabulary(llm, prompt, bad):
    with pytest.raises(RequestError, match=rf"{bad} is outside the vocabulary \[0, {VOCAB}\)"):
        llm.generate(prompt, SamplingParams(max_tokens=1))
    assert not llm.engine.requests


def test_empty_prompt(llm):
    with pytest.raises(RequestError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=1))


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("max_tokens", 0), ("n", 0), ("logprobs", 21), ("stop", [""]), ("stop_token_ids", [-3]),
    ("temperature", "0.5"), ("max_tokens", 2.5), ("top_k", True), ("stop", 5),
])
def test_invalid_sampling_params(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_unknown_engine_option_suggests_the_right_name(base_dir):
    with pytest.raises(ConfigError, match=r"'block_sise' \(did you mean 'block_size'\?\)"):
        load(base_dir, block_sise=8)


@pytest.mark.parametrize("option,value", [("dtype", "float64"), ("device", "tpu"), ("block_size", 0),
                                          ("max_model_len", 1)])
def test_invalid_engine_option_value(base_dir, option, value):
    with pytest.raises(ConfigError, match=option):
        load(base_dir, **{option: value})


def test_cuda_requested_without_cuda(base_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match=r"'cuda'.*CUDA is not available"):
        load(base_dir, device="cuda")


# --------------------------------------------------------------------------------------------------
# weights are memory-mapped, and loading reports its progress

def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges this process has mapped from `path` (Linux /proc/self/maps)."""
    target, ranges = str(path.resolve()), []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_weights_are_views_of_the_file_mapping(llm, base_dir):
    model = llm.engine.executor.model
    ranges = mapped_ranges(base_dir / WEIGHTS)
    assert ranges, "model.safetensors is not memory-mapped"

    def in_mapping(t: torch.Tensor) -> bool:
        start = t.data_ptr()
        return any(lo <= start and start + t.numel() * t.element_size() <= hi for lo, hi in ranges)

    file_tensors = load_file(base_dir / WEIGHTS)
    for weight, name in ((model.embed, "model.embed_tokens.weight"), (model.lm_head, "lm_head.weight"),
                         (model.final_norm, "model.norm.weight")):
        assert in_mapping(weight), f"{name} was copied out of the mapping"
        assert not weight.untyped_storage().resizable()  # borrowed memory, not a tensor torch allocated
        assert torch.equal(weight, file_tensors[name])
    # control: converted to bfloat16, the same weights are copies, and the check above says so
    converted = load(base_dir, dtype="bfloat16", max_model_len=32).engine.executor.model
    assert not in_mapping(converted.embed) and not in_mapping(converted.final_norm)


def test_load_progress_is_monotonic_and_ends_at_total(base_dir, tmp_path):
    # a tied checkpoint that still ships lm_head, plus a rotary buffer: tensors the loader accepts but never reads
    model_dir = tmp_path / "model"
    shutil.copytree(base_dir, model_dir)
    edit_config(model_dir, tie_word_embeddings=True)
    edit_tensors(model_dir, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    for directory in (base_dir, model_dir):
        calls: list[tuple[int, int, str]] = []
        load(directory, progress=lambda done, total, what: calls.append((done, total, what)))
        dones = [done for done, _, _ in calls]
        totals = {total for _, total, _ in calls}
        assert len(totals) == 1 and dones[-1] == totals.pop(), f"progress ended at {calls[-1]}"
        assert all(a < b for a, b in zip(dones, dones[1:])), "progress went backwards or stalled"
        assert len(calls) >= 60 and all(isinstance(what, str) and what for _, _, what in calls)


def test_a_bad_prompt_in_a_batch_leaves_nothing_queued(llm):
    with pytest.raises(RequestError):
        llm.generate([[1, 2, 3], [4, 5], [VOCAB]], SamplingParams(max_tokens=2))
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert llm.stats()["used"] == 0

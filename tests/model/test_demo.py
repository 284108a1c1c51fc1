"""The self-made random Qwen3-MoE demo checkpoint: loads in transformers and tsterm alike, deterministic, cached."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from tsterm import LLM, SamplingParams
from tsterm.convert import demo
from tsterm.convert.demo import SPECS, bytes_read_per_token, checkpoint_bytes, ensure_demo_model, make_random_moe
from tsterm.tokenizer import Tokenizer

from tests.helpers.parity import reference_greedy

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris & Rome?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"temp": 25}'},
    {"role": "assistant", "content": "Paris is 21 degrees, Rome is 25."},
    {"role": "user", "content": [{"type": "text", "text": "Thanks! <think> is literal here."}]},
]


def file_digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_random_moe(tmp_path_factory.mktemp("demo") / "tiny", SPECS["tiny"])


def test_tiny_greedy_matches_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    assert hf_model.config.vocab_size == SPECS["tiny"].vocab_size
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", num_kv_blocks=64)
    prompt = llm.tokenizer.encode("The river came down from the hills, and the experts")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    expected, _ = reference_greedy(hf_model, prompt, 32)
    assert out.token_ids == expected
    assert len(set(expected)) > 4  # the random model is not stuck on one token


def test_chat_template_renders_like_transformers(tiny_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    ours = Tokenizer.from_dir(tiny_dir)
    assert ours.eos_token_ids[0] == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    cases = [(CONVERSATION, TOOLS, {}), (CONVERSATION, None, {}), (CONVERSATION[1:2], None, {"enable_thinking": False})]
    for messages, tools, extra in cases:
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                              tokenize=False, **extra)
            text = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)
            assert text == expected
            assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    text = ours.apply_chat_template(CONVERSATION, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert len(ours.encode(token)) == 1, token


def test_checkpoint_is_deterministic_and_sized_as_computed(tmp_path, tiny_dir):
    again = make_random_moe(tmp_path / "again", SPECS["tiny"])
    assert file_digests(again) == file_digests(tiny_dir)
    from safetensors.torch import load_file

    tensors = load_file(str(again / "model.safetensors"))
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == checkpoint_bytes(SPECS["tiny"])
    assert 1e6 <= checkpoint_bytes(SPECS["tiny"]) <= 3e6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no temp dirs left behind


def test_sharded_checkpoint_loads_to_the_same_model(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setattr(demo, "SHARD_BYTES", 600_000)
    sharded = make_random_moe(tmp_path / "sharded", SPECS["tiny"])
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) >= 3
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = [LLM(str(d), dtype="float32", device="cpu", num_kv_blocks=16).generate([5, 6, 7, 8], params)[0].token_ids
            for d in (tiny_dir, sharded)]
    assert outs[0] == outs[1]


def test_failed_build_leaves_nothing_and_keeps_the_old_checkpoint(tmp_path, tiny_dir):
    def explode(done, total, what):
        if done > total // 2:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        make_random_moe(tmp_path / "broken", SPECS["tiny"], progress=explode)
    assert list(tmp_path.iterdir()) == []
    before = file_digests(tiny_dir)
    with pytest.raises(RuntimeError):
        make_random_moe(tiny_dir, SPECS["tiny"], progress=explode)
    assert file_digests(tiny_dir) == before

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not a model directory"):
        make_random_moe(tmp_path / "notes", SPECS["tiny"])
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"

    seen = []
    make_random_moe(tmp_path / "ok", SPECS["tiny"], progress=lambda d, t, w: seen.append((d, t, w)))
    assert seen[-1][0] == seen[-1][1] == checkpoint_bytes(SPECS["tiny"]) and seen[-1][2] == "lm_head.weight"


def test_the_demo_names_profiles_check_are_the_ones_generated():
    """`tsterm profiles check` knows the `demo:NAME`s without importing the generator (tsterm.paths lists them)."""
    from tsterm.paths import DEMO_MODEL_NAMES

    assert list(DEMO_MODEL_NAMES) == list(SPECS)


def test_ensure_demo_model_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TSTERM_CACHE_DIR", str(tmp_path / "cache"))
    path = ensure_demo_model()
    assert path == tmp_path / "cache" / "models" / "demo-tiny"
    assert (path / "config.json").is_file()
    inode, mtime = path.stat().st_ino, (path / "model.safetensors").stat().st_mtime_ns

    def must_not_build(*args, **kwargs):
        raise AssertionError("rebuilt a complete demo model")

    monkeypatch.setattr(demo, "make_random_moe", must_not_build)
    assert ensure_demo_model("tiny") == path
    assert (path.stat().st_ino, (path / "model.safetensors").stat().st_mtime_ns) == (inode, mtime)
    assert [p.name for p in path.parent.iterdir()] == ["demo-tiny"]


def test_ensure_demo_model_rebuilds_an_incomplete_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("TSTERM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    stale = tmp_path / "xdg" / "tsterm" / "models" / "demo-tiny"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # a half copy without the completion marker
    assert ensure_demo_model("tiny") == stale
    assert demo.is_complete(stale, SPECS["tiny"])
    with pytest.raises(ValueError, match="unknown demo model 'huge'"):
        ensure_demo_model("huge")


def test_bench_spec_is_memory_bound_and_fits():
    bench = SPECS["bench"]
    assert bench.dtype == "float32" and bench.num_experts_per_tok < bench.num_experts
    assert 200e6 <= bytes_read_per_token(bench) <= 300e6
    assert checkpoint_bytes(bench) < 2e9
    # cross-check: everything minus the unused experts and all but one embedding row
    for spec in SPECS.values():
        H, I, item = spec.hidden_size, spec.moe_intermediate_size, 2 if spec.dtype == "bfloat16" else 4
        idle_experts = spec.num_hidden_layers * (spec.num_experts - spec.num_experts_per_tok) * 3 * H * I
        assert bytes_read_per_token(spec) == checkpoint_bytes(spec) - (idle_experts + (spec.vocab_size - 1) * H) * item

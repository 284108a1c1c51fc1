"""The parallel sizes as options: EngineConfig validates them, profiles accept them (file:line on a bad value), and
`tsterm run/chat --tensor-parallel-size/--expert-parallel-size` reach the engine's options. No process starts here."""
from __future__ import annotations

import pytest

from tsterm import launch
from tsterm.cli import build_parser
from tsterm.config import EngineConfig
from tsterm.errors import ConfigError
from tsterm.profiles import load_profile


def test_engine_config_validates_the_sizes():
    config = EngineConfig(model="m", tensor_parallel_size=2, expert_parallel_size=2, distributed_timeout_s=5)
    assert (config.tensor_parallel_size, config.expert_parallel_size) == (2, 2)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer"):
            EngineConfig(model="m", tensor_parallel_size=bad)
    with pytest.raises(ConfigError, match="expert_parallel_size must be an integer"):
        EngineConfig(model="m", expert_parallel_size=0)
    with pytest.raises(ConfigError, match="distributed_timeout_s must be seconds"):
        EngineConfig(model="m", distributed_timeout_s=0)


def test_profiles_take_the_sizes(tmp_path):
    good = tmp_path / "tp.yaml"
    good.write_text("model: some/dir\ntensor_parallel_size: 2\nexpert_parallel_size: 2\ndistributed_timeout_s: 30\n")
    options = load_profile(str(good)).engine_options()
    assert options["tensor_parallel_size"] == 2 and options["expert_parallel_size"] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: some/dir\ntensor_parallel_size: two\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:2"):
        load_profile(str(bad))


@pytest.mark.parametrize("command", ["run", "chat"])
def test_cli_flags_reach_the_engine_options(monkeypatch, command):
    seen = {}
    monkeypatch.setattr(launch, "load_llm", lambda profile, model, **overrides: seen.update(overrides))
    extra = ["--prompt", "hi"] if command == "run" else []
    args = build_parser().parse_args([command, "--model", "m", "--tensor-parallel-size", "2",
                                      "--expert-parallel-size", "3", *extra])
    launch.llm_from_args(args)
    assert seen["tensor_parallel_size"] == 2 and seen["expert_parallel_size"] == 3
    args = build_parser().parse_args([command, "--model", "m", *extra])
    launch.llm_from_args(args)
    assert seen["tensor_parallel_size"] is None  # not given: the profile's value (or 1) stands

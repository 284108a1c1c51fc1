"""A tiny real Qwen3-MoE checkpoint (built once), profiles that point the TUI at it, the snapshot fixture, and the
message hook that the waits of helpers.py wake on."""
from __future__ import annotations

from pathlib import Path

import pytest
from textual.app import App

from tests.helpers.checkpoints import make_checkpoint
from tests.tui.helpers import message_hook
from tests.tui.snapshots import assert_snapshot, update_requested


@pytest.fixture(autouse=True)
def wake_waits_on_messages(monkeypatch):
    """Every app a test runs tells the waits in helpers.py of each message it dispatches (run_test's message_hook)."""
    run_test = App.run_test

    def run_test_with_hook(app, *args, **kwargs):
        return run_test(app, *args, message_hook=message_hook(app), **kwargs)
    monkeypatch.setattr(App, "run_test", run_test_with_hook)


@pytest.fixture(autouse=True)
def engine_in_process(monkeypatch):
    """The TUI's engine runs on a thread of the test's process (tests look inside it, and a core process per app
    would cost every test a start-up); tests/tui/test_tui_engine_process.py runs it in its own."""
    monkeypatch.setenv("TSTERM_ENGINE_PROCESS", "0")


@pytest.fixture
def snapshot(request, tmp_path):
    """`snapshot(app, name, title)`: compare the screen with tests/tui/snapshots/NAME.txt (see snapshots.py)."""
    update = update_requested(request.config)

    def check(app, name: str, title: str) -> None:
        assert_snapshot(app, name, title, tmp_path=tmp_path, update=update)
    return check


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path, _ = make_checkpoint(tmp_path_factory.mktemp("tui") / "qwen3moe", "qwen3_moe",
                              {"num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                               "max_position_embeddings": 2048})
    return path


@pytest.fixture
def data_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TSTERM_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture
def make_profile(tmp_path, tiny_checkpoint):
    def make(max_tokens: int = 12, name: str = "tiny", **extra) -> str:
        lines = [f"model: {tiny_checkpoint}", "device: cpu", "dtype: float32", "block_size: 4",
                 "num_kv_blocks: 1024", "system_prompt: you are a test", "sampling:", "  temperature: 0",
                 f"  max_tokens: {max_tokens}", "  ignore_eos: true"]
        lines += [f"{k}: {v}" for k, v in extra.items()]
        path = tmp_path / f"{name}.yaml"
        path.write_text("\n".join(lines) + "\n")
        return str(path)
    return make


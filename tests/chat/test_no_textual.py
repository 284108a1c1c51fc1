"""The layers below the TUI import without Textual: the GPU machine has no Textual, and the agent loop and the
server use the chat layer and the engine without a terminal UI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BELOW_THE_TUI = ["tsterm.chat", "tsterm.llm", "tsterm.engine.async_engine", "tsterm.cli"]


def test_the_chat_layer_and_the_engine_import_without_textual():
    code = (f"import sys\nfor name in {BELOW_THE_TUI!r}:\n    __import__(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'textual'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

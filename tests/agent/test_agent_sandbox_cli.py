"""`tsterm agent --auto` on the shipped agent-demo model, whose one trained tool (calculator) is here a profile's
command tool: the model's argument is evaluated by a program that runs inside the sandbox (its own PID namespace,
the clean environment), and the answer still comes back end to end."""
from __future__ import annotations

import json
import os
import sys

from tsterm.agent import sandbox
from tsterm.cli import main

# The tool is the model's expression evaluated by Python: code chosen by the model, which is what the sandbox is for.
SCRIPT = ("import os, sys; open('ran.txt', 'w').write(f'{os.getpid()} {sorted(os.environ)}'); "
          "print(eval(sys.argv[1], {}))")


def test_tsterm_agent_auto_runs_a_command_tool_inside_the_sandbox(capsys, tmp_path, monkeypatch):
    assert sandbox.detect_isolation().mechanism is not None, sandbox.detect_isolation().reason
    monkeypatch.setenv("TSTERM_API_KEY", "tsk-9d41c7")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    tool = {"name": "calculator", "description": "Evaluate an arithmetic expression",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]},
            "argv": [os.path.realpath(sys.executable), "-c", SCRIPT, "{expression}"]}
    profile = tmp_path / "calc.yaml"
    profile.write_text(json.dumps({"extends": "agent-demo",
                                   "agent": {"tools": [], "allow_commands": True, "command_tools": [tool]}}))
    code = main(["agent", "--profile", str(profile), "--auto", "--device", "cpu", "--workspace", str(workspace),
                 "--json", "What is 37 * 12?"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 0 and out["reason"] == "answer" and "444" in out["answer"]
    assert f"tsterm: {sandbox.Workspace(workspace).describe()}" in captured.err.splitlines()  # which sandbox
    assert out["steps"][0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "37 * 12"},
                                              "result": "444\n", "error": None}]
    # PID 2 of its own namespace (1 is the sandbox's init), and nothing of our environment but the clean three
    assert (workspace / "ran.txt").read_text() == "2 ['HOME', 'LANG', 'PATH']"


def test_without_namespaces_the_command_tool_is_refused_and_the_model_is_told(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "detect_isolation", lambda: sandbox.Isolation(None, "no user namespaces here"))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    tool = {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                 "required": ["expression"]},
            "argv": [os.path.realpath(sys.executable), "-c", SCRIPT, "{expression}"]}
    profile = tmp_path / "calc.yaml"
    profile.write_text(json.dumps({"extends": "agent-demo",
                                   "agent": {"tools": [], "allow_commands": True, "command_tools": [tool]}}))
    main(["agent", "--profile", str(profile), "--auto", "--device", "cpu", "--workspace", str(workspace), "--json",
          "What is 37 * 12?"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "tsterm: sandbox: unavailable (no user namespaces here) - write and command tools are refused" in \
        captured.err.splitlines()
    error = out["steps"][0]["tool_calls"][0]["error"]
    assert "refused" in error and "no user namespaces here" in error and "sandbox: none" in error
    assert not (workspace / "ran.txt").exists()

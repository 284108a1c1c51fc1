"""A profile's agent section -> a session's tools: defaults, the enabling switches, command tools, clear errors."""
from __future__ import annotations

import sys
import textwrap

import pytest

from tsterm.agent.toolset import build_toolset, check_toolset
from tsterm.cli import main
from tsterm.errors import ConfigError
from tsterm.profiles import AgentSettings, load_profile

ECHO = {"name": "echo", "description": "print words", "argv": ["echo", "{words}"],
        "parameters": {"type": "object", "properties": {"words": {"type": "string"}}, "required": ["words"]}}


def names(settings: AgentSettings, workspace) -> list[str]:
    with build_toolset(settings, workspace) as toolset:
        return [tool.name for tool in toolset.tools]


def test_defaults_and_switches(tmp_path):
    assert names(AgentSettings(), tmp_path) == ["calculator", "read_file", "list_dir", "grep"]
    assert names(AgentSettings(allow_write=True, allow_commands=True), tmp_path)[-2:] == ["write_file", "run_command"]
    assert names(AgentSettings(tools=["calculator"]), tmp_path) == ["calculator"]
    assert names(AgentSettings(tools=[], command_tools=[ECHO]), tmp_path) == ["echo"]


def test_the_workspace_argument_wins_and_confines_the_tools(tmp_path, monkeypatch):
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "a.txt").write_text("hello")
    (tmp_path / "secret.txt").write_text("no")
    monkeypatch.chdir(tmp_path)
    with build_toolset(AgentSettings(workspace="elsewhere-not-used"), "inside") as toolset:
        read = {tool.name: tool for tool in toolset.tools}["read_file"]
        assert toolset.workspace.root == (tmp_path / "inside").resolve()
        assert read.call({"path": "a.txt"}).content.endswith("hello")
        assert "leaves the workspace" in read.call({"path": "../secret.txt"}).error


@pytest.mark.parametrize("settings, workspace, match", [
    (AgentSettings(), "/no/such/dir", "agent workspace: workspace root '/no/such/dir' is not a directory"),
    (AgentSettings(command_tools=[{**ECHO, "argv": []}]), None, r"agent.command_tools\[0\] 'echo': 'argv'"),
    (AgentSettings(command_tools=[{**ECHO, "name": "calculator"}]), None, r"\['calculator'\] offered twice"),
])
def test_bad_settings_name_the_entry(tmp_path, settings, workspace, match):
    with pytest.raises(ConfigError, match=match):
        build_toolset(settings, workspace or tmp_path)


def test_profiles_inherit_the_agent_section_and_check_its_tools(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "base.yaml").write_text(textwrap.dedent("""
        model: moe-demo
        agent:
          max_steps: 3
          allow_write: true
    """))
    (tmp_path / "profiles" / "child.yaml").write_text(textwrap.dedent(f"""
        extends: base
        agent:
          auto_approve: true
          command_tools:
            - {{name: py, description: run python, argv: [{sys.executable}, "{{script}}"], cwd: missing,
                parameters: {{type: object, properties: {{script: {{type: string}}}}, required: [script]}}}}
    """))
    settings = load_profile("child").agent_settings()
    assert (settings.max_steps, settings.allow_write, settings.auto_approve) == (3, True, True)
    assert settings.loop_options(max_steps=5).max_steps == 5 and settings.loop_options().auto_approve
    with pytest.raises(ConfigError, match=r"command_tools\[0\] 'py': 'cwd'"):
        check_toolset(settings)
    assert main(["profiles", "check", "child"]) == 2
    assert "'cwd'" in capsys.readouterr().err
    (tmp_path / "missing").mkdir()
    assert main(["profiles", "check", "child"]) == 0


async def test_a_profile_mcp_server_offers_its_tools_to_the_agent_loop(tmp_path):
    """Profile mapping -> a real stdio MCP server process -> its tools in the loop's prompt and calls."""
    import json
    from pathlib import Path

    from tests.agent.scripted import ScriptedBackend
    from tsterm.agent.loop import Agent, AgentFinished, AgentOptions
    from tsterm.tokenizer import Tokenizer

    server = str(Path(__file__).with_name("mcp_echo_server.py"))
    settings = AgentSettings(tools=["calculator"], mcp_servers=[
        {"name": "echo", "command": sys.executable, "args": [server], "approve": "never"}])
    tokenizer = Tokenizer.from_dir(Path(__file__).resolve().parents[2] / "tsterm" / "models" / "moe_demo")
    call = "<tool_call>\n" + json.dumps({"name": "add", "arguments": {"a": 20, "b": 22}}) + "\n</tool_call>"
    with build_toolset(settings, tmp_path) as toolset:
        assert {"calculator", "add", "echo"} <= {tool.name for tool in toolset.tools}
        backend = ScriptedBackend(tokenizer, [call, "42"])
        agent = Agent(backend, tokenizer, toolset.tools, options=AgentOptions(tool_timeout_s=30))
        events = [event async for event in agent.run("add 20 and 22")]
    assert events[-1] == AgentFinished("42", "answer", 2)
    assert agent.steps[0].tool_calls[0].result == "42"
    first_prompt = tokenizer.decode(backend.prompts[0], skip_special_tokens=False)
    assert '"name": "add"' in first_prompt and '"name": "calculator"' in first_prompt  # offered like the built-ins
    assert "<tool_response>\n42\n</tool_response>" in tokenizer.decode(backend.prompts[1], skip_special_tokens=False)


def test_the_profile_chooses_the_sandbox_and_the_toolset_says_which_is_in_use(tmp_path, monkeypatch):
    from tsterm.agent import sandbox

    settings = AgentSettings(allow_commands=True)
    assert (settings.sandbox, settings.network) == ("namespaces", False)
    with build_toolset(settings, tmp_path) as toolset:
        assert (toolset.workspace.sandbox, toolset.workspace.network) == ("namespaces", False)
        assert toolset.sandbox.startswith("sandbox: Linux namespaces") and "network off" in toolset.sandbox
    with build_toolset(AgentSettings(allow_commands=True, network=True), tmp_path) as toolset:
        assert "network on" in toolset.sandbox
    with build_toolset(AgentSettings(), tmp_path) as toolset:  # read-only tools: nothing to confine
        assert toolset.sandbox == "sandbox: not needed (no write or command tools)"
    monkeypatch.setattr(sandbox, "detect_isolation", lambda: sandbox.Isolation(None, "no user namespaces"))
    with build_toolset(settings, tmp_path) as toolset:
        assert toolset.sandbox == "sandbox: unavailable (no user namespaces) - write and command tools are refused"
        run = next(tool for tool in toolset.tools if tool.name == "run_command")
        assert "refused" in run.call({"argv": ["true"]}).error
    with build_toolset(AgentSettings(allow_commands=True, sandbox="none"), tmp_path) as toolset:
        assert toolset.sandbox.startswith("sandbox: none")
        run = next(tool for tool in toolset.tools if tool.name == "run_command")
        assert run.call({"argv": ["true"]}).ok


@pytest.mark.parametrize("overrides, message", [({"sandbox": "bwrap"}, "sandbox must be 'namespaces' or 'none'"),
                                                ({"sandbox": None}, "sandbox must be"),
                                                ({"network": "yes"}, "network must be true or false")])
def test_bad_sandbox_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        AgentSettings(**overrides)


def test_a_profile_sets_the_sandbox_limits(tmp_path):
    import dataclasses

    from tsterm.agent.sandbox import Limits
    from tsterm.profiles import SANDBOX_LIMIT_NAMES

    assert SANDBOX_LIMIT_NAMES == tuple(field.name for field in dataclasses.fields(Limits))
    settings = AgentSettings(allow_commands=True, sandbox_limits={"processes": 8, "file_size_bytes": 4096})
    with build_toolset(settings, tmp_path) as toolset:
        assert toolset.workspace.limits == Limits(processes=8, file_size_bytes=4096)
        run = next(tool for tool in toolset.tools if tool.name == "run_command")
        result = run.call({"argv": ["sh", "-c", "head -c 100000 /dev/zero > big"]})
        assert result.error == "sh: exited with status 153" and (tmp_path / "big").stat().st_size == 4096
    for limits, message in [({"procs": 1}, "sandbox_limits: unknown limit 'procs'"),
                            ({"cpu_s": 0}, "sandbox_limits.cpu_s must be a positive integer"),
                            ({"cpu_s": True}, "sandbox_limits.cpu_s must be"),
                            ([], "sandbox_limits must be a mapping")]:
        with pytest.raises(ConfigError, match=message):
            AgentSettings(sandbox_limits=limits)

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

"""A session's tools from a profile's `agent:` section: the built-ins it enables, its command tools and the tools of
its MCP servers (started here, closed with the tool set)."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tsterm.agent.sandbox import Limits, SandboxError, Workspace
from tsterm.agent.tools import (Calculator, CommandTool, Grep, ListDir, ReadFile, RunCommand, Tool, WriteFile)
from tsterm.errors import ConfigError
from tsterm.profiles import AgentSettings

DEFAULT_TOOLS = ("calculator", "read_file", "list_dir", "grep")


class ToolSet:
    """The tools one agent session offers, and the MCP servers behind some of them (`close` stops those).

    `sandbox` is the one line that says how its commands are confined (Workspace.describe): which mechanism is in
    use, or that write and command tools are refused, or that the profile turned the sandbox off."""

    def __init__(self, workspace: Workspace, tools: Sequence[Tool], servers: Sequence = ()):
        self.workspace, self.tools, self.servers = workspace, list(tools), list(servers)
        self.sandbox = workspace.describe() if any(tool.needs_approval for tool in self.tools) else \
            "sandbox: not needed (no write or command tools)"
        names = [tool.name for tool in self.tools]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            self.close()
            raise ConfigError(f"tool name(s) {duplicated} offered twice (built-ins, command_tools and MCP servers "
                              "share one namespace): rename one")

    def close(self) -> None:
        """Stop the MCP servers (blocking, about a second at most each, in parallel: not on a UI's event loop)."""
        if self.servers:
            from tsterm.agent.mcp_tools import close_mcp_servers

            close_mcp_servers(self.servers)
        self.servers = []

    def __enter__(self) -> ToolSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_workspace(path: str | os.PathLike, settings: AgentSettings | None = None) -> Workspace:
    """The workspace at `path`, confined as `settings` (the profile's agent section) says: by default commands
    run in the namespace sandbox with the network off."""
    settings = settings or AgentSettings()
    try:
        return Workspace(Path(os.path.expanduser(os.fspath(path))), sandbox=settings.sandbox,
                         network=settings.network, limits=Limits(**settings.sandbox_limits))
    except SandboxError as err:
        raise ConfigError(f"agent workspace: {err}") from None


def builtin(name: str, workspace: Workspace) -> Tool:
    tools = {"calculator": Calculator, "read_file": ReadFile, "list_dir": ListDir, "grep": Grep,
             "write_file": WriteFile, "run_command": RunCommand}
    return tools[name]() if name == "calculator" else tools[name](workspace)


def _declared(settings: AgentSettings, workspace: str | os.PathLike | None, where: str):
    """The workspace, the built-in and command tools, and the checked MCP server configs (nothing started)."""
    root = open_workspace(workspace if workspace is not None else settings.workspace, settings)
    names = list(settings.tools) if settings.tools is not None else [
        *DEFAULT_TOOLS, *(["write_file"] if settings.allow_write else []),
        *(["run_command"] if settings.allow_commands else [])]
    tools: list[Tool] = [builtin(name, root) for name in names]
    for i, data in enumerate(settings.command_tools):
        tools.append(CommandTool.from_dict(data, root, where=f"{where}.command_tools[{i}]"))
    configs = []
    if settings.mcp_servers:  # the mcp SDK is imported only by sessions that use it
        from tsterm.agent.mcp_tools import McpServerConfig

        configs = [McpServerConfig.from_dict(data, where=f"{where}.mcp_servers[{i}]")
                   for i, data in enumerate(settings.mcp_servers)]
    return root, tools, configs


def check_toolset(settings: AgentSettings, workspace: str | os.PathLike | None = None, *,
                  where: str = "agent") -> None:
    """Everything build_toolset checks, without starting an MCP server (`tsterm profiles check`)."""
    _declared(settings, workspace, where)


def build_toolset(settings: AgentSettings, workspace: str | os.PathLike | None = None, *,
                  where: str = "agent") -> ToolSet:
    """Every tool `settings` declares, in the order: built-ins, command tools, MCP servers' tools. MCP servers are
    started (and stopped again if anything else fails). ConfigError names `where` and the bad entry."""
    root, tools, configs = _declared(settings, workspace, where)
    servers = []
    if configs:
        from tsterm.agent.mcp_tools import start_mcp_servers

        servers = start_mcp_servers(configs, root)
        for server in servers:
            tools.extend(server.tools())
    return ToolSet(root, tools, servers)

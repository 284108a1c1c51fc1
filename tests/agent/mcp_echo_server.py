"""A small stdio MCP server for tests/agent/test_mcp.py, run as `python mcp_echo_server.py`.

It lists its tools two per page, so a client that ignores nextCursor misses most of them.
"""
from __future__ import annotations

import os

import anyio

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image
from mcp.types import ListToolsResult, ToolAnnotations

PAGE_SIZE = 2


class PagedServer(MCPServer):
    async def _handle_list_tools(self, ctx, params):  # the SDK's own handler answers everything on one page
        tools = await self.list_tools()
        start = int(params.cursor) if params is not None and params.cursor else 0
        end = start + PAGE_SIZE
        return ListToolsResult(tools=tools[start:end], next_cursor=str(end) if end < len(tools) else None)


server = PagedServer("echo", log_level="WARNING")


@server.tool(description="Add two integers.")
def add(a: int, b: int) -> str:
    return str(a + b)


@server.tool(description="Say the text back.", annotations=ToolAnnotations(read_only_hint=True))
def echo(text: str) -> str:
    return text


@server.tool(description="One environment variable of the server process, or '<unset>'.",
             annotations=ToolAnnotations(read_only_hint=True))
def env(name: str) -> str:
    return os.environ.get(name, "<unset>")


@server.tool(description="The names of the server's environment variables, comma-separated.")
def environ() -> str:
    return ",".join(sorted(os.environ))


@server.tool(description="The server's process id and working directory.")
def whoami() -> str:
    return f"{os.getpid()} {os.getcwd()}"


@server.tool(description="Sleep, then answer.", annotations=ToolAnnotations(read_only_hint=False))
async def slow(seconds: float) -> str:
    await anyio.sleep(seconds)  # a client's cancellation interrupts it
    return f"slept {seconds}"


@server.tool(description="Always fails.")
def fail() -> str:
    raise ToolError("this tool always fails")


@server.tool(description="Exit the server process at once with status 3.")
def crash() -> str:
    os._exit(3)


@server.tool(description="A tiny PNG image and a caption.")
def picture() -> list:
    return ["a picture:", Image(data=b"\x89PNG\r\n\x1a\n" + bytes(92), format="png")]


if __name__ == "__main__":
    server.run("stdio")

"""MCP tools: a profile names stdio MCP servers, and the tools they list are offered to the model like the built-ins.

Each McpServer runs the SDK's stdio client and session on an asyncio loop of its own, in a daemon thread: the agent
loop calls tools from worker threads and the TUI has its own loop, so calls cross over with
run_coroutine_threadsafe and every wait on the other side has a timeout. The server process gets the workspace's
clean environment plus the profile's `env`, nothing else of ours, and runs in a workspace directory.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import mcp.types as mcp_types
from jsonschema.exceptions import best_match
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError
from referencing.exceptions import Unresolvable

from tsterm.agent.sandbox import DEFAULT_MAX_OUTPUT_BYTES, SandboxError, Workspace
from tsterm.agent.tools import Tool, ToolError
from tsterm.errors import ConfigError, TstermError

APPROVE_MODES = ("auto", "always", "never")
_SERVER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")  # what the chat templates accept as a function name
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SERVER_KEYS = {"name", "command", "args", "env", "cwd", "timeout_s", "startup_timeout_s", "approve", "prefix",
                "max_output_bytes", "sandbox"}
# The server runs under this small supervisor (`python -I -S -c`, argv: the names to keep, then the server's argv).
# The SDK's stdio client always adds some of our variables (HOME, PATH, SHELL, TERM, USER...) to the child's
# environment: the supervisor keeps only the names we built, so values travel in the environment, never on a
# command line. It waits for the server and writes how it ended to stderr, which the stdio client does not tell.
# It ignores SIGTERM (the server, in the same process group, gets it too) so that it outlives the server and reaps it.
_SUPERVISOR = """
import os, signal, sys
keep = set(sys.argv[1].split(","))
env = {key: value for key, value in os.environ.items() if key in keep}
argv = sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execve(argv[0], argv, env)
    except OSError as err:
        os.write(2, f"cannot run {argv[0]}: {err.strerror}\\n".encode())
    os._exit(127)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.close(0)
os.close(1)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
how = f"exited with status {code}"
if code < 0:
    try:
        how = f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        how = f"was killed by signal {-code}"
os.write(2, f"\\n[mcp server {how}]\\n".encode())
os._exit(code if code >= 0 else 128 - code)
"""
_EXIT_MARK = re.compile(r"\[mcp server (exited with status -?\d+|was killed by [\w ]+)\]\s*$")
# The SDK's shutdown: close stdin, 2 s, SIGTERM to the group, 2 s, SIGKILL, 2 s. Waits for it get this much.
_SHUTDOWN_GRACE_S = 10.0
_STDERR_TAIL_BYTES = 2000
_MAX_LIST_PAGES = 1000
_CLOSED = "it was closed"


class McpError(TstermError):
    """An MCP server that cannot be used: it does not start, does not answer the handshake, or clashes."""


@dataclass(frozen=True)
class McpServerConfig:
    """One `mcp_servers` entry of a profile."""

    name: str
    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the workspace's clean environment
    cwd: str = "."  # workspace-relative
    timeout_s: float = 60.0  # per tool call
    startup_timeout_s: float = 30.0  # launch, handshake and tool listing
    # always (and auto, the same): ask before every call - a server's readOnlyHint is its own claim, not a proof;
    # never: the profile trusts this server, its tools run without asking
    approve: str = "always"
    prefix: str = ""  # put before every tool name, to keep two servers' (or a built-in's) names apart
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    # run the server in the workspace's sandbox (sandbox.py): it sees the system directories, this interpreter's
    # installation and the workspace, no network unless agent.network. Off by default: most servers run from the
    # user's home (npx, uvx) and need the network
    sandbox: bool = False

    @classmethod
    def from_dict(cls, data: Any, where: str = "mcp server") -> McpServerConfig:
        """Validate a profile mapping; ConfigError names `where`, the server and the key."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: an mcp server must be a mapping, got {data!r}")
        name = data.get("name")
        if not isinstance(name, str) or not _SERVER_NAME.fullmatch(name):
            raise ConfigError(f"{where}: 'name' must be letters, digits, '_' or '-' (at most 64), got {name!r}")
        where = f"{where} {name!r}"
        unknown = sorted(set(data) - _SERVER_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_SERVER_KEYS)}")
        command = data.get("command")
        if not isinstance(command, str) or not command or "\x00" in command:
            raise ConfigError(f"{where}: 'command' must be a non-empty string (a program), got {command!r}")
        args = data.get("args", [])
        if not isinstance(args, list) or not all(isinstance(arg, str) and "\x00" not in arg for arg in args):
            raise ConfigError(f"{where}: 'args' must be a list of strings, got {args!r}")
        env = data.get("env", {})
        if not isinstance(env, dict):
            raise ConfigError(f"{where}: 'env' must be a mapping of variable names to strings, got {env!r}")
        for key, value in env.items():
            if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
                raise ConfigError(f"{where}: 'env' names must be letters, digits and '_', got {key!r}")
            if not isinstance(value, str) or "\x00" in value:
                raise ConfigError(f"{where}: 'env' value of {key!r} must be a string, got {value!r}")
        cwd = data.get("cwd", ".")
        if not isinstance(cwd, str) or not cwd or "\x00" in cwd or os.path.isabs(cwd) or cwd.startswith("~"):
            raise ConfigError(f"{where}: 'cwd' must be a path relative to the workspace root, got {cwd!r}")
        timeout_s = _seconds(data, "timeout_s", 60.0, where)
        startup_timeout_s = _seconds(data, "startup_timeout_s", 30.0, where)
        approve = data.get("approve", "always")
        if approve not in APPROVE_MODES:
            raise ConfigError(f"{where}: 'approve' must be one of {list(APPROVE_MODES)}, got {approve!r}")
        prefix = data.get("prefix", "")
        if not isinstance(prefix, str) or (prefix and not _TOOL_NAME.fullmatch(prefix)):
            raise ConfigError(f"{where}: 'prefix' must be letters, digits, '_' or '-', got {prefix!r}")
        max_output_bytes = data.get("max_output_bytes", DEFAULT_MAX_OUTPUT_BYTES)
        if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int) or max_output_bytes <= 0:
            raise ConfigError(f"{where}: 'max_output_bytes' must be a positive integer, got {max_output_bytes!r}")
        sandbox = data.get("sandbox", False)
        if not isinstance(sandbox, bool):
            raise ConfigError(f"{where}: 'sandbox' must be true or false, got {sandbox!r}")
        return cls(name=name, command=command, args=list(args), env=dict(env), cwd=cwd, timeout_s=timeout_s,
                   startup_timeout_s=startup_timeout_s, approve=approve, prefix=prefix,
                   max_output_bytes=max_output_bytes, sandbox=sandbox)


def _seconds(data: dict, key: str, default: float, where: str) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
        raise ConfigError(f"{where}: {key!r} must be a number of seconds in (0, 3600], got {value!r}")
    return float(value)


class McpServer:
    """One running stdio MCP server: start() launches it and lists its tools, close() stops it for good.

    Usable as a context manager. After the server dies, its tools answer with an error result at once.
    """

    def __init__(self, config: McpServerConfig, workspace: Workspace):
        self.config, self.workspace = config, workspace
        self._tools: list[McpTool] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: ClientSession | None = None
        self._stop: asyncio.Event | None = None
        self._stderr = None  # a temporary file: the server's stderr, for the tail in error messages
        self._gone: str | None = None  # why the server cannot be called any more
        self._main_task: asyncio.Task | None = None
        self._last_stderr = ""
        self._lock = threading.Lock()
        self._cleanup = None  # a sandboxed server's: removes its mount point and cgroup once it has exited

    def __repr__(self) -> str:
        return f"McpServer({self.config.name!r})"

    def __enter__(self) -> McpServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def running(self) -> bool:
        return self._gone is None and self._thread is not None and self._thread.is_alive()

    # ---- lifecycle

    def start(self) -> McpServer:
        """Launch the server, do the handshake and list all its tools; McpError (server stopped) if that fails."""
        with self._lock:
            if self._thread is not None or self._gone is not None:
                raise McpError(f"mcp server {self.name!r}: start() was already called, or close()")
            params = self._parameters()
            self._stderr = tempfile.TemporaryFile(mode="w+b", prefix=f"tsterm-mcp-{self.name}-")
            self._loop = asyncio.new_event_loop()
            self._stop = asyncio.Event()  # bound to the loop at its first wait, in the thread
            ready: concurrent.futures.Future = concurrent.futures.Future()
            self._thread = threading.Thread(target=self._thread_main, args=(params, ready), daemon=True,
                                            name=f"mcp-{self.name}")
            self._thread.start()
        try:
            listed = ready.result(timeout=self.config.startup_timeout_s + _SHUTDOWN_GRACE_S)
        except (Exception, asyncio.CancelledError) as err:  # cancelled: close() from another thread meanwhile
            self.close()  # first: the stderr tail is complete once the process is gone
            reason = _describe_startup_error(err, self.config, self.exit_status())
            raise McpError(f"mcp server {self.name!r} did not start: {reason}{self.stderr_tail()}") from None
        except BaseException:
            self.close()
            raise
        try:
            self._tools = self._make_tools(listed)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Shut the session down and make sure the process is gone; idempotent, bounded in time."""
        with self._lock:
            if self._gone is None:
                self._gone = _CLOSED
            thread, loop = self._thread, self._loop
        if thread is None:
            return
        self._request_stop()
        if thread is not threading.current_thread():
            thread.join(timeout=_SHUTDOWN_GRACE_S)

    def _request_stop(self) -> None:
        """From any thread: end the session (the SDK then stops the process); a startup still running is cancelled."""
        def stop() -> None:
            self._stop.set()
            if self._session is None and self._main_task is not None:
                self._main_task.cancel()

        try:
            self._loop.call_soon_threadsafe(stop)
        except RuntimeError:  # the loop has finished already
            pass

    def stderr_tail(self) -> str:
        """The end of what the server wrote to stderr, as a suffix for messages ('' if nothing)."""
        text = _EXIT_MARK.sub("", self._stderr_text()).strip()
        return f"; its stderr ends with:\n{text}" if text else ""

    def exit_status(self) -> str | None:
        """How the server process ended ('exited with status 3', 'was killed by SIGKILL'); None while it runs."""
        match = _EXIT_MARK.search(self._stderr_text())
        return match.group(1) if match else None

    def _stderr_text(self) -> str:
        stderr = self._stderr
        return self._last_stderr if stderr is None or stderr.closed else self._read_stderr_tail()

    def _read_stderr_tail(self) -> str:
        try:
            fd = self._stderr.fileno()
            size = os.fstat(fd).st_size
            data = os.pread(fd, _STDERR_TAIL_BYTES, max(0, size - _STDERR_TAIL_BYTES))
        except (OSError, ValueError):  # ValueError: closed meanwhile
            return self._last_stderr
        return data.decode("utf-8", errors="replace")

    def tools(self) -> list[McpTool]:
        return list(self._tools)

    def _parameters(self) -> StdioServerParameters:
        config = self.config
        try:
            workdir = self.workspace.resolve(config.cwd, strict=True)
        except SandboxError as err:
            raise McpError(f"mcp server {self.name!r}: 'cwd': {err}") from None
        if not workdir.is_dir():
            raise McpError(f"mcp server {self.name!r}: 'cwd' {config.cwd!r} is not a directory")
        env = self.workspace.environment() | config.env
        program = _find_program(config.command, env.get("PATH", ""), workdir)
        if program is None:
            raise McpError(f"mcp server {self.name!r}: cannot run {config.command!r}: not found or not executable "
                           f"(PATH is {env.get('PATH', '')!r})")
        argv = [sys.executable, "-I", "-S", "-c", _SUPERVISOR, ",".join(env), program, *config.args]
        if config.sandbox:
            try:
                self.workspace.require_confinement(f"mcp server {self.name!r}")
            except SandboxError as err:
                raise McpError(str(err)) from None
            argv, self._cleanup = self.workspace.confined_command(argv, workdir, env)
        return StdioServerParameters(command=argv[0], args=argv[1:], env=env, cwd=workdir)

    def _thread_main(self, params: StdioServerParameters, ready: concurrent.futures.Future) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(params, ready))
        except BaseException as err:  # not expected: _serve keeps its errors; still, never leave start() waiting
            if not ready.done():
                ready.set_exception(err)
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
            self._last_stderr = self._read_stderr_tail()  # the process is gone: keep what it said, drop the file
            self._stderr.close()
            if self._cleanup is not None:
                self._cleanup()

    async def _serve(self, params: StdioServerParameters, ready: concurrent.futures.Future) -> None:
        self._main_task = asyncio.current_task()
        try:
            async with stdio_client(params, errlog=self._stderr) as (read_stream, write_stream):
                async with ClientSession(read_stream, write_stream) as session:
                    with anyio.fail_after(self.config.startup_timeout_s):
                        await session.initialize()
                        listed = await _list_all_tools(session)
                    self._session = session
                    if ready.set_running_or_notify_cancel():
                        ready.set_result(listed)
                    await self._stop.wait()
        except BaseException as err:  # noqa: BLE001 - handed to start(), or the end of a session that ran
            if not ready.done():
                ready.set_exception(_unwrap(err))
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
        finally:
            self._session = None
            with self._lock:
                if self._gone is None:
                    self._gone = "its session ended"

    def _make_tools(self, listed: list[mcp_types.Tool]) -> list[McpTool]:
        tools, seen = [], set()
        for tool in listed:
            name = self.config.prefix + tool.name
            if not _TOOL_NAME.fullmatch(name):
                raise McpError(f"mcp server {self.name!r}: tool name {name!r} is not usable as a function name "
                               f"(letters, digits, '_' or '-', at most 64)")
            if name in seen:
                raise McpError(f"mcp server {self.name!r} lists the tool {name!r} twice")
            seen.add(name)
            tools.append(McpTool(self, tool))
        return tools

    # ---- calls

    def call_tool(self, tool: str, arguments: dict) -> mcp_types.CallToolResult:
        """Call a tool by its server-side name; ToolError for a timeout, a dead server or a protocol error."""
        timeout_s = self.config.timeout_s
        with self._lock:
            gone, session, loop = self._gone, self._session, self._loop
        if gone is not None or session is None or loop is None:
            raise ToolError(self._gone_message(gone or "it is not running"))
        coroutine = session.call_tool(tool, arguments, read_timeout_seconds=timeout_s)
        try:
            future = asyncio.run_coroutine_threadsafe(coroutine, loop)
        except RuntimeError:  # the loop has closed under us
            coroutine.close()
            raise ToolError(self._gone_message("its event loop has stopped")) from None
        try:
            return future.result(timeout=timeout_s + _SHUTDOWN_GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolError(f"{tool}: timed out after {timeout_s:g} s (mcp server {self.name!r})") from None
        except concurrent.futures.CancelledError:
            raise ToolError(self._gone_message("the call was cancelled by its shutdown")) from None
        except MCPError as err:
            if err.code == mcp_types.REQUEST_TIMEOUT:
                raise ToolError(f"{tool}: timed out after {timeout_s:g} s (mcp server {self.name!r})") from None
            if err.code == mcp_types.CONNECTION_CLOSED:
                raise ToolError(self._gone_message(self._lost())) from None
            raise ToolError(f"{tool}: mcp server {self.name!r} answered with an error: {err.message}") from None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, EOFError):
            raise ToolError(self._gone_message(self._lost())) from None
        except Exception as err:  # a malformed result, a structured result off its own schema
            raise ToolError(f"{tool}: mcp server {self.name!r}: {type(err).__name__}: {err}") from None

    def _lost(self) -> str:
        """The connection closed under a call: wind the session down (the SDK stops and reaps the process, bounded
        in time) and remember how the process ended. Returns why the server is gone."""
        self._request_stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=_SHUTDOWN_GRACE_S)
        status = self.exit_status()
        reason = f"it {status}" if status else "its connection closed (the process exited or closed its output)"
        with self._lock:
            if self._gone is None or self._gone == "its session ended":
                self._gone = reason
            return self._gone

    def _gone_message(self, reason: str | None) -> str:
        tail = "" if reason == _CLOSED else self.stderr_tail()  # the tail may tell why it died, not why we closed it
        return f"mcp server {self.name!r} is not running: {reason}{tail}"


async def _list_all_tools(session: ClientSession) -> list[mcp_types.Tool]:
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(_MAX_LIST_PAGES):
        params = mcp_types.PaginatedRequestParams(cursor=cursor) if cursor is not None else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools
    raise McpError(f"the tool listing did not end after {_MAX_LIST_PAGES} pages")


def _find_program(command: str, path: str, workdir: Path) -> str | None:
    """The absolute program a command names: a path (relative to the server's cwd) or a name looked up on PATH."""
    if os.sep in command:
        candidate = Path(command) if os.path.isabs(command) else workdir / command
        return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None
    found = shutil.which(command, path=path)
    return os.path.abspath(found) if found else None


def _unwrap(err: BaseException) -> BaseException:
    """The first real error inside task-group exception groups (duck-typed: a backport's group on Python 3.10)."""
    while isinstance(getattr(err, "exceptions", None), tuple) and err.exceptions:
        err = err.exceptions[0]
    return err


def _describe_startup_error(err: BaseException, config: McpServerConfig, exit_status: str | None) -> str:
    err = _unwrap(err)
    if isinstance(err, (TimeoutError, concurrent.futures.TimeoutError)):
        return f"no answer to the MCP handshake and tool listing within {config.startup_timeout_s:g} s"
    if isinstance(err, MCPError) and err.code == mcp_types.CONNECTION_CLOSED:
        return f"it {exit_status or 'exited (or closed its output)'} before the handshake finished"
    if isinstance(err, OSError):
        return f"cannot launch it: {err.strerror or err}"
    if isinstance(err, asyncio.CancelledError):
        return "it was closed while starting"
    if isinstance(err, McpError):
        return str(err)
    return f"{type(err).__name__}: {err}"


class McpTool(Tool):
    """A tool an MCP server lists, called on that server. Arguments are checked with full JSON schema."""

    def __init__(self, server: McpServer, tool: mcp_types.Tool):
        self.server, self.remote_name = server, tool.name
        self.name = server.config.prefix + tool.name
        self.description = tool.description or tool.title or ""
        self.parameters = dict(tool.input_schema)
        self.annotations = tool.annotations
        # Only the profile can say a server is trusted (approve: never); the tool's own readOnlyHint cannot: a
        # server the model can reach may be hostile, or tricked, whatever it declares.
        self.needs_approval = server.config.approve != "never"
        validator_class = jsonschema.validators.validator_for(self.parameters,
                                                              default=jsonschema.Draft202012Validator)
        try:
            validator_class.check_schema(self.parameters)
        except jsonschema.SchemaError as err:
            raise McpError(f"mcp server {server.name!r}: tool {tool.name!r} has an invalid input schema: "
                           f"{err.message}") from None
        self._validator = validator_class(self.parameters)

    def check_arguments(self, arguments: Any) -> None:
        if not isinstance(arguments, dict):
            raise ToolError(f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}")
        try:
            error = best_match(self._validator.iter_errors(arguments))
        except Unresolvable as err:
            raise ToolError(f"{self.name}: the tool's schema has a reference that cannot be resolved: {err}") from None
        if error is not None:
            where = "".join(f"[{part!r}]" for part in error.absolute_path)
            raise ToolError(f"{self.name}: invalid arguments{' at ' + where if where else ''}: {error.message}")

    def run(self, arguments: dict) -> str:
        result = self.server.call_tool(self.remote_name, arguments)
        text = _cap(_render_content(result), self.server.config.max_output_bytes)
        if result.is_error:
            raise ToolError(f"{self.name}: {text or 'the tool reported an error without a message'}")
        return text


def _render_content(result: mcp_types.CallToolResult) -> str:
    parts = [_render_block(block) for block in result.content]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _render_block(block: Any) -> str:
    if isinstance(block, mcp_types.TextContent):
        return block.text
    if isinstance(block, (mcp_types.ImageContent, mcp_types.AudioContent)):
        return f"[{block.mime_type} content, {_base64_size(block.data)} bytes]"
    if isinstance(block, mcp_types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, mcp_types.TextResourceContents):
            return f"[resource {resource.uri}]\n{resource.text}"
        return f"[resource {resource.uri}: {resource.mime_type or 'binary'} content, " \
               f"{_base64_size(resource.blob)} bytes]"
    if isinstance(block, mcp_types.ResourceLink):
        return f"[resource link {block.uri}{': ' + block.description if block.description else ''}]"
    return f"[{getattr(block, 'type', type(block).__name__)} content]"


def _base64_size(data: str) -> int:
    """The decoded size of base64 text, without decoding it."""
    data = data.strip()
    padding = len(data) - len(data.rstrip("="))
    return max(0, len(data) * 3 // 4 - padding)


def _cap(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", errors="ignore")
    return f"{kept}\n[mcp: output cut at {limit} of {len(data)} bytes]"


def start_mcp_servers(configs: Iterable[McpServerConfig], workspace: Workspace) -> list[McpServer]:
    """Start every server (side by side: each start waits on its own process); if one fails, or two servers offer
    the same tool name, close them all and raise McpError. The servers come back in the order of `configs`."""
    servers: list[McpServer] = []
    for config in configs:
        if any(server.name == config.name for server in servers):
            raise McpError(f"two mcp servers are named {config.name!r}")
        servers.append(McpServer(config, workspace))
    failures: list[BaseException | None] = [None] * len(servers)

    def start(index: int) -> None:
        try:
            servers[index].start()
        except BaseException as err:  # noqa: BLE001 - raised below, in the caller's thread
            failures[index] = err

    try:
        # start() and close() bound their own waits; this bound is only a backstop.
        unfinished = _in_threads(start, range(len(servers)),
                                 max((server.config.startup_timeout_s for server in servers), default=0)
                                 + 3 * _SHUTDOWN_GRACE_S)
        for index in unfinished:
            failures[index] = failures[index] or McpError(f"mcp server {servers[index].name!r} did not start in time")
        failure = next((err for err in failures if err is not None), None)
        if failure is not None:
            raise failure
        owners: dict[str, str] = {}
        for server in servers:
            for tool in server.tools():
                if tool.name in owners:
                    raise McpError(f"the tool {tool.name!r} is offered by mcp server {owners[tool.name]!r} and by "
                                   f"mcp server {server.name!r}; give one of them a 'prefix'")
                owners[tool.name] = server.name
    except BaseException:
        close_mcp_servers(servers)
        raise
    return servers


def close_mcp_servers(servers: Iterable[McpServer]) -> None:
    """Close servers side by side (each close may wait seconds for its process)."""
    _in_threads(lambda server: server.close(), list(servers), 2 * _SHUTDOWN_GRACE_S)


def _in_threads(function, items: Iterable, timeout_s: float) -> list[int]:
    """Run function(item) for every item, each in a thread; the indexes of those not done within timeout_s."""
    threads = [threading.Thread(target=function, args=(item,), daemon=True, name="mcp-start-stop") for item in items]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [index for index, thread in enumerate(threads) if thread.is_alive()]

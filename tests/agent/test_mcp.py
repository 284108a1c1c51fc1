"""MCP tools against a real stdio server (mcp_echo_server.py): listing, calls, errors, timeouts, a crash, the
environment the server gets, approval, config validation, startup failures and shutdown."""
from __future__ import annotations

import base64
import os
import sys
import tempfile
import time
from pathlib import Path

import mcp.types as mcp_types
import pytest

from tsterm.agent.mcp_tools import McpError, McpServer, McpServerConfig, McpTool, close_mcp_servers, \
    start_mcp_servers
from tsterm.agent.sandbox import Workspace
from tsterm.errors import ConfigError

ECHO_SERVER = str(Path(__file__).with_name("mcp_echo_server.py"))
ECHO_TOOLS = {"add", "echo", "env", "environ", "whoami", "slow", "fail", "crash", "picture"}


def echo_config(name: str = "echo", **extra) -> McpServerConfig:
    return McpServerConfig.from_dict({"name": name, "command": sys.executable, "args": [ECHO_SERVER], **extra})


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def server_pid(tools: dict[str, McpTool]) -> int:
    return int(tools["whoami"].call({}).content.split()[0])


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Workspace:
    root = tmp_path_factory.mktemp("mcp-ws")
    (root / "sub").mkdir()
    return Workspace(root)


@pytest.fixture(scope="module")
def echo(workspace):
    """One server for most tests (each start costs a second or more). Our own environment holds a secret."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TSTERM_MCP_SECRET", "hunter2")
        config = echo_config(timeout_s=1, cwd="sub", env={"TSTERM_MCP_VISIBLE": "yes", "HOME": "/nowhere"})
        with McpServer(config, workspace) as server:
            yield server


@pytest.fixture(scope="module")
def tools(echo) -> dict[str, McpTool]:
    return {tool.name: tool for tool in echo.tools()}


# ---- listing and calls

def test_every_page_of_the_listing_becomes_a_tool_with_its_schema(echo, tools):
    assert set(tools) == ECHO_TOOLS  # the server answers two tools per page
    spec = tools["add"].spec()
    assert spec["type"] == "function" and spec["function"]["name"] == "add"
    assert spec["function"]["description"] == "Add two integers."
    parameters = spec["function"]["parameters"]
    assert parameters["type"] == "object" and parameters["required"] == ["a", "b"]
    assert {key: value["type"] for key, value in parameters["properties"].items()} == {"a": "integer", "b": "integer"}
    assert echo.running


def test_calls_answer_with_the_text_and_a_summary_of_other_content(tools):
    result = tools["add"].call({"a": 2, "b": 40})
    assert result.ok and result.content == "42" and result.duration_s > 0
    assert tools["echo"].call({"text": "héllo\nworld"}).content == "héllo\nworld"
    assert tools["picture"].call({}).content == "a picture:\n[image/png content, 100 bytes]"


@pytest.mark.parametrize("arguments, message", [
    ({"a": "2", "b": 3}, "add: invalid arguments at ['a']: '2' is not of type 'integer'"),
    ({"a": 2}, "add: invalid arguments: 'b' is a required property"),
    ({"a": True, "b": 3}, "is not of type 'integer'"),
    ([2, 3], "add: arguments must be a JSON object, got list"),
])
def test_arguments_off_the_schema_are_an_error_result_without_a_call(tools, arguments, message):
    result = tools["add"].call(arguments)
    assert not result.ok and result.content == "" and message in result.error


def test_a_tool_error_on_the_server_is_an_error_result_with_its_text(tools):
    result = tools["fail"].call({})
    assert not result.ok and "this tool always fails" in result.error and result.error.startswith("fail: ")


def test_a_call_past_its_timeout_is_an_error_result_and_the_server_goes_on(echo, tools):
    result = tools["slow"].call({"seconds": 5})
    assert result.error == "slow: timed out after 1 s (mcp server 'echo')"
    assert 0.9 < result.duration_s < 3
    assert tools["slow"].call({"seconds": 0.01}).content == "slept 0.01"
    assert tools["add"].call({"a": 1, "b": 1}).content == "2" and echo.running


class CannedServer:
    """Stands in for a McpServer: every call answers with the same CallToolResult."""

    def __init__(self, result: mcp_types.CallToolResult, **config):
        self.config, self.result = echo_config("canned", **config), result
        self.name = self.config.name

    def call_tool(self, tool: str, arguments: dict) -> mcp_types.CallToolResult:
        return self.result


def canned_tool(result: mcp_types.CallToolResult, schema: dict | None = None, **config) -> McpTool:
    listed = mcp_types.Tool(name="canned", input_schema=schema or {"type": "object"})
    return McpTool(CannedServer(result, **config), listed)


def test_every_kind_of_content_becomes_text():
    content = [
        mcp_types.EmbeddedResource(resource=mcp_types.TextResourceContents(uri="file:///a.txt", text="alpha")),
        mcp_types.EmbeddedResource(resource=mcp_types.BlobResourceContents(
            uri="file:///b.pdf", mime_type="application/pdf", blob=base64.b64encode(bytes(10)).decode())),
        mcp_types.AudioContent(data=base64.b64encode(bytes(7)).decode(), mime_type="audio/wav"),
        mcp_types.ResourceLink(uri="file:///c", name="c", description="the c file"),
    ]
    assert canned_tool(mcp_types.CallToolResult(content=content)).call({}).content == "\n".join([
        "[resource file:///a.txt]\nalpha", "[resource file:///b.pdf: application/pdf content, 10 bytes]",
        "[audio/wav content, 7 bytes]", "[resource link file:///c: the c file]"])
    structured = mcp_types.CallToolResult(content=[], structured_content={"n": 1, "word": "é"})
    assert canned_tool(structured).call({}).content == '{"n": 1, "word": "é"}'


def test_long_output_is_cut_and_an_empty_error_still_says_so():
    long = mcp_types.CallToolResult(content=[mcp_types.TextContent(text="é" * 100)])
    assert canned_tool(long, max_output_bytes=11).call({}).content == "ééééé\n[mcp: output cut at 11 of 200 bytes]"
    silent = canned_tool(mcp_types.CallToolResult(content=[], is_error=True)).call({})
    assert silent.error == "canned: the tool reported an error without a message"


def test_arguments_are_checked_with_full_json_schema():
    schema = {"type": "object", "additionalProperties": False, "required": ["mode"],
              "properties": {"mode": {"enum": ["fast", "slow"]}, "tags": {"type": "array", "maxItems": 2,
                                                                          "items": {"type": "string"}}}}
    tool = canned_tool(mcp_types.CallToolResult(content=[mcp_types.TextContent(text="ok")]), schema)
    assert tool.call({"mode": "fast", "tags": ["a"]}).content == "ok"
    assert "invalid arguments at ['mode']: 'medium' is not one of ['fast', 'slow']" \
        in tool.call({"mode": "medium"}).error
    assert "at ['tags'][1]: 3 is not of type 'string'" in tool.call({"mode": "fast", "tags": ["a", 3]}).error
    assert "is too long" in tool.call({"mode": "fast", "tags": ["a", "b", "c"]}).error
    assert "Additional properties are not allowed ('speed' was unexpected)" \
        in tool.call({"mode": "fast", "speed": 1}).error


def test_a_tool_with_an_invalid_schema_is_refused_at_start():
    with pytest.raises(McpError, match=r"mcp server 'canned': tool 'canned' has an invalid input schema"):
        canned_tool(mcp_types.CallToolResult(content=[]), {"type": "object", "properties": {"x": {"type": 3}}})


# ---- the process: environment, directory, crash, shutdown

def test_the_server_sees_the_clean_environment_plus_its_env_in_its_cwd(workspace, tools):
    assert os.environ["TSTERM_MCP_SECRET"] == "hunter2"
    assert tools["env"].call({"name": "TSTERM_MCP_SECRET"}).content == "<unset>"
    assert tools["env"].call({"name": "TSTERM_MCP_VISIBLE"}).content == "yes"
    assert tools["env"].call({"name": "HOME"}).content == "/nowhere"  # env wins over the clean environment
    assert tools["environ"].call({}).content == "HOME,LANG,PATH,TSTERM_MCP_VISIBLE"
    assert tools["whoami"].call({}).content.split(" ", 1)[1] == str(workspace.root / "sub")


def test_a_crashed_server_answers_every_later_call_with_an_error_at_once(workspace):
    with McpServer(echo_config("crashy"), workspace) as server:
        tools = {tool.name: tool for tool in server.tools()}
        pid = server_pid(tools)
        result = tools["crash"].call({})
        assert result.error == "mcp server 'crashy' is not running: it exited with status 3"
        later = tools["add"].call({"a": 1, "b": 2})
        assert later.error == result.error and later.duration_s < 0.5
        assert process_gone(pid) and not server.running and server.exit_status() == "exited with status 3"


# ---- approval and configuration

def _listed(name: str, read_only: bool | None) -> mcp_types.Tool:
    annotations = None if read_only is None else mcp_types.ToolAnnotations(read_only_hint=read_only)
    return mcp_types.Tool(name=name, input_schema={"type": "object"}, annotations=annotations)


@pytest.mark.parametrize("approve, expected", [("auto", (True, True, True)), ("always", (True, True, True)),
                                               ("never", (False, False, False))])
def test_approval_follows_approve_and_never_the_read_only_annotation(workspace, approve, expected):
    # a server's readOnlyHint is its own claim: only the profile's `approve: never` lets its tools run unasked
    server = McpServer(echo_config(approve=approve), workspace)  # never started: the tools only read its config
    tools = [McpTool(server, _listed(name, hint)) for name, hint in [("plain", None), ("reader", True),
                                                                      ("writer", False)]]
    assert tuple(tool.needs_approval for tool in tools) == expected


def test_approval_on_the_running_server(tools):
    # echo and env say readOnlyHint: true; they ask all the same
    assert all(tool.needs_approval for tool in tools.values()) and {"echo", "env"} <= set(tools)


def test_config_defaults():
    config = McpServerConfig.from_dict({"name": "fs", "command": "mcp-fs"})
    assert (config.args, config.env, config.cwd, config.timeout_s, config.startup_timeout_s, config.approve,
            config.prefix) == ([], {}, ".", 60.0, 30.0, "always", "")


@pytest.mark.parametrize("data, message", [
    ("fs", "mcp server: an mcp server must be a mapping"),
    ({"command": "x"}, "mcp server: 'name' must be letters"),
    ({"name": "a b", "command": "x"}, "'name' must be letters"),
    ({"name": "fs", "command": "x", "argv": []}, "mcp server 'fs': unknown key(s) ['argv']"),
    ({"name": "fs"}, "mcp server 'fs': 'command' must be a non-empty string"),
    ({"name": "fs", "command": ""}, "'command' must be a non-empty string"),
    ({"name": "fs", "command": "x", "args": "-v"}, "mcp server 'fs': 'args' must be a list of strings"),
    ({"name": "fs", "command": "x", "args": [1]}, "'args' must be a list of strings"),
    ({"name": "fs", "command": "x", "env": ["A=1"]}, "mcp server 'fs': 'env' must be a mapping"),
    ({"name": "fs", "command": "x", "env": {"A=B": "1"}}, "'env' names must be letters"),
    ({"name": "fs", "command": "x", "env": {"A": 1}}, "'env' value of 'A' must be a string"),
    ({"name": "fs", "command": "x", "cwd": "/tmp"}, "mcp server 'fs': 'cwd' must be a path relative"),
    ({"name": "fs", "command": "x", "timeout_s": 0}, "mcp server 'fs': 'timeout_s' must be a number of seconds"),
    ({"name": "fs", "command": "x", "timeout_s": True}, "'timeout_s' must be a number of seconds"),
    ({"name": "fs", "command": "x", "startup_timeout_s": "5"}, "'startup_timeout_s' must be a number of seconds"),
    ({"name": "fs", "command": "x", "approve": "ask"}, "mcp server 'fs': 'approve' must be one of"),
    ({"name": "fs", "command": "x", "prefix": "fs."}, "mcp server 'fs': 'prefix' must be letters"),
    ({"name": "fs", "command": "x", "max_output_bytes": 0}, "'max_output_bytes' must be a positive integer"),
])
def test_config_errors_name_the_server_and_the_key(data, message):
    with pytest.raises(ConfigError) as caught:
        McpServerConfig.from_dict(data)
    assert message in str(caught.value)


def test_config_errors_start_with_where():
    with pytest.raises(ConfigError, match=r"^profile 'dev' mcp_servers\[0\] 'fs': 'approve'"):
        McpServerConfig.from_dict({"name": "fs", "command": "x", "approve": 1}, where="profile 'dev' mcp_servers[0]")


# ---- startup failures

def test_a_command_that_does_not_exist_fails_at_once(workspace):
    start = time.monotonic()
    with pytest.raises(McpError, match=r"mcp server 'ghost': cannot run 'tsterm-no-such-mcp-server': not found"):
        McpServer(McpServerConfig.from_dict({"name": "ghost", "command": "tsterm-no-such-mcp-server"}),
                  workspace).start()
    assert time.monotonic() - start < 1


@pytest.mark.parametrize("code, message", [
    ("import sys; sys.exit('no config file, giving up')",
     "it exited with status 1 before the handshake finished; its stderr ends with:\nno config file, giving up"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "it was killed by SIGKILL before the handshake"),
])
def test_a_server_that_exits_at_once_fails_quickly_saying_how(workspace, code, message):
    config = McpServerConfig.from_dict({"name": "quitter", "command": sys.executable, "args": ["-c", code]})
    start = time.monotonic()
    with pytest.raises(McpError) as caught:
        McpServer(config, workspace).start()
    assert time.monotonic() - start < 5
    assert str(caught.value).startswith(f"mcp server 'quitter' did not start: {message}")


def test_a_server_that_never_answers_fails_after_the_startup_timeout(workspace):
    config = McpServerConfig.from_dict({"name": "mute", "command": sys.executable, "startup_timeout_s": 0.5,
                                        "args": ["-c", "import time; time.sleep(60)"]})
    start = time.monotonic()
    with pytest.raises(McpError, match=r"'mute' did not start: no answer to the MCP handshake .* within 0.5 s"):
        McpServer(config, workspace).start()
    assert time.monotonic() - start < 8  # the SDK's shutdown: stdin closed, 2 s, SIGTERM


def test_a_cwd_outside_the_workspace_is_refused(workspace):
    with pytest.raises(McpError, match=r"mcp server 'echo': 'cwd': path '../..' leaves the workspace"):
        McpServer(echo_config(cwd="../.."), workspace).start()


# ---- several servers

def test_start_mcp_servers_keeps_tool_names_apart_with_a_prefix_and_close_ends_them(workspace):
    servers = start_mcp_servers([echo_config("one"), echo_config("two", prefix="two_")], workspace)
    try:
        tools = {tool.name: tool for server in servers for tool in server.tools()}
        assert len(tools) == 2 * len(ECHO_TOOLS) and {"add", "two_add"} <= set(tools)
        assert tools["two_add"].call({"a": 1, "b": 2}).content == "3"
        pids = [server_pid(tools), int(tools["two_whoami"].call({}).content.split()[0])]
        assert not any(process_gone(pid) for pid in pids)
    finally:
        close_mcp_servers(servers)
    assert all(process_gone(pid) for pid in pids)  # close() returns once the process is reaped
    assert not any(server.running for server in servers)
    servers[0].close()  # idempotent
    assert tools["add"].call({"a": 1, "b": 2}).error == "mcp server 'one' is not running: it was closed"


def test_start_mcp_servers_refuses_a_tool_name_two_servers_offer_and_closes_them(workspace, monkeypatch):
    closed = []
    original_close = McpServer.close
    monkeypatch.setattr(McpServer, "close", lambda self: (closed.append(self), original_close(self))[1])
    with pytest.raises(McpError, match=r"the tool '\w+' is offered by mcp server 'one' and by mcp server 'two'"):
        start_mcp_servers([echo_config("one"), echo_config("two")], workspace)
    assert sorted(server.name for server in closed) == ["one", "two"] and not any(server.running for server in closed)


# ---- a server in the sandbox

def test_a_sandboxed_server_runs_in_its_own_namespaces_and_leaves_nothing_behind(tmp_path):
    from tsterm.agent.sandbox import detect_isolation

    assert detect_isolation().mechanism is not None, detect_isolation().reason
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "server.py").write_text(Path(ECHO_SERVER).read_text())  # only the workspace is visible in there
    workspace = Workspace(root)
    before = {path.name for path in Path(tempfile.gettempdir()).glob("tsterm-sandbox-*")}
    config = McpServerConfig.from_dict({"name": "boxed", "command": sys.executable, "args": ["../server.py"],
                                        "cwd": "sub", "sandbox": True, "approve": "never"})
    with McpServer(config, workspace) as server:
        tools = {tool.name: tool for tool in server.tools()}
        assert tools["add"].call({"a": 2, "b": 40}).content == "42"
        pid, cwd = tools["whoami"].call({}).content.split()
        # PID 1 is the sandbox's init, 2 the supervisor, 3 the server; the workspace is at the same path in there
        assert (int(pid), cwd) == (3, str(root / "sub"))
        assert tools["environ"].call({}).content.split(",") == ["HOME", "LANG", "PATH"]
        boxed = _host_pids_running(b"../server.py")  # the supervisor and the server, seen from here
        assert len(boxed) == 2
    assert all(process_gone(pid) for pid in boxed)
    assert {path.name for path in Path(tempfile.gettempdir()).glob("tsterm-sandbox-*")} == before


def test_a_sandboxed_server_is_refused_without_namespaces(tmp_path, monkeypatch):
    from tsterm.agent import sandbox

    monkeypatch.setattr(sandbox, "detect_isolation", lambda: sandbox.Isolation(None, "no user namespaces"))
    config = McpServerConfig.from_dict({"name": "boxed", "command": sys.executable, "args": [ECHO_SERVER],
                                        "sandbox": True})
    with pytest.raises(McpError, match=r"mcp server 'boxed' refused: the sandbox is unavailable \(no user namesp"):
        McpServer(config, Workspace(tmp_path)).start()
    with pytest.raises(ConfigError, match="'sandbox' must be true or false"):
        McpServerConfig.from_dict({"name": "boxed", "command": "x", "sandbox": "yes"})


def _host_pids_running(argument: bytes) -> list[int]:
    """Host pids of the processes with `argument` on their command line that run in a PID namespace of their own."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{entry}/status").read_text()
        except (OSError, ValueError):
            continue
        nspids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if argument in cmdline and len(nspids) > 1:
            found.append(int(entry))
    return found

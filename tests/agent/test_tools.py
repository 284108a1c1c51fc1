"""The built-in tools and profile command tools on a temporary workspace: answers, limits, and error results."""
from __future__ import annotations

import math
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tsterm.agent.sandbox import SandboxError, Workspace
from tsterm.agent.tools import Calculator, CommandTool, ConfigError, Grep, ListDir, ReadFile, RunCommand, WriteFile, \
    builtin_tools


@pytest.fixture
def outside(tmp_path):
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret.txt").write_text("password = hunter2\n")
    return path


@pytest.fixture
def ws(tmp_path, outside):
    root = tmp_path / "ws"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "main.py").write_text("import os\nprint('hello')\n# password here\n")
    (root / "src" / "pkg" / "util.py").write_text("def helper():\n    return 'hello again'\n")
    (root / "notes.txt").write_text("héllo wörld\n")
    (root / "blob.bin").write_bytes(b"\x7fELF\x00\x01\x02hello")
    os.symlink(outside, root / "door")
    return Workspace(root)


def test_builtin_tools_add_write_and_commands_only_when_enabled(ws):
    assert [tool.name for tool in builtin_tools(ws)] == ["calculator", "read_file", "list_dir", "grep"]
    everything = builtin_tools(ws, allow_write=True, allow_commands=True)
    assert [tool.name for tool in everything][-2:] == ["write_file", "run_command"]
    assert {tool.name for tool in everything if tool.needs_approval} == {"write_file", "run_command"}
    for tool in everything:
        spec = tool.spec()
        assert spec["type"] == "function" and spec["function"]["name"] == tool.name
        assert spec["function"]["parameters"]["type"] == "object" and spec["function"]["description"]


def test_arguments_are_checked_against_the_schema(ws):
    read = ReadFile(ws)
    assert read.call({}).error == "read_file: arguments: missing required field 'path'"
    assert read.call({"path": "notes.txt", "paht": "x"}).error == \
        "read_file: arguments: unexpected field 'paht' (allowed: path, offset, max_bytes)"
    assert read.call({"path": "notes.txt", "offset": "3"}).error == \
        'read_file: arguments.offset: expected integer, got string "3"'
    assert "arguments.offset: expected integer, got boolean true" in read.call({"path": "notes.txt", "offset": True}).error
    assert "arguments.offset: must be >= 0, got -1" in read.call({"path": "notes.txt", "offset": -1}).error
    both = read.call({"offset": -1, "extra": 1}).error  # every problem, each with its field
    assert all(part in both for part in ("missing required field 'path'", "unexpected field 'extra'",
                                         "arguments.offset: must be >= 0"))
    assert "must be a JSON object" in read.call(["notes.txt"]).error
    assert "surrogates not allowed" in read.call({"path": "\ud800.txt"}).error
    assert "surrogates not allowed" in WriteFile(ws).call({"path": "x.txt", "content": "\ud800"}).error


# ---- calculator

@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("7 // 2", 3), ("-7 % 3", 2), ("2 ** 10", 1024), ("1 / 4", 0.25),
    ("-(+3)", -3), ("sqrt(16)", 4.0), ("abs(-2.5)", 2.5), ("round(2.567, 2)", 2.57), ("max(1, 5, 3)", 5),
    ("min(4, 2)", 2), ("log(e)", 1.0), ("exp(0)", 1.0), ("cos(0) + sin(0) + tan(0)", 1.0), ("2 * pi", 2 * math.pi),
    ("log(8, 2)", 3.0), ("2 ** -1", 0.5), ("1e3", 1000.0), ("2 ** 4000", 2 ** 4000),
])
def test_calculator_evaluates_arithmetic(expression, value):
    result = Calculator().call({"expression": expression})
    assert result.error is None and result.content == repr(value)


@pytest.mark.parametrize("expression, refused", [
    ("__import__('os').system('id')", "calling \"__import__"), ("open('x')", "calling 'open'"),
    ("x", "the name 'x'"), ("math.pi", "Attribute"), ("'a' * 3", "str constant"), ("[i for i in (1, 2)]", "ListComp"),
    ("(lambda: 1)()", "calling"), ("1 if 1 else 2", "IfExp"), ("1 < 2", "Compare"), ("1 << 2", "BinOp"),
    ("True + 1", "bool constant"), ("1j * 2", "complex constant"), ("sqrt(x=4)", "positional"),
    ("9 ** 9 ** 9", "too large"), ("10 ** 10000", "too large"), ("2 ** 4000 * 2 ** 4000", "too large"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("sqrt(-1)", "math domain error"),
    ("(-8) ** (1 / 3)", "complex"), ("2.0 ** 5000", "too large"),
    ("1 +", "not an expression"), ("import os", "not an expression"), ("-" * 2000 + "1", "longer than"),
    ("(" * 300 + "1" + ")" * 300, "nested too deeply|too many nested"),
])
def test_calculator_refuses_anything_but_arithmetic(expression, refused):
    result = Calculator().call({"expression": expression})
    assert result.content == "" and result.error is not None
    assert re.search(refused, result.error), result.error


def test_calculator_huge_power_is_refused_quickly():
    result = Calculator().call({"expression": "9 ** 9 ** 9"})
    assert result.error and result.duration_s < 0.5


_small_ints = st.integers(min_value=-20, max_value=20).map(lambda n: f"({n})")


def _combine(children):
    binary = st.tuples(children, st.sampled_from(["+", "-", "*", "/", "//", "%"]), children)
    power = st.tuples(children, st.just("**"), st.integers(0, 3).map(str))  # small exponent: Python's value stays small
    return st.one_of(binary, power, st.tuples(st.sampled_from(["-", "+"]), children).map(lambda t: ("", *t))) \
        .map(lambda parts: "(" + " ".join(part for part in parts if part) + ")")


@settings(max_examples=300, deadline=None)
@given(st.recursive(_small_ints, _combine, max_leaves=12))
def test_calculator_agrees_with_python_on_random_arithmetic(expression):
    # eval is the oracle here only: the generated text is numbers, operators and parentheses, nothing else.
    try:
        expected = eval(expression, {"__builtins__": {}})  # noqa: S307
    except ZeroDivisionError:
        expected = None
    except OverflowError:
        return  # float overflow of a huge intermediate: both sides refuse, by different words
    result = Calculator().call({"expression": expression})
    if expected is None:
        assert "division by zero" in result.error
    elif isinstance(expected, complex) or (isinstance(expected, int) and expected.bit_length() > 4096):
        assert result.error is not None
    else:
        assert result.error is None, result.error
        assert result.content == repr(expected)


# ---- read_file, list_dir, grep, write_file

def test_read_file_reads_utf8_text(ws):
    result = ReadFile(ws).call({"path": "notes.txt"})
    assert (result.content, result.error) == ("héllo wörld\n", None)


@pytest.mark.parametrize("path, error", [
    ("missing.txt", "does not exist"), ("src", "is not a file"), ("blob.bin", "binary file"),
    ("door/secret.txt", "leaves the workspace"), ("../outside/secret.txt", "leaves the workspace"),
])
def test_read_file_refusals_are_error_results(ws, path, error):
    result = ReadFile(ws).call({"path": path})
    assert result.content == "" and error in result.error and repr(path) in result.error
    assert "hunter2" not in result.error


def test_read_file_absolute_path_is_refused(ws, outside):
    result = ReadFile(ws).call({"path": str(outside / "secret.txt")})
    assert "absolute" in result.error and result.content == ""


def test_read_file_reads_a_large_file_in_windows_without_splitting_characters(ws):
    text = "".join(f"line {n} — ünïcode\n" for n in range(20_000))  # ~480 KB, multi-byte characters throughout
    (ws.root / "big.txt").write_text(text)
    read, offset, pieces = ReadFile(ws), 0, []
    while True:
        content = read.call({"path": "big.txt", "offset": offset, "max_bytes": 4099}).content
        body, _, footer = content.partition("\n[read_file: bytes ")
        assert len(body.encode()) <= 4099
        pieces.append(body)
        if not footer:
            break
        offset = int(footer.split("offset=")[1].split()[0])
    assert "".join(pieces) == text and len(pieces) > 100
    middle = read.call({"path": "big.txt", "offset": 8, "max_bytes": 20}).content  # byte 8: inside the dash
    assert middle.startswith(" ünïcode\nline 1") and "offset=" in middle
    assert len(ReadFile(ws).call({"path": "big.txt", "max_bytes": 10**9}).content.encode()) < 70_000


def test_list_dir_shows_sorted_entries_with_type_and_size(ws):
    result = ListDir(ws).call({})
    # a link's target is a workspace path or "(outside the workspace)": never an absolute path of the host
    assert result.content.splitlines() == [
        "file 12 blob.bin", "link - door -> (outside the workspace)", "file 14 notes.txt", "dir - src/"]
    os.symlink("src/pkg/util.py", ws.root / "inner")
    os.symlink("gone", ws.root / "broken")
    lines = ListDir(ws).call({}).content.splitlines()
    assert "link - inner -> src/pkg/util.py" in lines and "link - broken -> (missing)" in lines
    assert ListDir(ws).call({"path": "src/pkg"}).content == "file 39 util.py"
    assert "leaves the workspace" in ListDir(ws).call({"path": "door"}).error
    assert "is not a directory" in ListDir(ws).call({"path": "notes.txt"}).error


def test_list_dir_is_capped(ws):
    for n in range(ListDir.MAX_ENTRIES + 5):
        (ws.root / "src" / "pkg" / f"f{n:04}").touch()
    lines = ListDir(ws).call({"path": "src/pkg"}).content.splitlines()
    assert len(lines) == ListDir.MAX_ENTRIES + 1 and lines[-1] == "[list_dir: 6 more entries not shown]"


def test_grep_answers_path_line_text_and_never_reads_through_a_link_out(ws, outside):
    os.symlink(outside / "secret.txt", ws.root / "src" / "leak.txt")  # a file link, besides the directory 'door'
    result = Grep(ws).call({"pattern": r"hel+o"})
    assert result.content.splitlines() == ["src/main.py:2:print('hello')", "src/pkg/util.py:2:    return 'hello again'"]
    assert Grep(ws).call({"pattern": "hunter2|password"}).content == "src/main.py:3:# password here"
    assert Grep(ws).call({"pattern": "import", "path": "src/main.py"}).content == "src/main.py:1:import os"
    assert "no match" in Grep(ws).call({"pattern": "nothing-like-this"}).content
    assert "leaves the workspace" in Grep(ws).call({"pattern": "x", "path": "door"}).error
    assert "bad pattern" in Grep(ws).call({"pattern": "(unclosed"}).error


def test_grep_is_capped(ws):
    (ws.root / "many.txt").write_text("match\n" * 1000)
    (ws.root / "huge.txt").write_text("match " * (Grep.MAX_FILE_BYTES // 6 + 1))
    lines = Grep(ws).call({"pattern": "match"}).content.splitlines()
    assert len(lines) == Grep.MAX_MATCHES + 1 and lines[-1] == f"[grep: stopped after {Grep.MAX_MATCHES} matches]"
    assert not any(line.startswith("huge.txt") for line in lines)
    assert "longer than" in Grep(ws).call({"pattern": "a" * 501}).error


def test_write_file_creates_parents_inside_and_refuses_escapes(ws, outside):
    write = WriteFile(ws)
    assert write.call({"path": "new/deep/file.txt", "content": "hi\n"}).content == "wrote 3 bytes to new/deep/file.txt"
    assert (ws.root / "new" / "deep" / "file.txt").read_text() == "hi\n"
    for path in ["../outside/evil.txt", "door/evil.txt", str(outside / "evil.txt"), "door/sub/evil.txt"]:
        result = write.call({"path": path, "content": "x"})
        assert result.error and ("leaves the workspace" in result.error or "absolute" in result.error)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]  # nothing written, no directory made
    assert "is a directory" in write.call({"path": "src", "content": "x"}).error


# ---- commands

def test_run_command_output_and_failures(ws):
    run = RunCommand(ws, timeout_s=1.0, max_output_bytes=1000)
    assert run.call({"argv": ["cat", "notes.txt"]}).content == "héllo wörld\n"
    assert run.call({"argv": ["ls"], "cwd": "src"}).content == "main.py\npkg\n"
    failed = run.call({"argv": ["sh", "-c", "echo partial; exit 4"]})
    assert (failed.content, failed.error) == ("partial\n", "sh: exited with status 4")
    assert "timed out" in run.call({"argv": ["sleep", "10"]}).error
    flood = run.call({"argv": ["yes"]})
    assert len(flood.content) == 1000 and "exceeded 1000 bytes" in flood.error
    assert "cannot run 'nope'" in run.call({"argv": ["nope"]}).error
    assert "leaves the workspace" in run.call({"argv": ["ls"], "cwd": "door"}).error
    assert "arguments.argv[1]: expected string, got integer 3" in run.call({"argv": ["ls", 3]}).error


def _echo_tool(ws, **overrides):
    declaration = {"name": "echo_args", "description": "print its arguments one per line",
                   "parameters": {"type": "object", "required": ["message"],
                                  "properties": {"message": {"type": "string"}, "count": {"type": "integer",
                                                                                           "default": 3}}},
                   "argv": ["printf", "%s\\n", "{message}", "-n={count}"], "timeout_s": 1}
    declaration.update(overrides)
    return CommandTool.from_dict(declaration, ws, where="profile x.yaml: tools[0]")


def test_command_tool_fills_each_placeholder_into_one_argv_element(ws):
    tool = _echo_tool(ws)
    assert tool.needs_approval and tool.spec()["function"]["name"] == "echo_args"
    hostile = "a b; rm -rf ~ && echo $HOME `id`"
    assert tool.render_argv({"message": hostile}) == ["printf", "%s\\n", hostile, "-n=3"]
    result = tool.call({"message": hostile, "count": 7})
    assert (result.content, result.error) == (f"{hostile}\n-n=7\n", None)
    assert "may not start with '-'" in tool.call({"message": "--output=/etc/passwd"}).error
    assert "arguments: missing required field 'message'" in tool.call({}).error
    assert "unexpected field 'shell' (allowed: message, count)" in tool.call({"message": "x", "shell": 1}).error
    assert "arguments.count: expected integer" in tool.call({"message": "x", "count": "7; ls"}).error


@pytest.mark.parametrize("overrides, error", [
    ({"name": "bad name!"}, "'name' must be"), ({"argv": []}, "'argv' must be a non-empty list"),
    ({"argv": "git log"}, "'argv' must be a non-empty list"), ({"argv": ["{message}"]}, "must be fixed"),
    ({"argv": ["echo", "{nope}"]}, "argv uses {nope}"), ({"timeout_s": 0}, "'timeout_s'"),
    ({"timeout_s": "5"}, "'timeout_s'"), ({"cwd": "../elsewhere"}, "'cwd'"),
    ({"shell": True}, "unknown key(s) ['shell']"),
    ({"parameters": {"type": "array"}}, "'parameters' must be"),
    ({"parameters": {"type": "object", "required": "message", "properties": {"message": {"type": "string"}}}},
     "'parameters' is not a valid JSON schema (parameters.required: 'message' is not of type 'array')"),
    ({"parameters": {"type": "object", "required": ["message"], "properties": {
        "message": {"type": "string"}, "count": {"type": "integer"}}}}, "{count} in argv must be required or have"),
    ({"max_output_bytes": -1}, "'max_output_bytes'"),
])
def test_command_tool_declarations_are_validated_with_clear_errors(ws, overrides, error):
    with pytest.raises(ConfigError) as raised:
        _echo_tool(ws, **overrides)
    assert error in str(raised.value) and str(raised.value).startswith("profile x.yaml: tools[0]")


def test_a_hanging_command_tool_is_an_error_result_and_the_next_call_works(ws):
    hang = CommandTool.from_dict({"name": "hang", "argv": ["sleep", "30"], "timeout_s": 0.5}, ws)
    assert "timed out" in hang.call({}).error
    assert Calculator().call({"expression": "1 + 1"}).content == "2"


def test_command_tool_path_placeholders_are_confined_like_file_tools(ws):
    # The README's `pytest {path}`: a path argument may not name another tree (its conftest.py would run).
    tool = CommandTool.from_dict({"name": "show", "argv": ["cat", "{path}"], "cwd": "src",
                                  "parameters": {"type": "object", "required": ["path"],
                                                 "properties": {"path": {"type": "string"}}}}, ws)
    assert tool.call({"path": "main.py"}).content.startswith("import os")  # relative to the tool's cwd
    for bad, why in [("/etc/passwd", "must be relative"), ("~/.ssh/id_rsa", "must be relative"),
                     ("../../outside/secret.txt", "leaves the workspace"), ("../door/secret.txt", "leaves")]:
        result = tool.call({"path": bad})
        assert result.error is not None and why in result.error and "'path'" in result.error, (bad, result)
        assert "hunter2" not in result.content
    # `"format": "path"` marks any parameter; a parameter that is not a path is passed through as before
    marked = CommandTool.from_dict({"name": "show2", "argv": ["echo", "{target}", "{note}"],
                                    "parameters": {"type": "object", "required": ["target", "note"],
                                                   "properties": {"target": {"type": "string", "format": "path"},
                                                                  "note": {"type": "string"}}}}, ws)
    assert "leaves the workspace" in marked.call({"target": "door", "note": "x"}).error
    assert marked.call({"target": "src", "note": "/etc/passwd"}).content == "src /etc/passwd\n"


def test_a_link_swapped_in_after_resolve_is_not_followed(ws, outside):
    # resolve() saw a directory; before the open, someone replaces it with a link to outside. The open walks
    # the path from the root with O_NOFOLLOW, so it fails instead of writing (or reading) outside.
    (ws.root / "box").mkdir()
    real = ws.resolve("box/secret.txt")
    (ws.root / "box").rmdir()
    os.symlink(outside, ws.root / "box")
    with pytest.raises(SandboxError, match="'box' became a symbolic link"):
        ws.open_fd(real, os.O_WRONLY | os.O_CREAT)
    with pytest.raises(SandboxError, match="became a symbolic link"):
        ws.open_fd(real, os.O_RDONLY)
    assert (outside / "secret.txt").read_text() == "password = hunter2\n"


def test_write_file_refuses_a_file_with_other_hard_links(ws, outside):
    os.link(outside / "secret.txt", ws.root / "hard.txt")
    result = WriteFile(ws).call({"path": "hard.txt", "content": "pwned"})
    assert "'hard.txt' has 2 hard links" in result.error
    assert (outside / "secret.txt").read_text() == "password = hunter2\n"
    assert WriteFile(ws).call({"path": "notes.txt", "content": "fine"}).ok  # one link: written in place
    assert (ws.root / "notes.txt").read_text() == "fine"

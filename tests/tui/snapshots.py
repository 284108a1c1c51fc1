"""Screen snapshots without pytest-textual-snapshot (it pins pytest<9).

A snapshot is the screen as the terminal would show it, in a text file that diffs well:

    # header: what it is and the size
    the screen's characters, one line per row (trailing spaces trimmed: the style map still covers them)
    --- styles
    one key per cell (two when a screen has more styles than keys), the same rows and columns
    --- legend
    key  the Rich style of those cells (colours, bold, ...)

Cells come from the same compositor render that `App.export_screenshot()` turns into SVG, so colours count as
much as text. Files live in tests/tui/snapshots/ and are compared exactly. On a mismatch the test fails with a
unified diff of the part that changed (text, then styles), and writes the actual snapshot and an SVG screenshot
to the test's tmp_path. `pytest tests/tui --snapshot-update` or `TSTERM_UPDATE_SNAPSHOTS=1` rewrites them.
"""
from __future__ import annotations

import difflib
import io
import os
import string
from pathlib import Path

from rich.cells import cell_len
from rich.console import Console
from rich.segment import Segment

SNAPSHOT_DIR = Path(__file__).parent / "snapshots"
KEYS = string.ascii_letters + string.digits + "!#$%&()*+,-./:;<=>?@[]^_{|}~"
STYLES_MARK, LEGEND_MARK = "--- styles", "--- legend"


def update_requested(config=None) -> bool:
    if os.environ.get("TSTERM_UPDATE_SNAPSHOTS", "") not in ("", "0"):
        return True
    return bool(config is not None and config.getoption("snapshot_update", default=False))


def screen_cells(app) -> list[list[tuple[str, str]]]:
    """The current screen as rows of (character, Rich style string) cells; a wide character's second cell is ""."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system="truecolor",
                      legacy_windows=False, safe_box=False)
    # What export_screenshot() prints (the compositor is private; Textual exposes it only as SVG).
    update = app.screen._compositor.render_update(full=True, simplify=True)
    segments = [s for s in console.render(update) if not s.control]
    rows = []
    for line in Segment.split_lines(segments):
        row: list[tuple[str, str]] = []
        for segment in line:
            style = str(segment.style or "")
            for char in segment.text:
                row.append((char, style))
                row.extend(("", style) for _ in range(cell_len(char) - 1))
        rows.append(row[:width] + [(" ", "")] * (width - len(row)))
    return rows[:height]


def render_snapshot(app, title: str) -> str:
    rows = screen_cells(app)
    styles: dict[str, str] = {}
    for row in rows:
        for _, style in row:
            styles.setdefault(style, "")
    key_len = 1 if len(styles) <= len(KEYS) else 2
    for i, style in enumerate(styles):
        styles[style] = KEYS[i] if key_len == 1 else KEYS[i // len(KEYS)] + KEYS[i % len(KEYS)]
    width, height = app.size
    text = ["".join(char for char, _ in row).rstrip() for row in rows]
    style_rows = ["".join(styles[style] for _, style in row) for row in rows]
    legend = [f"{key}  {style or '(default)'}" for style, key in styles.items()]
    header = f"# tsterm TUI snapshot: {title} at {width}x{height} (see tests/tui/snapshots.py)"
    return "\n".join([header, *text, STYLES_MARK, *style_rows, LEGEND_MARK, *legend]) + "\n"


def _parts(snapshot: str) -> dict[str, list[str]]:
    head, _, rest = snapshot.partition(f"\n{STYLES_MARK}\n")
    styles, _, legend = rest.partition(f"\n{LEGEND_MARK}\n")
    return {"text": head.splitlines(), "styles": styles.splitlines() + ["", *legend.splitlines()]}


def compare(expected: str, actual: str, name: str) -> str | None:
    """None if equal, else a readable report: the diff of the text, or of the styles when only they changed."""
    if expected == actual:
        return None
    old, new = _parts(expected), _parts(actual)
    part = "text" if old["text"] != new["text"] else "styles"
    diff = difflib.unified_diff(old[part], new[part], f"{name} (expected {part})", f"{name} (actual {part})",
                                lineterm="", n=1)
    return "\n".join(diff)


def assert_snapshot(app, name: str, title: str, *, tmp_path: Path, update: bool = False) -> None:
    """Compare the app's current screen with tests/tui/snapshots/NAME.txt (or rewrite it when `update`)."""
    actual = render_snapshot(app, title)
    path = SNAPSHOT_DIR / f"{name}.txt"
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, encoding="utf-8")
        return
    if not path.exists():
        raise AssertionError(f"no snapshot {path}: run `pytest tests/tui --snapshot-update` (or set "
                             "TSTERM_UPDATE_SNAPSHOTS=1), look at the file, and commit it")
    report = compare(path.read_text(encoding="utf-8"), actual, name)
    if report is None:
        return
    (tmp_path / f"{name}.actual.txt").write_text(actual, encoding="utf-8")
    (tmp_path / f"{name}.actual.svg").write_text(app.export_screenshot(title=name), encoding="utf-8")
    raise AssertionError(f"screen differs from snapshot {path.name}; actual snapshot and SVG in {tmp_path} "
                         f"(rewrite with --snapshot-update if the change is intended)\n{report}")

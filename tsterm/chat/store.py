"""Sessions on disk: one `<id>.json` per session in the user data directory, written atomically; a file that
cannot be read back is moved aside and reported, never fatal."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from tsterm.chat.session import Session, SessionFileError


def default_data_dir() -> Path:
    """Where sessions live: `$TSTERM_DATA_DIR/sessions`, else `$XDG_DATA_HOME/tsterm/sessions`."""
    if os.environ.get("TSTERM_DATA_DIR"):
        return Path(os.environ["TSTERM_DATA_DIR"]).expanduser() / "sessions"
    xdg = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(xdg).expanduser() / "tsterm" / "sessions"


def atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder + rename: a crash leaves the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class SessionStore:
    """One `<id>.json` per session in `directory`. Unreadable files are moved aside and reported, never fatal."""

    def __init__(self, directory: Path | str | None = None):
        self.directory = Path(directory) if directory is not None else default_data_dir()

    def path_for(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.json"

    def save(self, session: Session) -> Path:
        path = self.path_for(session.id)
        atomic_write(path, json.dumps(session.to_dict(), ensure_ascii=False))
        return path

    def delete(self, session_id: str) -> None:
        self.path_for(session_id).unlink(missing_ok=True)

    def load_all(self) -> tuple[list[Session], list[str]]:
        """(sessions oldest first, one error line per file that could not be read)."""
        sessions, errors = [], []
        if not self.directory.is_dir():
            return sessions, errors
        for path in sorted(self.directory.glob("*.json")):
            try:
                sessions.append(self._load(path))
            except (SessionFileError, OSError) as e:
                errors.append(self._quarantine(path, e))
        sessions.sort(key=lambda s: s.created)
        return sessions, errors

    def _load(self, path: Path) -> Session:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise SessionFileError(f"not UTF-8 text ({e.reason})") from None
        except json.JSONDecodeError as e:
            raise SessionFileError(f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        return Session.from_dict(data)

    def _quarantine(self, path: Path, error: Exception) -> str:
        target = path.with_name(path.name + ".corrupt")
        if target.exists():
            target = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}.corrupt")
        try:
            os.replace(path, target)
            where = f"moved aside to {target.name}"
        except OSError as e:
            where = f"could not move it aside ({e.strerror}); it is ignored"
        return f"session file {path}: {error}; {where}"

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


# ---- the KV a session keeps in the disk tier (`kv_disk`): what `tsterm sessions` shows and drops

def session_kv_names(session: Session, models: list[dict]) -> set[str]:
    """The names of the blocks a session's turns leave in a KV store holding `models` (`kv_store.store_models`): the
    full blocks of its kept ids and each recorded turn's partly filled last block, under every model of the store
    (chain hashes start at the model's fingerprint, so another model's names never collide), and a hybrid model's
    state snapshots, each named after the full block it ends (`<hash>.kvs`: one at the last block boundary a turn
    computed, and any interval snapshots of its prompts; a name no file has is simply not found)."""
    from tsterm.engine.kv_store import FULL_SUFFIX, SNAPSHOT_SUFFIX, session_block_names  # (no torch: hashing only)

    prefixes = [session.token_ids] + [ids for k in range(1, len(session.reply_stats()) + 1)
                                      if (ids := session.ids_through_reply(k))]
    names: set[str] = set()
    for model in models:
        for ids in prefixes:
            names.update(session_block_names(model["fingerprint"], model["block_size"], ids))
    names.update([name[:-len(FULL_SUFFIX)] + SNAPSHOT_SUFFIX for name in names if name.endswith(FULL_SUFFIX)])
    return names


def _rank_dirs(kv_dir: Path) -> list[Path]:
    """The store at `kv_dir` and the other ranks' stores below it (`rank<R>`: each rank's share of the same blocks,
    under rank 0's names; tsterm.engine.kv_tier)."""
    if not kv_dir.is_dir():
        return []
    ranks = sorted((p for p in kv_dir.glob("rank*") if p.name[4:].isdigit() and p.is_dir()), key=lambda p: int(p.name[4:]))
    return [kv_dir, *ranks]


def session_kv_usage(sessions: list[Session], kv_dir: Path | str) -> dict[str, tuple[int, int]]:
    """session id -> (blocks, bytes) it holds in the KV store at `kv_dir` (blocks shared with another session, such
    as a common system prompt's, count for each; the bytes of every rank's share)."""
    from tsterm.engine.kv_store import store_models

    kv_dir = Path(kv_dir).expanduser()
    models = store_models(kv_dir)
    sizes = [{entry.name: entry.stat().st_size for entry in os.scandir(d) if entry.is_file()}
             for d in _rank_dirs(kv_dir)]
    usage = {}
    for session in sessions:
        names = session_kv_names(session, models)
        usage[session.id] = (sum(name in sizes[0] for name in names) if sizes else 0,
                             sum(rank[name] for rank in sizes for name in names if name in rank))
    return usage


def drop_session_kv(session: Session, others: list[Session], kv_dir: Path | str) -> tuple[int, int]:
    """Delete the blocks `session` holds in the KV store at `kv_dir` (every rank's share) that none of `others` holds
    too; returns (blocks, bytes) deleted. An engine running over the store computes a dropped block again when a prompt needs it."""
    from tsterm.engine.kv_store import store_models

    kv_dir = Path(kv_dir).expanduser()
    models = store_models(kv_dir)
    shared: set[str] = set()
    for other in others:
        if other.id != session.id:
            shared |= session_kv_names(other, models)
    blocks = freed = 0
    for name in sorted(session_kv_names(session, models) - shared):
        found = False
        for directory in _rank_dirs(kv_dir):  # every rank's share of the block
            path = directory / name
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            found, freed = True, freed + size
        blocks += found
    return blocks, freed

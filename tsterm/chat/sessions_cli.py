"""`tsterm sessions`: the saved chat and agent sessions, with the KV each keeps in the disk tier, and `drop` to free it.
Loads no model and no torch: a block's name is its chain hash, computed from the session's exact ids and the model
fingerprints the store records (`tsterm.engine.kv_store`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tsterm.chat.store import SessionStore, drop_session_kv, session_kv_usage

HELP = "list saved sessions and the KV each keeps on disk (kv_disk); drop a session's KV"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("sessions", help=HELP)
    p.add_argument("action", nargs="?", choices=("list", "drop"), default="list",
                   help="list (default), or drop the KV on disk of the session SESSION_ID (the session stays)")
    p.add_argument("session_id", nargs="?", metavar="SESSION_ID", help="the session whose KV `drop` deletes")
    p.add_argument("--profile", default="default", help="the profile whose kv_disk store to read (default: default)")
    p.add_argument("--sessions-dir", dest="sessions_dir", help="where the sessions are (default: the user data dir)")
    p.set_defaults(func=cmd_sessions)
    return p


def kv_dir_of(profile_name: str) -> Path | None:
    """The profile's disk-tier directory, or None when it has no `kv_disk`."""
    from tsterm.config import EngineConfig
    from tsterm.paths import default_cache_dir
    from tsterm.profiles import load_profile

    options = load_profile(profile_name).engine.get("kv_disk")
    if options is None:
        return None
    checked = EngineConfig(model="<model>", kv_disk=options).kv_disk
    return Path(checked["path"]).expanduser() if checked["path"] else default_cache_dir() / "kv"


def cmd_sessions(args: argparse.Namespace) -> int:
    store = SessionStore(args.sessions_dir)
    sessions, errors = store.load_all()
    for error in errors:
        print(f"tsterm: warning: {error}", file=sys.stderr)  # (stdout: the listing, for scripts)
    kv_dir = kv_dir_of(args.profile)
    if args.action == "drop":
        if not args.session_id:
            raise SystemExit("tsterm sessions drop: name the session (SESSION_ID; `tsterm sessions` lists them)")
        session = next((s for s in sessions if s.id == args.session_id), None)
        if session is None:
            raise SystemExit(f"tsterm sessions drop: no session {args.session_id!r} in {store.directory}")
        if kv_dir is None:
            print(f"profile {args.profile!r} has no kv_disk store: nothing to drop")
            return 0
        blocks, freed = drop_session_kv(session, sessions, kv_dir)
        print(f"dropped {blocks} KV blocks ({_mib(freed)}) of session {session.id} from {kv_dir} "
              "(blocks other sessions share are kept)")
        return 0
    usage = session_kv_usage(sessions, kv_dir) if kv_dir is not None else {}
    where = f"KV store {kv_dir}" if kv_dir is not None else f"profile {args.profile!r} has no kv_disk store"
    print(f"{len(sessions)} sessions in {store.directory}; {where}")
    for session in sessions:
        blocks, size = usage.get(session.id, (0, 0))
        kv = f"{blocks:>6} blocks {_mib(size):>10}" if kv_dir is not None else "-"
        print(f"{session.id}  {len(session.token_ids):>7} tokens  {kv}  {session.title}")
    return 0


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.1f} MiB"

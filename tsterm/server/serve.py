"""`tsterm serve`: load the model, then serve the OpenAI-compatible API with uvicorn.

Binds 127.0.0.1 by default. Any other address needs an API key (`--api-key` or TSTERM_API_KEY): refused at start
without one. The key is never printed or logged. `BackgroundServer` runs the same app on a thread (tests, the TUI).
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tsterm.config import SamplingParams
from tsterm.errors import ConfigError, TstermError

API_KEY_ENV = "TSTERM_API_KEY"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_bind(host: str, api_key: str | None) -> None:
    """A non-loopback bind without an API key would open the engine to the network: refuse it."""
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"--host {host} is reachable from other machines: set an API key (--api-key or "
                          f"{API_KEY_ENV}) to bind it, or bind 127.0.0.1")


def build_state(client: Any, model_name: str, defaults: SamplingParams | None = None,
                api_key: str | None = None, history_policy: str = "preserve", **limits: Any) -> Any:
    """The server's state over `client`, the engine's AsyncEngine or EngineCoreProcess (its `info` and `tokenizer`
    name the model). `history_policy`: the thinking-history policy of API conversations (a profile's
    `thinking_history`); `limits`: ServerLimits fields (max_conversations, conversation_ttl_s, ...)."""
    from tsterm.server.state import ServerLimits, ServerState

    return ServerState(engine=client, tokenizer=client.tokenizer, model_name=model_name,
                       max_model_len=client.info.max_model_len, defaults=defaults or SamplingParams(),
                       api_key=api_key or None, limits=ServerLimits(**limits), history_policy=history_policy)


class BackgroundServer:
    """uvicorn serving `app` on a daemon thread; `port` 0 picks a free one (read `.port` after `start`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", **config: Any):
        """`config`: more uvicorn.Config options (the TUI passes `log_config=None`)."""
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                                    **config))
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self.server.run, name="tsterm-serve", daemon=True)

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)


def add_workstation_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`--serve [--host H] [--port N] [--api-key K]` on the workstation's command line (`tsterm`, `python -m
    tsterm.tui`)."""
    parser.add_argument("--serve", action="store_true", help="also serve the engine over the OpenAI and Anthropic "
                        "APIs (API clients' conversations show as sessions); settings from the profile's server:")
    parser.add_argument("--host", dest="serve_host", metavar="HOST", help="with --serve: the address to bind "
                        "(default: the profile's, 127.0.0.1; any other needs an API key)")
    parser.add_argument("--port", dest="serve_port", metavar="N", type=int, help="with --serve: the port "
                        "(default: the profile's, 8000)")
    parser.add_argument("--api-key", dest="serve_api_key", metavar="KEY", help="with --serve: require this key "
                        "(or set TSTERM_API_KEY)")


def workstation_serve_overrides(args: argparse.Namespace) -> dict | None:
    """The workstation's `--serve` flags as TstermApp's `serve` (None without --serve); --host, --port and
    --api-key need --serve."""
    flags = {"host": args.serve_host, "port": args.serve_port, "api_key": args.serve_api_key}
    if not args.serve:
        given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --serve")
        return None
    if args.serve_port is not None and not 0 <= args.serve_port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.serve_port}")
    return {k: v for k, v in flags.items() if v is not None}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    from tsterm.launch import add_parallel_arguments

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", help="HF-format model directory (or demo:tiny)")
    p.add_argument("--profile", dest="profile", default=argparse.SUPPRESS, help="profile name or YAML path")
    p.add_argument("--host", help="address to bind (default: the profile's server.host, 127.0.0.1; any other "
                   "needs a key)")
    p.add_argument("--port", type=int, help="port (default: the profile's server.port, 8000)")
    p.add_argument("--api-key", dest="api_key", help=f"require `Authorization: Bearer KEY` (or set {API_KEY_ENV})")
    p.add_argument("--model-name", dest="model_name", help="the served model name (default: the profile's or the "
                   "model directory's name)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", help="auto, cpu or cuda[:N]")
    add_parallel_arguments(p)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from tsterm.launch import engine_client_from_args, profile_from_args
    from tsterm.server.app import create_app

    from tsterm.profiles import ServerSettings

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not args.model and not getattr(args, "profile", None):
        args.profile = "default"
    profile = profile_from_args(args)
    settings = profile.server_settings() if profile else ServerSettings()
    host = args.host or settings.host
    port = settings.port if args.port is None else args.port
    check_bind(host, api_key)  # before the (slow) model load
    from tsterm.server.security import check_settings
    from tsterm.server.state import ServerLimits

    check_settings(ServerLimits(**server_limits(settings), bound_host=host), api_key)  # CORS and Host names too
    if not (1 <= port <= 65535):
        raise ConfigError(f"--port must be in 1..65535, got {port}")
    name = args.model_name or settings.model_name or (profile.name if profile else Path(args.model).name)
    with listening_socket(host, port) as sock:  # a busy port fails here, not after the load
        client = engine_client_from_args(args, profile)  # the engine core in its own process, unless told not to
        try:
            state = build_state(client, name, profile.sampling_params() if profile else None, api_key,
                                profile.thinking_history if profile else "preserve", **server_limits(settings),
                                bound_host=host)
            server = uvicorn.Server(uvicorn.Config(create_app(state), host=host, port=port, log_level="info",
                                                   lifespan="off"))
            core = getattr(client, "pid", None)  # EngineCoreProcess: the engine's own process
            print(f"tsterm serve: {name} on http://{host}:{port}/v1 (OpenAI and Anthropic APIs)"
                  f"{', API key required' if api_key else ''}"
                  f"{f'; engine core: process {core}' if core else '; engine core: in this process'}",
                  file=sys.stderr, flush=True)
            server.run(sockets=[sock])
        finally:
            client.shutdown()
    return 0


# a profile's server: keys -> ServerLimits
LIMIT_SETTINGS = ("max_conversations", "conversation_ttl_s", "max_stored_responses", "response_ttl_s", "cors_origins",
                  "allowed_hosts", "cache_isolation")


def server_limits(settings: Any) -> dict[str, Any]:
    """The ServerLimits a profile's `server:` section sets (stores' bounds, CORS, Host names, cache isolation)."""
    limits = {k: v for k in LIMIT_SETTINGS if (v := getattr(settings, k, None)) is not None}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in limits.items()}


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, as uvicorn binds one (SO_REUSEADDR: a port left in TIME_WAIT
    is free, one another process listens on is not); a TstermError (exit 1) naming the address otherwise."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise TstermError(f"cannot listen on {host}:{port}: {e.strerror or e} (check --host)") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        hint = "another server listens there: stop it or choose another --port" if e.errno == errno.EADDRINUSE \
            else "choose another --host or --port"
        raise TstermError(f"cannot listen on {host}:{port}: {e.strerror or e}; {hint}") from None
    return sock

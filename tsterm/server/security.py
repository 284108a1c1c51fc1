"""What the server does about who calls it, besides the API key (app.create_app's check): browsers and DNS rebinding
(the Host allow-list, CORS), and which clients' prompts may share cached KV blocks (`cache_salt`).

- `HostGuard`: a request whose Host header names neither a loopback address (localhost, 127.x, ::1; any port), nor
  the address the server is bound to (`ServerLimits.bound_host`), nor a name of `server.allowed_hosts` gets a 400: a
  web page that rebinds its own DNS name to 127.0.0.1 still sends its own name as the Host, and so cannot drive a
  loopback server. `allowed_hosts: ["*"]` takes any Host (the way to serve a 0.0.0.0 bind under any name).
- `BrowserOrigins`: Starlette's CORS middleware for the origins of `server.cors_origins` (none by default: no browser
  page may read an answer). A request from any other origin passes by it untouched: no CORS header, and a preflight
  is answered as any OPTIONS is (405). `"*"` is refused without an API key (`check_settings`): with one, a page must
  still hold the key.
- `request_salt`: the cache salt a route puts in its RequestInfo, for `AsyncEngine.generate`. A request's own
  `cache_salt` field (vLLM's name) keeps its prompt's blocks from every prompt of another salt; with
  `server.cache_isolation: per_key` the server salts every request with a digest of the API key it presented too
  (keyless servers: one digest for all), so `cached_tokens` tells a client nothing about another key's prompts, or
  about the local user's (whose prompts are unsalted).

`install` adds the first two to an app, inside the request counter (app.py adds that one last, outermost).
"""
from __future__ import annotations

import hashlib
import ipaddress
from urllib.parse import urlsplit

from fastapi import FastAPI, HTTPException
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tsterm.errors import ConfigError
from tsterm.server.errors import APIError, is_anthropic
from tsterm.server.state import ServerLimits, ServerState

# ---- configuration -----------------------------------------------------------------------------------------------

CORS_METHODS = ["GET", "POST", "DELETE", "OPTIONS"]
# what the official SDKs send from a browser (the OpenAI and Anthropic JS SDKs; Stainless's x-stainless-* set)
CORS_HEADERS = [
    "authorization", "content-type", "accept", "x-api-key", "idempotency-key",
    "anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",
    "openai-beta", "openai-organization", "openai-project",
    "x-stainless-arch", "x-stainless-async", "x-stainless-custom-poll-interval", "x-stainless-helper",
    "x-stainless-helper-method", "x-stainless-lang", "x-stainless-os", "x-stainless-package-version",
    "x-stainless-poll-helper", "x-stainless-read-timeout", "x-stainless-retry-count", "x-stainless-runtime",
    "x-stainless-runtime-version", "x-stainless-timeout",
]
CORS_MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


def check_settings(limits: ServerLimits, api_key: str | None) -> None:
    """The CORS origins and Host names of `limits`, each well-formed, and `"*"` origins only behind an API key: a
    ConfigError (one line, naming the profile key) otherwise. `tsterm serve` checks before it loads the model."""
    for origin in limits.cors_origins:
        if origin == "*":
            continue
        parts = urlsplit(origin)
        if not parts.scheme or not parts.netloc or parts.path or parts.query or parts.fragment:
            raise ConfigError(f"server.cors_origins: {origin!r} is not an origin (scheme://host[:port], with no "
                              f"path or trailing slash, as a browser sends it; or \"*\")")
    if "*" in limits.cors_origins and not api_key:
        raise ConfigError('server.cors_origins has "*", which lets every web page call this server: set an API key '
                          "(--api-key or TSTERM_API_KEY) or list the origins that may")
    for name in limits.allowed_hosts:
        if name != "*" and (not name.strip() or any(c in name for c in "/@ \t")):
            raise ConfigError(f"server.allowed_hosts: {name!r} is not a host name (a name or address as in a "
                              f'Host header, any port; or "*")')
    if limits.cache_isolation not in ("none", "per_key"):
        raise ConfigError(f"server.cache_isolation must be none or per_key, got {limits.cache_isolation!r}")


def install(app: FastAPI, state: ServerState) -> None:
    """Check the settings (`check_settings`), then add the middlewares; Starlette runs the last added first: the Host
    check, then CORS (when origins are set)."""
    check_settings(state.limits, state.api_key)
    if state.limits.cors_origins:
        app.add_middleware(BrowserOrigins, origins=state.limits.cors_origins)
    app.add_middleware(HostGuard, limits=state.limits)


# ---- Host --------------------------------------------------------------------------------------------------------


def host_name(host: str) -> str:
    """The name part of a Host header value (or of a bound address, or an allowed_hosts entry), in one spelling:
    lower case, the port and a final dot dropped, an IP address in its canonical form ("[::1]:8000" -> "::1")."""
    name = host.strip().lower()
    if name.startswith("["):  # [IPv6]:port
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:  # name:port (more than one colon: a bare IPv6 address)
        name = name.partition(":")[0]
    name = name.rstrip(".")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def is_loopback_name(name: str) -> bool:
    """`name` (from `host_name`) is localhost or a loopback address (127.0.0.0/8, ::1)."""
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class HostGuard:
    """ASGI middleware: the DNS rebinding guard (the module's docstring). A request without a Host header (HTTP/1.0)
    passes: every browser sends one."""

    def __init__(self, app: ASGIApp, limits: ServerLimits):
        self.app = app
        self.any_host = "*" in limits.allowed_hosts
        self.names = {host_name(h) for h in limits.allowed_hosts if h != "*"}
        if limits.bound_host:
            self.names.add(host_name(limits.bound_host))
        self.max_body_bytes = limits.max_body_bytes

    def allowed(self, host: str) -> bool:
        name = host_name(host)
        return self.any_host or name in self.names or is_loopback_name(name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.any_host:
            return await self.app(scope, receive, send)
        host = Headers(scope=scope).get("host")
        if host is None or self.allowed(host):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # (the server has no websocket route: closed as any unknown one would be)
            return await send({"type": "websocket.close", "code": 1008})
        error = APIError(400, f"Host header {host!r} is not allowed; add {host_name(host)!r} to server.allowed_hosts "
                         f"to serve requests under that name", code="host_not_allowed")
        await drain(receive, self.max_body_bytes)
        await error.response(is_anthropic(Request(scope)))(scope, receive, send)


async def drain(receive: Receive, limit: int) -> None:
    """Read and drop the request's body (up to `limit` bytes) before answering: a server that closes with unread
    request bytes makes the kernel reset the connection, and the client may then lose the answer."""
    drained = 0
    try:
        while drained <= limit:
            message = await receive()
            if message["type"] != "http.request":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body"):
                return
    except HTTPException:  # the request counter's body limit: it has read enough
        return


# ---- CORS --------------------------------------------------------------------------------------------------------


class BrowserOrigins:
    """ASGI middleware: Starlette's CORSMiddleware for requests from `origins` (preflights answered, the answers'
    CORS headers added); every other request, a foreign origin's included, passes to the app untouched."""

    def __init__(self, app: ASGIApp, origins: tuple[str, ...]):
        self.app = app
        self.cors = CORSMiddleware(app, allow_origins=list(origins), allow_methods=CORS_METHODS,
                                   allow_headers=CORS_HEADERS, allow_private_network=True, max_age=CORS_MAX_AGE_S)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            origin = Headers(scope=scope).get("origin")
            if origin is not None and self.cors.is_allowed_origin(origin):
                return await self.cors(scope, receive, send)
        await self.app(scope, receive, send)


# ---- cache isolation ---------------------------------------------------------------------------------------------


def presented_key(headers: Headers) -> str:
    """The API key a request presented (`x-api-key`, else a bearer token), as app.create_app's check reads it."""
    if "x-api-key" in headers:
        return headers["x-api-key"]
    return headers.get("authorization", "").partition(" ")[2].strip()


def request_salt(state: ServerState, request: Request, own: str | None) -> str | None:
    """The engine's cache salt for a request (RequestInfo.cache_salt; None: it shares the cache with every unsalted
    prompt, as before salts): its own `cache_salt` field, and with `cache_isolation: per_key` a digest of the API key
    it presented (of none on a keyless server: all its clients share one salt), each in a namespace of its own, so no
    request's salt can spell another's."""
    if state.limits.cache_isolation != "per_key":
        return None if own is None else f"salt\0{own}"
    key = presented_key(request.headers) if state.api_key is not None else ""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"key\0{digest}" if own is None else f"key\0{digest}\0{own}"

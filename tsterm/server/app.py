"""The ASGI app: `create_app(state)` -> FastAPI with the OpenAI router, `/health`, `/metrics`, the API-key check,
the body-size limit and OpenAI-style error bodies; the Anthropic router (`/v1/messages`) behind the same key check
(`x-api-key` or a bearer token), its errors in Anthropic's shape.
"""
from __future__ import annotations

import asyncio
import hmac

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tsterm.server.anthropic_api import PATH as ANTHROPIC_PATH
from tsterm.server.anthropic_api import is_anthropic
from tsterm.server.anthropic_api import router as anthropic_router
from tsterm.server.errors import APIError
from tsterm.server.metrics import EngineCollector, ServerMetrics
from tsterm.server.openai_api import anthropic_client
from tsterm.server.openai_api import router as openai_router
from tsterm.server.protocol import Health
from tsterm.server.responses_api import router as responses_router
from tsterm.server.security import drain
from tsterm.server.security import install as install_security
from tsterm.server.state import ServerState


class RequestCounter:
    """ASGI middleware, outermost: counts every HTTP request by its route and status code, and answers a declared
    Content-Length past `max_body_bytes` with a 413 (in Anthropic's shape on /v1/messages, else OpenAI's); a chunked body that grows past it is stopped as
    it is read (an HTTPException(413), answered by the app's handler). A POST body is read as JSON whatever its
    Content-Type says (every route takes JSON; `curl -d` sends x-www-form-urlencoded, some clients none): a body
    that is not JSON is then a 400 saying so."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, max_body_bytes: int, routes: list[BaseRoute]):
        self.app, self.metrics, self.max_body_bytes, self.routes = app, metrics, max_body_bytes, routes

    def _endpoint(self, scope: Scope) -> str:
        """The route a request is for, before the router has run (a body refused by its length never reaches it)."""
        for route in self.routes:
            if route.matches(scope)[0] == Match.FULL:
                return route.path
        return "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            error = APIError(413, f"the request body has {int(length)} bytes; this server takes at most "
                             f"{self.max_body_bytes}", code="request_too_large")
            self.metrics.requests.labels(self._endpoint(scope), "413").inc()
            if int(length) <= DRAIN_FACTOR * self.max_body_bytes:
                await drain(receive, DRAIN_FACTOR * self.max_body_bytes)
            anthropic = scope.get("path", "").startswith(ANTHROPIC_PATH)  # no route is matched yet: ask the path
            return await error.response(anthropic)(scope, receive, send)
        if scope.get("method") == "POST":
            scope = _as_json(scope)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    if message.get("more_body"):
                        await drain(receive, DRAIN_FACTOR * self.max_body_bytes)
                    raise HTTPException(413, f"the request body is larger than this server's limit of "
                                        f"{self.max_body_bytes} bytes")
            return message

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, limited_receive, send_status)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status[0])).inc()


def _as_json(scope: Scope) -> Scope:
    """`scope` with a JSON Content-Type, unless it has one (application/json, or any application/*+json)."""
    headers = scope.get("headers") or []
    kind = dict(headers).get(b"content-type", b"").split(b";")[0].strip().lower()
    if kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json")):
        return scope
    return {**scope, "headers": [(k, v) for k, v in headers if k != b"content-type"]
            + [(b"content-type", b"application/json")]}


DRAIN_FACTOR = 4  # a refused body up to this many times the limit is read (and dropped) before the 413


MODELS_PATH = "/v1/models"  # shared by both APIs: an Anthropic client's errors there take its shape


def _anthropic_shape(request: Request) -> bool:
    """Whether an error answers in Anthropic's shape: on its routes, and on the shared ones for its clients."""
    return is_anthropic(request) or (request.url.path.startswith(MODELS_PATH) and anthropic_client(request))


def create_app(state: ServerState) -> FastAPI:
    metrics = ServerMetrics(EngineCollector(state.engine.stats_and_metrics))
    app = FastAPI(title="tsterm", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.metrics = metrics
    store = state.conversations
    metrics.conversations.set_function(lambda: len(store) if store is not None else 0)

    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:  # Anthropic clients
            scheme, token = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(401, "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                           type_="authentication_error", code="invalid_api_key")

    guarded = [Depends(check_key)]
    app.include_router(openai_router, dependencies=guarded)
    app.include_router(anthropic_router, dependencies=guarded)
    app.include_router(responses_router, dependencies=guarded)

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        return Health(model=state.model_name)

    @app.get("/metrics", dependencies=guarded)
    async def scrape() -> Response:
        body = await asyncio.to_thread(generate_latest, metrics.registry)  # the collector waits on the engine
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(_anthropic_shape(request))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                            code="invalid_json").response(_anthropic_shape(request))
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                            for e in errors[:5])
        return APIError(400, message or "invalid request",
                        param=".".join(where) or None).response(_anthropic_shape(request))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:  # logged by Starlette, with its traceback
        return APIError(500, f"internal server error ({type(exc).__name__}): {exc}", type_="server_error",
                        code="internal_error").response(_anthropic_shape(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_=kind).response(_anthropic_shape(request))

    endpoints = [*openai_router.routes, *anthropic_router.routes, *responses_router.routes,
                 *(route for route in app.router.routes if isinstance(route, APIRoute))]
    install_security(app, state)  # the Host check, CORS, the cache salt's reader: inside the request counter
    app.add_middleware(RequestCounter, metrics=metrics, max_body_bytes=state.limits.max_body_bytes, routes=endpoints)
    return app

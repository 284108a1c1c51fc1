"""The server's client-facing error: an OpenAI-style `{"error": {...}}` body with an HTTP status (or Anthropic's
shape on the Anthropic routes)."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from tsterm.server.protocol import ErrorDetail, ErrorResponse

ANTHROPIC_PATH = "/v1/messages"  # the Anthropic routes: their errors take Anthropic's shape


def is_anthropic(request: Request) -> bool:
    """Whether `request` is on an Anthropic route (its errors take Anthropic's shape)."""
    return request.url.path.startswith(ANTHROPIC_PATH)


class APIError(Exception):
    """An error a client caused (or a limit it hit): answered as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()

    def anthropic_body(self) -> dict:
        """Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`."""
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500
                                                                       else "invalid_request_error"),
                                           "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status)


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "api_error"}

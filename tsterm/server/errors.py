"""The server's client-facing error: an OpenAI-style `{"error": {...}}` body with an HTTP status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

from tsterm.server.protocol import ErrorDetail, ErrorResponse


class APIError(Exception):
    """An error a client caused (or a limit it hit): answered as `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                               code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

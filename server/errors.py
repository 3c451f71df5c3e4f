"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ProxyError(Exception):
    """An error answered to the client as an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or kind}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)

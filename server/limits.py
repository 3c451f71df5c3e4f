"""Request bodies bounded while they are read: a declared ``Content-Length`` over the limit is refused before a byte
is read, and the bytes that arrive are counted (a chunked body, or one longer than it said), so that no body larger
than the limit is ever held. ``read_body`` reads a model call's (the proxy reads those itself); ``BodyLimit`` bounds
the admin routes' (which FastAPI reads), with a smaller limit."""

from __future__ import annotations

import re

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aitlrt_server.errors import error_response

MODEL_ROUTE = re.compile(r"/(rollouts/[^/]+/)?v1/")


class BodyTooLarge(HTTPException):
    """413, raised while a body is read (answered OpenAI-style by the app's HTTP error handler)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


async def read_body(request: Request, limit: int) -> bytes:
    """The body of ``request``, or a 413 (``BodyTooLarge``) as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class BodyLimit:
    """ASGI middleware: 413 for an admin route's body over ``limit`` bytes (model routes pass untouched: the proxy
    reads their bodies with ``read_body``, without the cost of a wrapped ``receive`` on every call)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or MODEL_ROUTE.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        limit = self.limit
        declared = next((value for name, value in scope["headers"] if name == b"content-length"), b"")
        if declared.isdigit() and int(declared) > limit:  # not a digit: the HTTP parser has refused it already
            await error_response(413, BodyTooLarge(limit).detail, "request_too_large")(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)

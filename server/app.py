"""The FastAPI app of ``aitlrt-serve``: one ``Proxy`` in ``app.state``, OpenAI-style errors, bounded bodies, and the
routers (model routes that record, trace routes, weight routes, the forced settings, health); who may call which is
in ``routes.deps``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from aitlrt_server.errors import ProxyError, error_response
from aitlrt_server.limits import BodyLimit
from aitlrt_server.proxy import Proxy
from aitlrt_server.routes import health, models, traces, weights
from aitlrt_server.routes import settings as settings_routes  # `settings` is create_app's argument
from aitlrt_server.settings import ServeSettings


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    proxy: Proxy = app.state.proxy
    with contextlib.suppress(ProxyError):  # upstream not up yet: the first call looks again
        await proxy.model_list()
    yield
    await proxy.close()


def create_app(settings: ServeSettings) -> FastAPI:
    # strict_content_type=False: an admin body sent without a Content-Type is still read as JSON. No /docs, /redoc
    # or /openapi.json: a map of the admin routes is of use to no agent.
    app = FastAPI(
        title="aitlrt-serve",
        lifespan=_lifespan,
        strict_content_type=False,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.proxy = Proxy(settings)
    app.add_middleware(BodyLimit, limit=settings.max_admin_body_bytes)

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return error_response(exc.status_code, str(message), "request_too_large" if exc.status_code == 413 else None)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        """An admin body pydantic refused (``routes.bodies``): an OpenAI-style 400 naming the field in ``param``."""
        err = exc.errors()[0]
        loc = err["loc"]
        if len(loc) < 2 or not isinstance(loc[1], str):  # the body as a whole
            if "error" in err.get("ctx", {}):  # unparsable: FastAPI's json_invalid (at loc[1]), or JsonBody's
                at = f" (char {loc[1]})" if len(loc) > 1 else ""
                message = f"request body is not valid JSON: {err['ctx']['error']}{at}"
                return error_response(400, message, "invalid_json")
            return error_response(400, "request body must be a JSON object", "invalid_json")
        param = ".".join(str(part) for part in loc[1:])
        message = err["msg"] if err["type"] == "invalid_value" else f"invalid '{param}': {err['msg']}"
        return error_response(400, message, param=param)

    for router in (models.router, traces.router, weights.router, settings_routes.router, health.router):
        app.include_router(router)
    return app

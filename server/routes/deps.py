"""Dependencies of the routes: the shared Proxy, the API key, the rollout id (from the path or the Bearer key)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from aitlrt_server.errors import ProxyError
from aitlrt_server.proxy import Proxy
from aitlrt_server.store import UNATTRIBUTED, valid_rollout_id

# The dependencies are ``async def``: FastAPI would run plain ``def`` ones in a worker thread, on every call.


async def get_proxy(request: Request) -> Proxy:
    proxy: Proxy = request.app.state.proxy
    return proxy


ProxyDep = Annotated[Proxy, Depends(get_proxy)]


def _api_key(request: Request) -> str | None:
    # Read here, not through ProxyDep: a sub-dependency costs every model call a few microseconds.
    key: str | None = request.app.state.proxy.settings.api_key
    return key


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() or None if auth.lower().startswith("bearer ") else None


async def require_key(request: Request) -> None:
    """401 unless ``Authorization: Bearer <key>`` matches ``--api-key`` (when one is set)."""
    key = _api_key(request)
    if key and _bearer(request) != key:
        raise ProxyError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")


def _checked(rollout_id: str) -> str:
    if not valid_rollout_id(rollout_id):
        raise ProxyError(
            400,
            f"invalid rollout id {rollout_id[:80]!r}: use 1-128 of [A-Za-z0-9._-]",
            code="invalid_rollout_id",
            param="rollout_id",
        )
    return rollout_id


async def path_rollout_id(rollout_id: str) -> str:
    """The ``{rollout_id}`` path parameter, or an OpenAI-style 400."""
    return _checked(rollout_id)


async def key_rollout_id(request: Request) -> str:
    """Plain /v1 routes: the Bearer key is the rollout id (``KEY:ID`` when --api-key is set)."""
    token = _bearer(request)
    key = _api_key(request)
    if key:
        if token == key:
            return UNATTRIBUTED
        prefix = key + ":"
        if not token or not token.startswith(prefix):
            raise ProxyError(
                401, "invalid or missing API key (Bearer <key> or <key>:<rollout_id>)", code="invalid_api_key"
            )
        return _checked(token[len(prefix) :])
    return _checked(token) if token else UNATTRIBUTED


RolloutId = Annotated[str, Depends(path_rollout_id)]
KeyRolloutId = Annotated[str, Depends(key_rollout_id)]

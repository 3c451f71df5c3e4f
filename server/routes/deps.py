"""Dependencies of the routes: the shared Proxy, and who may call what.

Admin routes take the admin key alone (``require_admin``). A model route takes the admin key or the rollout's own
token (``aitlrt.common.keys.rollout_token``): ``/rollouts/<id>/v1/...`` as ``Bearer TOKEN`` (or ``ID:TOKEN``), plain
``/v1/...`` as ``Bearer ID:TOKEN``, which also names the rollout (the admin key alone: ``_unattributed``).
A missing or unknown credential is a 401; a rollout's valid token where it does not open the route, a 403.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from aitlrt.common.keys import rollout_token
from aitlrt_server.errors import ProxyError
from aitlrt_server.proxy import Proxy
from aitlrt_server.store import UNATTRIBUTED, valid_rollout_id

# The dependencies are ``async def``: FastAPI would run plain ``def`` ones in a worker thread, on every call.


async def get_proxy(request: Request) -> Proxy:
    proxy: Proxy = request.app.state.proxy
    return proxy


ProxyDep = Annotated[Proxy, Depends(get_proxy)]


def _admin_key(request: Request) -> str:
    # Read here, not through ProxyDep: a sub-dependency costs every model call a few microseconds.
    key: str = request.app.state.proxy.settings.api_key
    return key


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() or None if auth.lower().startswith("bearer ") else None


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _split(token: str) -> tuple[str | None, str]:
    """``ID:SECRET`` → (ID, SECRET); a bare ``SECRET`` → (None, SECRET). Rollout ids hold no ``:``."""
    named, sep, secret = token.partition(":")
    return (named, secret) if sep else (None, token)


def _opens(key: str, rollout_id: str, secret: str) -> bool:
    """Whether ``secret`` opens rollout ``rollout_id``'s model routes: its token, or the admin key."""
    return _same(secret, rollout_token(key, rollout_id)) or _same(secret, key)


def _unauthorized(how: str) -> ProxyError:
    return ProxyError(401, f"invalid or missing API key ({how})", code="invalid_api_key")


def _forbidden(named: str, what: str) -> ProxyError:
    return ProxyError(403, f"the token of rollout {named!r} does not open {what}", code="forbidden")


async def require_admin(request: Request) -> None:
    """401 unless ``Authorization: Bearer <admin key>``; 403 for a rollout's valid ``ID:TOKEN``."""
    key, token = _admin_key(request), _bearer(request)
    if token is not None and _same(token, key):
        return
    named, secret = _split(token or "")
    if named and valid_rollout_id(named) and _opens(key, named, secret):
        raise _forbidden(named, f"{request.method} {request.url.path}: only the admin key does")
    raise _unauthorized("Authorization: Bearer <admin key>")


def _checked(rollout_id: str) -> str:
    if not valid_rollout_id(rollout_id):
        raise ProxyError(
            400,
            f"invalid rollout id {rollout_id[:80]!r}: use 1-128 of [A-Za-z0-9._-]",
            code="invalid_rollout_id",
            param="rollout_id",
        )
    return rollout_id


async def path_rollout_id(request: Request, rollout_id: str) -> str:
    """The ``{rollout_id}`` path parameter of a model route (an OpenAI-style 400 if malformed), once the Bearer key
    is the rollout's token (``TOKEN`` or ``ID:TOKEN``) or the admin key."""
    _checked(rollout_id)
    key, token = _admin_key(request), _bearer(request)
    if token is None:
        raise _unauthorized("Authorization: Bearer <the rollout's token>")
    if _same(token, key):
        return rollout_id
    named, secret = _split(token)
    if named in (None, rollout_id) and _opens(key, rollout_id, secret):
        return rollout_id
    if named and valid_rollout_id(named) and _opens(key, named, secret):
        raise _forbidden(named, f"rollout {rollout_id!r}")
    raise _unauthorized("Authorization: Bearer <the rollout's token>")


async def admin_path_rollout_id(rollout_id: str) -> str:
    """The ``{rollout_id}`` path parameter of an admin route (the key is checked by ``require_admin``)."""
    return _checked(rollout_id)


async def key_rollout_id(request: Request) -> str:
    """Plain /v1 routes: the rollout named by ``Bearer ID:TOKEN`` (the admin key alone: ``_unattributed``)."""
    key, token = _admin_key(request), _bearer(request)
    if token is not None and _same(token, key):
        return UNATTRIBUTED
    named, secret = _split(token or "")
    if not named:
        raise _unauthorized("Authorization: Bearer <rollout_id>:<the rollout's token>")
    if not _opens(key, _checked(named), secret):
        raise _unauthorized("Authorization: Bearer <rollout_id>:<the rollout's token>")
    return named


RolloutId = Annotated[str, Depends(path_rollout_id)]
AdminRolloutId = Annotated[str, Depends(admin_path_rollout_id)]
KeyRolloutId = Annotated[str, Depends(key_rollout_id)]

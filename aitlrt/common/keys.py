"""The keys of ``aitlrt-serve``: one admin key per server, and per-rollout tokens derived from it.

* The **admin key** opens every route. ``aitlrt-serve`` reads it from ``$AITLRT_API_KEY`` (or its key file);
  ``ServeProcess`` generates one for each server it starts and remembers it by URL here; a client of a server it
  did not start (``--serve URL``, ``--proxy URL``, a jobscript's trainer) takes it from ``$AITLRT_API_KEY``.
* A **rollout token** (``rollout_token``: HMAC-SHA256 of the rollout id under the admin key, hex) opens only that
  rollout's model routes; the runner gives each agent its own. Whoever holds the admin key can mint any of them.
* vLLM's own key (``vllm_key``) is derived the same way, under a name no rollout id can take (``:``).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets

ENV = "AITLRT_API_KEY"
"""The environment variable that carries the admin key to ``aitlrt-serve`` and to clients of a server they did not
start; read once and removed from the environment, so that no child (an agent, a graded test) inherits it."""

_by_url: dict[str, str] = {}


def new_key() -> str:
    """A fresh admin key: 256 random bits, hex."""
    return secrets.token_hex(32)


def _derive(admin_key: str, name: str) -> str:
    return hmac.new(admin_key.encode(), name.encode(), hashlib.sha256).hexdigest()


def rollout_token(admin_key: str, rollout_id: str) -> str:
    """The token that opens rollout ``rollout_id``'s model routes (and nothing else)."""
    return _derive(admin_key, f"rollout:{rollout_id}")


def vllm_key(admin_key: str) -> str:
    """The ``--api-key`` of the vLLM child of the server whose admin key this is."""
    return _derive(admin_key, "vllm:")


@functools.cache
def env_key() -> str | None:
    """``$AITLRT_API_KEY``, taken out of the environment on the first call (later calls return the same)."""
    return os.environ.pop(ENV, None) or None


def remember(url: str, key: str) -> None:
    """The admin key of the server at ``url`` (one this process started)."""
    _by_url[url.rstrip("/")] = key


def admin_key(url: str) -> str | None:
    """The admin key for the server at ``url``: the one remembered for it, else ``$AITLRT_API_KEY``."""
    return _by_url.get(url.rstrip("/")) or env_key()


def bearer(key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` (no header without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def admin_headers(url: str) -> dict[str, str]:
    """The headers of an admin call to the server at ``url``."""
    return bearer(admin_key(url))

"""What the proxy forces on every call, for a trainer to check against its own config."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from aitlrt_server.routes.deps import ProxyDep, require_admin

router = APIRouter(dependencies=[Depends(require_admin)])


@router.get("/settings")
async def settings(proxy: ProxyDep) -> dict[str, Any]:
    """``{"sampling": {...}}``: the sampling parameters forced on every call (a key absent: the agent's own)."""
    return {"sampling": proxy.settings.sampling}

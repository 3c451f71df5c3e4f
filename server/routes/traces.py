"""The trace routes: list, read, delete and open rollouts, and limit their calls."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from aitlrt_server.errors import ProxyError
from aitlrt_server.routes.bodies import Limits, Opening
from aitlrt_server.routes.deps import AdminRolloutId, ProxyDep, require_admin

router = APIRouter(dependencies=[Depends(require_admin)])


@router.get("/rollouts")
async def rollouts(proxy: ProxyDep) -> dict[str, Any]:
    return {"rollouts": proxy.store.summary()}


@router.get("/rollouts/{rollout_id}")
async def trace(rollout_id: AdminRolloutId, proxy: ProxyDep) -> dict[str, Any]:
    calls = proxy.store.get(rollout_id)
    if calls is None:
        raise ProxyError(404, f"no calls recorded for rollout {rollout_id!r}", code="rollout_not_found")
    return {"rollout_id": rollout_id, "calls": calls}


@router.delete("/rollouts/{rollout_id}")
async def delete(rollout_id: AdminRolloutId, proxy: ProxyDep) -> dict[str, Any]:
    """Forget a rollout: its calls (kept in the journal on disk), its call limit and its seed."""
    if not proxy.forget(rollout_id):
        raise ProxyError(404, f"nothing recorded for rollout {rollout_id!r}", code="rollout_not_found")
    return {"deleted": rollout_id}


@router.put("/rollouts/{rollout_id}")
async def open_rollout(rollout_id: AdminRolloutId, opening: Opening, proxy: ProxyDep) -> dict[str, Any]:
    """Start a rollout afresh in one round trip: forget its earlier calls, set its call limit and sampling seed
    (and accept its calls again if it was deleted)."""
    proxy.set_call_limit(rollout_id, opening.max_calls)
    proxy.set_seed(rollout_id, opening.seed)
    deleted = proxy.store.delete(rollout_id)
    proxy.store.reopen(rollout_id)
    return {"rollout_id": rollout_id, "max_calls": opening.max_calls, "seed": opening.seed, "deleted": deleted}


@router.put("/rollouts/{rollout_id}/limits")
async def set_limits(rollout_id: AdminRolloutId, limits: Limits, proxy: ProxyDep) -> dict[str, Any]:
    proxy.set_call_limit(rollout_id, limits.max_calls)
    return {"rollout_id": rollout_id, "max_calls": limits.max_calls}

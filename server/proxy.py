"""The proxy's shared state and its upstream calls: ``Proxy`` (store, weight gate, metrics, vLLM client) and one
recorded model call, passed through to vLLM and back untouched but for the run's sampling and our extras."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
from aiohttp.http_exceptions import LineTooLong
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from aitlrt_server.continuity import CONTINUED, OFF, Continuation, Continuity, chat_response, completion_body
from aitlrt_server.errors import ProxyError, error_body
from aitlrt_server.exchange import (
    AgentAsked,
    CallOutput,
    Endpoint,
    StreamAccumulator,
    build_record,
    call_seed,
    output_from_response,
    parse_sse_line,
    prepare_request,
    strip_response,
)
from aitlrt_server.limits import read_body
from aitlrt_server.metrics import ProxyMetrics
from aitlrt_server.settings import ServeSettings
from aitlrt_server.store import Life, TraceStore
from aitlrt_server.weights import WeightGate

_UPSTREAM_PATH: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
TAG_HEADER = "x-aitlrt-tag"
log = logging.getLogger(__name__)


class Proxy:
    """State shared by the routes: the trace store, the weight gate, metrics and the upstream client."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.store = TraceStore(settings.run_dir)
        self.gate = WeightGate()
        self.metrics = ProxyMetrics()
        self._session: aiohttp.ClientSession | None = None
        self.served_models: list[str] = []
        self.model_roots: dict[str, str] = {}
        self.max_model_lens: dict[str, int] = {}
        self.continuity = (
            Continuity(settings.continuity_tokenizer, settings.chat_template)
            if settings.continuity and settings.token_ids
            else None
        )
        self.call_limits: dict[str, int] = {}
        self.seeds: dict[str, int] = {}

    # ---- upstream -----------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        """The upstream client (aiohttp: ~1 ms per call here against httpx's ~3.5 ms; bench/proxy.py)."""
        if self._session is None:
            key = self.settings.upstream_api_key
            self._session = aiohttp.ClientSession(
                self.settings.upstream,
                headers={"Authorization": f"Bearer {key}"} if key else None,
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
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0) if timeout_s else self.session.timeout
        try:
            async with self.session.request(method, path, json=body, timeout=timeout) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._upstream_error(exc) from None

    async def reload_weights(self, path: str) -> None:
        """Have vLLM load the safetensors in ``path`` and drop its prefix cache (callers hold the weight gate)."""
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        for route, body in (("/collective_rpc", rpc), ("/reset_prefix_cache", None)):
            status, content = await self.request("POST", route, body)
            if status != 200:
                raise ProxyError(
                    502,
                    f"vLLM {route} failed with {status}: {content[:500].decode(errors='replace')}",
                    code="weight_update_failed",
                )

    async def probe(self, token_ids: list[int]) -> dict[str, Any]:
        """The weight version and the served model's logprob of each of ``token_ids`` after the ones before it
        (vLLM's prompt logprobs; none for the first token). Held like a call: a weight update waits for it."""
        model = await self.model_for(None)
        body = {"model": model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0}
        async with self.gate.generation(self.settings.request_timeout_s) as version:
            status, content = await self.request("POST", "/v1/completions", body)
        if status != 200:
            raise ProxyError(
                400 if status < 500 else 502,
                f"vLLM answered the probe with {status}: {content[:500].decode(errors='replace')}",
                code="probe_failed",
            )
        try:  # prompt_logprobs: one dict per prompt token (None for the first), keyed by token id
            entries = json.loads(content)["choices"][0]["prompt_logprobs"][1:]
            logprobs = [float(entry[str(t)]["logprob"]) for entry, t in zip(entries, token_ids[1:], strict=True)]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ProxyError(
                502,
                "vLLM's answer to the probe lacks the prompt logprobs of its tokens: "
                + content[:300].decode(errors="replace"),
                code="probe_failed",
            ) from None
        return {"weight_version": version, "model": model, "logprobs": logprobs}

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self.continuity is not None:
            self.continuity.close()
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
        cards = data.get("data", [])
        self.served_models = [m["id"] for m in cards]
        self.model_roots = {m["id"]: m["root"] for m in cards if isinstance(m.get("root"), str)}
        self.max_model_lens = {m["id"]: m["max_model_len"] for m in cards if isinstance(m.get("max_model_len"), int)}
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

    # ---- recorded calls -------------------------------------------------------------------------
    def set_call_limit(self, rollout_id: str, max_calls: int | None) -> None:
        """Refuse calls of ``rollout_id`` past ``max_calls`` (None: no limit)."""
        if max_calls is None:
            self.call_limits.pop(rollout_id, None)
        else:
            self.call_limits[rollout_id] = max_calls

    def set_seed(self, rollout_id: str, seed: int | None) -> None:
        """Sample every call of ``rollout_id`` with a seed derived from ``seed`` and the call's index (None: the
        agent's own)."""
        if seed is None:
            self.seeds.pop(rollout_id, None)
        else:
            self.seeds[rollout_id] = seed

    def forget(self, rollout_id: str) -> bool:
        """Drop everything kept about ``rollout_id``: its recorded calls (a tombstone in the journal), call limit
        and seed, and refuse its later calls until it is opened again; whether anything was kept."""
        opened = self.call_limits.pop(rollout_id, None) is not None
        opened |= self.seeds.pop(rollout_id, None) is not None
        known = self.store.delete(rollout_id) or opened
        if known:
            self.store.close_rollout(rollout_id)
        return known

    async def call(self, request: Request, endpoint: Endpoint, rollout_id: str) -> Response:
        body = await _json_body(request, self.settings.max_body_bytes)
        model = await self.model_for(body.get("model"))
        upstream_body, asked = prepare_request(body, endpoint, self.settings.sampling, model, self.settings.token_ids)
        tag = request.headers.get(TAG_HEADER)

        if self.store.is_closed(rollout_id):
            # Not recorded: the rollout's trace was read and deleted (400: litellm does not retry it).
            self.metrics.errors.labels("rollout_closed").inc()
            raise ProxyError(
                400,
                f"rollout {rollout_id!r} was deleted; open it again first (PUT /rollouts/{rollout_id})",
                code="rollout_closed",
            )
        index, life = self.store.start_call(rollout_id)
        if (seed := self.seeds.get(rollout_id)) is not None:
            upstream_body["seed"] = call_seed(seed, index)
        limit = self.call_limits.get(rollout_id)
        if limit is not None and index >= limit:
            # 400, not 429 or 403: Aider (litellm) retries those for over a minute; this refusal is final.
            message = f"rollout {rollout_id!r} reached its limit of {limit} model calls"
            refused = _Call(self, rollout_id, (index, life), endpoint, None, self.gate.version, tag)  # no body kept
            refused.finish(None, 400, message, "call_limit")
            raise ProxyError(400, message, code="call_limit")
        continuity, sent = None, None
        if endpoint == "chat":
            continuity, sent = await self._continue(rollout_id, upstream_body, tag)
            self.metrics.continuity.labels(continuity).inc()
        stack = AsyncExitStack()
        version = await stack.enter_async_context(self.gate.generation(self.settings.request_timeout_s))
        self.metrics.inflight.inc()
        stack.callback(self.metrics.inflight.dec)
        call = _Call(self, rollout_id, (index, life), endpoint, upstream_body, version, tag)
        call.continuity, call.sent = continuity, sent
        try:
            if upstream_body.get("stream"):
                return await self._stream(call, asked, stack)
            async with stack:
                return await self._unary(call, asked)
        except BaseException:
            await stack.aclose()
            raise

    async def _continue(
        self, rollout_id: str, body: dict[str, Any], tag: str | None
    ) -> tuple[str, tuple[int, dict[str, Any]] | None]:
        """Whether a chat call continues its rollout's previous call (``continuity``): ``CONTINUED`` with the call it
        continues and the ``/v1/completions`` body to send, or why not (the ordinary path) and None."""
        if self.continuity is None:
            return OFF, None
        model = body["model"]
        try:
            plan = await self.continuity.plan(self.store.get(rollout_id), body, tag, self.model_roots.get(model))
        except Exception:  # never a reason to fail a call: the ordinary path
            log.exception("token continuity: planning failed")
            return "error", None
        if not isinstance(plan, Continuation):
            return plan, None
        max_model_len = self.max_model_lens.get(model)
        if max_model_len is None and body.get("max_tokens") is None:
            return "no_max_model_len", None
        if max_model_len is not None and len(plan.prompt_token_ids) >= max_model_len:
            return "context_full", None  # vLLM's chat route tells the agent, as without continuity
        return CONTINUED, (plan.base_index, completion_body(body, plan.prompt_token_ids, max_model_len))

    async def _unary(self, call: _Call, asked: AgentAsked) -> Response:
        path, body = _UPSTREAM_PATH[call.endpoint], call.request
        if call.sent is not None:
            path, body = _UPSTREAM_PATH["completions"], call.sent[1]
        try:
            status, content = await self.request("POST", path, body)
        except ProxyError as err:
            call.finish(None, err.status, err.message, err.code)
            raise
        if status != 200:
            return call.upstream_failed(status, content)
        data = json.loads(content)
        if call.sent is not None:
            data = chat_response(data)
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
            status = 499
            error: str | None = "client disconnected before the stream ended"
            code: str | None = "client_disconnected"
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
                yield _error_event(status, error, code)
            except (LineTooLong, ValueError) as exc:  # over aiohttp's line limit (2 x read_bufsize), or not UTF-8 JSON
                status, code = 502, "upstream_bad_stream"
                error = f"stream broken: vLLM sent a line that cannot be read ({str(exc)[:200]})"
                yield _error_event(status, error, code)
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
        slot: tuple[int, Life],
        endpoint: Endpoint,
        request: dict[str, Any] | None,
        version: int,
        tag: str | None,
    ) -> None:
        """``slot``: the call's index and its rollout's life (``TraceStore.start_call``); ``request``: the body sent
        to vLLM (None for a call refused before)."""
        self.proxy, self.rollout_id, self.endpoint = proxy, rollout_id, endpoint
        self.index, self.life = slot
        self.request, self.version, self.tag = request, version, tag
        self.continuity: str | None = None
        """``CONTINUED``, or why a chat call was not (``aitlrt_server.continuity``); None for other calls."""
        self.sent: tuple[int, dict[str, Any]] | None = None
        """A continued call's: the index of the call it continues and the ``/v1/completions`` body sent."""
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
                continuity=self.continuity,
                continued_from=None if self.sent is None else self.sent[0],
                status=status,
                error=error,
                error_code=code,
            ),
            self.life,
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


def _error_event(status: int, message: str, code: str | None) -> bytes:
    """An OpenAI-style error as one server-sent event (a stream that broke after its 200)."""
    return b"data: " + json.dumps(error_body(status, message, code)).encode() + b"\n\n"


async def _json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """A model call's JSON object body, parsed as is (whatever its content type), or an OpenAI-style 400 (413 over
    ``max_bytes``, known before or while it is read)."""
    raw = await read_body(request, max_bytes)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProxyError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object", code="invalid_json")
    return body

"""A scripted, vLLM-shaped OpenAI server for fault injection and for measuring the proxy alone.

It answers instantly with vLLM's extra fields (``prompt_token_ids``, per-choice ``token_ids``, logprobs),
unless the last message (or prompt) asks for a fault:

- ``fault:slow:<seconds>``  answer after sleeping
- ``fault:error500``        500 with a plain-text body
- ``fault:error400``        400 with an OpenAI-style body
- ``fault:stream-drop``     (streaming) send two chunks, then cut the connection
- ``fault:stream-longline`` (streaming) send one chunk, then one line longer than aiohttp reads (``LONG_LINE``)

and ``POST /script {"match": S, "reply": R}`` makes every later call whose messages contain ``S`` answer
``R`` (to drive a real agent through a known edit).

Run: ``python -m tests.helpers.scripted_upstream --port 8001``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "scripted"
LONG_LINE = 2**20
"""Bytes of the over-long stream line: over aiohttp's limit (2 x its read_bufsize of 256 KiB)."""
REPLY_TOKENS = [("Hello", 101), (" from", 102), (" the", 103), (" script", 104)]


def _last_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        content = body["messages"][-1].get("content")
        return content if isinstance(content, str) else json.dumps(content)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return [1 + (len(_last_text(body)) + i) % 500 for i in range(8)]


def _logprobs_entry(chat: bool, tokens: list[tuple[str, int]]) -> dict[str, Any]:
    if chat:
        return {
            "content": [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t, _ in tokens]
        }
    return {
        "tokens": [t for t, _ in tokens],
        "token_logprobs": [-0.5] * len(tokens),
        "text_offset": [0] * len(tokens),
        "top_logprobs": [{t: -0.5} for t, _ in tokens],
    }


def _tokens_of(reply: str) -> list[tuple[str, int]]:
    """Split a scripted reply into fake tokens (words with their leading spaces) with made-up ids."""
    return [(piece, 1000 + n) for n, piece in enumerate(re.findall(r"\s*\S+|\s+", reply))]


def create_app() -> FastAPI:
    app = FastAPI()
    scripts: list[tuple[str, str]] = []

    @app.post("/script")
    async def script(request: Request) -> dict[str, int]:
        body = await request.json()
        scripts.append((body["match"], body["reply"]))
        return {"scripts": len(scripts)}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "aitlrt"}]}

    async def answer(request: Request, chat: bool) -> Response:
        body = await request.json()
        text = _last_text(body)
        if text.startswith("fault:slow:"):
            await asyncio.sleep(float(text.split(":")[2].split()[0]))
        elif text == "fault:error500":
            return PlainTextResponse("boom: scripted internal error", status_code=500)
        elif text == "fault:error400":
            return JSONResponse(
                {"error": {"message": "scripted bad request", "type": "BadRequestError", "param": None, "code": 400}},
                status_code=400,
            )
        everything = json.dumps(body.get("messages") or body.get("prompt"))
        scripted = next((_tokens_of(r) for m, r in reversed(scripts) if json.dumps(m)[1:-1] in everything), None)
        reply = scripted or REPLY_TOKENS
        max_tokens = body.get("max_tokens") or len(reply)
        tokens = reply[:max_tokens]
        finish = "stop" if len(tokens) == len(reply) else "length"
        prompt_ids = _prompt_ids(body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-scripted-{time.monotonic_ns()}"
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(tokens),
            "total_tokens": len(prompt_ids) + len(tokens),
        }
        if body.get("stream"):
            return StreamingResponse(
                _stream(rid, chat, tokens, finish, prompt_ids, usage, text), media_type="text/event-stream"
            )
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish,
            "token_ids": [i for _, i in tokens],
            "logprobs": _logprobs_entry(chat, tokens),
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(t for t, _ in tokens)}
        else:
            choice["text"] = "".join(t for t, _ in tokens)
            choice["prompt_token_ids"] = prompt_ids
        data = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [choice],
            "usage": usage,
        }
        if chat:
            data["prompt_token_ids"] = prompt_ids
        return JSONResponse(data)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    return app


async def _stream(
    rid: str,
    chat: bool,
    tokens: list[tuple[str, int]],
    finish: str,
    prompt_ids: list[int],
    usage: dict[str, int],
    text: str,
) -> AsyncIterator[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    obj = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        yield event(
            {
                "id": rid,
                "object": obj,
                "model": MODEL,
                "prompt_token_ids": prompt_ids,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        )
    for n, (tok, tid) in enumerate(tokens):
        if text == "fault:stream-drop" and n == 2:
            raise RuntimeError("scripted stream drop")
        if text == "fault:stream-longline" and n == 1:
            yield event({"id": rid, "object": obj, "model": MODEL, "choices": [], "padding": "x" * LONG_LINE})
        last = n == len(tokens) - 1
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": [tid],
            "logprobs": _logprobs_entry(chat, [(tok, tid)]),
            "finish_reason": finish if last else None,
        }
        if chat:
            choice["delta"] = {"content": tok}
        else:
            choice["text"] = tok
            if n == 0:
                choice["prompt_token_ids"] = prompt_ids
        yield event({"id": rid, "object": obj, "model": MODEL, "choices": [choice]})
    yield event({"id": rid, "object": obj, "model": MODEL, "choices": [], "usage": usage})
    yield b"data: [DONE]\n\n"


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    # a slow call still sleeping (its caller gone) must not hold up the end of the test session
    uvicorn.run(
        create_app(), host=args.host, port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=1
    )


if __name__ == "__main__":
    main()

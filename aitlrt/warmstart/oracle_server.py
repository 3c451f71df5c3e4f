"""The oracle teacher as an OpenAI-compatible chat-completions server (``aitlrt.warmstart.oracle`` answers).

It answers like vLLM does for ``aitlrt-serve``: top-level ``prompt_token_ids`` (the policy tokenizer's chat template
applied to the messages, with the generation prompt), the choice's ``token_ids`` (the answer's tokens and the end of
turn) and, when asked, ``logprobs.content`` (0.0 per token: the oracle is certain), so the proxy records oracle
calls exactly as it records the policy's. Non-streamed only; sampling parameters and ``max_tokens`` are ignored.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from aitlrt.common.git import git
from aitlrt.common.model import resolve_model
from aitlrt.common.procs import free_port, wait_http
from aitlrt.tasks.patches import changed_paths
from aitlrt.tasks.task import Task
from aitlrt.warmstart.oracle import EDIT_FORMATS, OracleFile, OracleTask, answer, render
from aitlrt.warmstart.oracle_shell import SHELL, answer_shell

log = logging.getLogger(__name__)

ORACLE_MODEL = "oracle"


def oracle_task(task: Task) -> OracleTask:
    """The files ``task``'s oracle patch changes, at the task's start and fixed (applied in a scratch repository:
    the task's cached one is left untouched, so no agent can find the fix in it)."""
    repo, base = task.checkout()
    paths = changed_paths(task.patch)
    existing = set(git("ls-tree", "-r", "--name-only", base, "--", *paths, cwd=repo).splitlines()) if paths else set()
    with tempfile.TemporaryDirectory(prefix="aitlrt-oracle-") as tmp:
        root = Path(tmp)
        git("init", "-q", cwd=root)
        before = {}
        for path in paths:
            before[path] = git("show", f"{base}:{path}", cwd=repo) if path in existing else ""
            if path in existing:
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_text(before[path])
        patch = task.patch if task.patch.endswith("\n") else task.patch + "\n"
        git("apply", "--whitespace=nowarn", "-", cwd=root, input=patch)
        files = [
            OracleFile(path, before[path], (root / path).read_text() if (root / path).exists() else "")
            for path in paths
        ]
    return OracleTask(task.instance_id, task.problem_statement, tuple(f for f in files if f.before != f.after))


def fix_patch(oracle: OracleTask) -> str:
    """The oracle fix as git writes it: the diff from the files at the task's start to the fixed files, made as
    ``aitlrt.common.workspace.patch_of`` makes an agent's, so an agent that writes exactly these files has exactly
    this patch. Its text may differ from the task's ``patch`` for the same change: a generated task's patch is
    its mutation's diff reversed, and where lines moved (``invert_if``, ``shuffle_statements``) git's diff of the
    fix keeps the other side's lines as context, which costs patch similarity (~0.8) though the files are equal."""
    with tempfile.TemporaryDirectory(prefix="aitlrt-oracle-") as tmp:
        root = Path(tmp)
        git("init", "-q", cwd=root)
        for f in oracle.files:
            if f.before:
                (root / f.path).parent.mkdir(parents=True, exist_ok=True)
                (root / f.path).write_text(f.before)
        git("add", "-A", cwd=root)
        git("-c", "commit.gpgsign=false", "commit", "-q", "--allow-empty", "-m", "start", cwd=root)
        for f in oracle.files:
            if f.after:
                (root / f.path).parent.mkdir(parents=True, exist_ok=True)
                (root / f.path).write_text(f.after)
            else:
                (root / f.path).unlink(missing_ok=True)
        git("add", "-A", cwd=root)
        return git("diff", "--cached", "--binary", "HEAD", cwd=root)


def oracle_tasks(tasks: Iterable[Task]) -> dict[str, OracleTask]:
    """``oracle_task`` of each of ``tasks`` by instance id; one whose fix does not apply is left out with a warning."""
    out = {}
    for task in tasks:
        try:
            out[task.instance_id] = oracle_task(task)
        except (RuntimeError, ValueError) as exc:
            log.warning("oracle: leaving out task %s: %s", task.instance_id, exc)
    return out


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


FORMATS = (*EDIT_FORMATS, SHELL)
"""Aider's edit formats (``aitlrt.warmstart.oracle``) and mini-swe-agent's shell actions
(``aitlrt.warmstart.oracle_shell``)."""


class OracleResponder:
    """Answers chat requests for ``tasks`` (``Task``s, or their ``oracle_task`` already read) in ``edit_format``
    (one of ``FORMATS``), with token ids from ``tokenizer`` (the policy's: a path, Hub id or ``bundled``, the
    default); with ``decoy_first`` (Aider's formats), a decoy edit until the chat holds the tests' output
    (``aitlrt.warmstart.oracle.answer``)."""

    def __init__(
        self,
        tasks: Sequence[Task | OracleTask],
        edit_format: str,
        tokenizer: str | None = None,
        model_name: str = ORACLE_MODEL,
        *,
        decoy_first: bool = False,
    ) -> None:
        from transformers import AutoTokenizer

        if edit_format not in FORMATS:
            raise ValueError(f"the oracle writes the formats {FORMATS}, not {edit_format!r}")
        self.edit_format = edit_format
        self.model_name = model_name
        self.decoy_first = decoy_first
        self.tasks = [oracle for oracle in map(self._load, tasks) if oracle is not None]
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(tokenizer or "bundled"))
        self._lock = threading.Lock()  # a fast tokenizer is not to be shared by threads at once

    def _load(self, task: Task | OracleTask) -> OracleTask | None:
        """``task``'s files, or None with a warning when its fix does not apply or cannot be written in the edit
        format (its requests are then answered ``DONE``); a patch writes any fix (``SHELL``)."""
        try:
            oracle = task if isinstance(task, OracleTask) else oracle_task(task)
            if self.edit_format != SHELL:
                render(oracle.files, self.edit_format)
        except (RuntimeError, ValueError) as exc:
            log.warning("oracle: leaving out task %s: %s", task.instance_id, exc)
            return None
        return oracle

    def tokens(self, messages: list[dict[str, Any]], text: str) -> tuple[list[int], list[int]]:
        """The prompt's token ids (chat template with the generation prompt) and the answer's, end of turn last."""
        with self._lock:  # as vLLM does: the template rendered as text, then encoded without special tokens
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = self.tokenizer.encode(str(rendered), add_special_tokens=False)
            completion = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return list(prompt), completion

    def reply(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion for a valid request ``body``."""
        messages = body["messages"]
        started = time.monotonic()
        if self.edit_format == SHELL:
            text = answer_shell(self.tasks, messages)
        else:
            text = answer(self.tasks, messages, self.edit_format, decoy_first=self.decoy_first)
        prompt_ids, completion_ids = self.tokens(messages, text)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop",
        }
        out: dict[str, Any] = {
            "id": f"chatcmpl-oracle-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion_ids),
                "total_tokens": len(prompt_ids) + len(completion_ids),
            },
        }
        if body.get("logprobs"):
            with self._lock:
                pieces = [str(self.tokenizer.decode([t])) for t in completion_ids]
            choice["logprobs"] = {
                "content": [{"token": p, "logprob": 0.0, "bytes": list(p.encode()), "top_logprobs": []} for p in pieces]
            }
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = completion_ids
        log.debug("oracle answered %d chars in %.3fs", len(text), time.monotonic() - started)
        return out


def create_app(responder: OracleResponder) -> FastAPI:
    app = FastAPI(title="aitlrt oracle teacher")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": responder.model_name, "object": "model", "owned_by": "aitlrt"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return _error(400, f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            return _error(400, "'messages' must be a list of objects with a 'role'", "messages")
        if body.get("stream"):
            return _error(400, "the oracle teacher does not stream: send stream=false", "stream")
        return JSONResponse(await run_in_threadpool(responder.reply, body))

    return app


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """``app`` (which answers ``GET /health``) served by uvicorn from a thread of this process on a free port;
    yields its URL."""
    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    try:
        wait_http(f"{url}/health", timeout_s=30)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def oracle_server(
    tasks: Sequence[Task | OracleTask],
    edit_format: str,
    *,
    tokenizer: str | None = None,
    model_name: str = ORACLE_MODEL,
    host: str = "127.0.0.1",
    decoy_first: bool = False,
) -> Iterator[str]:
    """The oracle teacher for ``tasks`` served from a thread of this process (``OracleResponder``); yields its URL."""
    responder = OracleResponder(tasks, edit_format, tokenizer, model_name, decoy_first=decoy_first)
    with serve_in_thread(create_app(responder), host) as url:
        log.info(
            "oracle teacher for %d tasks (%s format%s) at %s",
            len(responder.tasks),
            edit_format,
            ", decoy first" if decoy_first else "",
            url,
        )
        yield url

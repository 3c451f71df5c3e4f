"""Shared fixtures: one real vLLM CPU server behind one real ``aitlrt-serve`` for the whole session,
a scripted vLLM-shaped upstream for fault injection, and a factory for extra proxies."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aitlrt.common import keys
from aitlrt.common.model import prepare_bundled_model
from aitlrt.common.procs import free_port, wait_http
from aitlrt.serving.process import ServeProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@dataclass
class Served:
    url: str
    vllm_url: str
    run_dir: Path
    vllm_log: Path
    model_dir: Path

    @property
    def headers(self) -> dict[str, str]:
        """An admin call's headers."""
        return admin(self.url)

    @property
    def vllm_headers(self) -> dict[str, str]:
        """A call's headers straight to vLLM (its key, derived from the admin key)."""
        return keys.bearer(keys.vllm_key(keys.admin_key(self.url) or ""))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The real task data beside the checkout (``../shared/data``; ``AITLRT_DATA`` overrides)."""
    path = Path(os.environ.get("AITLRT_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
    if not (path / "swesmith_webargs" / "tasks.jsonl").exists():
        pytest.fail(f"task data not found at {path} (set AITLRT_DATA)")
    return path


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_bundled_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def served(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``aitlrt-serve --model <bundled>`` supervising a real vLLM CPU server (requests logged)."""
    run_dir = tmp_path_factory.mktemp("served")
    vllm_port = free_port()
    vllm_log = run_dir / "vllm.log"
    serve = ServeProcess(
        [
            "--model",
            str(model_dir),
            "--run-dir",
            str(run_dir),
            "--vllm-port",
            str(vllm_port),
            "--vllm-log",
            str(vllm_log),
            "--max-tokens",
            "48",
            "--temperature",
            "1.0",
            "--top-p",
            "0.95",
            "--enforce-eager",
            "--enable-log-requests",
        ],
        port=free_port(),
        log_path=run_dir / "serve.log",
    )
    with serve:
        yield Served(serve.url, f"http://127.0.0.1:{vllm_port}", run_dir, vllm_log, model_dir)
    assert httpx_down(f"http://127.0.0.1:{vllm_port}/health"), "vLLM outlived aitlrt-serve"


@pytest.fixture
def make_repo(tmp_path: Path) -> Callable[..., Path]:
    """A factory of small real git repositories: ``make_repo({"path": "content"})`` → its folder (one commit)."""
    from aitlrt.common.git import git

    def make(files: dict[str, str], name: str = "repo") -> Path:
        path = tmp_path / name
        for rel, text in files.items():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
        git("init", "-q", cwd=path)
        git("add", "-A", cwd=path)
        git("commit", "-qm", "base", cwd=path)
        return path

    return make


@pytest.fixture
def restore_weights(served: Served) -> Iterator[None]:
    """Put the served model's original weights back after a test that syncs trained ones into the server."""
    yield
    original = {"path": str(served.model_dir)}
    httpx.post(f"{served.url}/weights/reload", json=original, headers=served.headers, timeout=300).raise_for_status()


def httpx_down(url: str) -> bool:
    try:
        httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return True
    return False


@pytest.fixture(scope="session")
def scripted_upstream() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.scripted_upstream", "--port", str(port)], stdin=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def start_proxy(tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """Start ``aitlrt-serve --upstream URL [args]``; every proxy started is stopped after the test."""
    started: list[ServeProcess] = []

    def start(upstream: str, *args: str, run_dir: Path | None = None, wait_upstream: bool = True) -> ServeProcess:
        run_dir = run_dir or tmp_path / f"proxy{len(started)}"
        proxy = ServeProcess(
            ["--upstream", upstream, "--run-dir", str(run_dir), *args],
            port=free_port(),
            log_path=tmp_path / f"proxy{len(started)}.log",
        )
        started.append(proxy.start())
        proxy.wait_ready(timeout_s=60, upstream=wait_upstream)
        return proxy

    yield start
    for proxy in started:
        proxy.stop()


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed orphan may wait a while to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def admin(url: str) -> dict[str, str]:
    """The headers of an admin call to the server at ``url`` (one the tests started)."""
    return keys.admin_headers(url)


def token(url: str, rollout: str) -> dict[str, str]:
    """The headers of a model call of ``rollout`` with its own token, as its agent sends them."""
    return keys.bearer(keys.rollout_token(keys.admin_key(url) or "", rollout))


def keyed_env(url: str) -> dict[str, str]:
    """The environment of a client process of the server at ``url`` (a trainer, ``aitlrt eval --proxy``): its admin
    key in ``$AITLRT_API_KEY``, as a jobscript passes it."""
    return {**os.environ, keys.ENV: keys.admin_key(url) or ""}


def chat(url: str, rollout: str, content: str, **extra) -> httpx.Response:
    """A model call of ``rollout`` with its own token."""
    body = {"model": "whatever", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(
        f"{url}/rollouts/{rollout}/v1/chat/completions", json=body, headers=token(url, rollout), timeout=300
    )


def trace(url: str, rollout: str) -> list[dict]:
    resp = httpx.get(f"{url}/rollouts/{rollout}", headers=admin(url), timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["calls"]


def cachetools_tasks(n: int) -> Path:
    """The small generated cachetools tasks (files ≤ 200 lines) the tests share, at least ``n`` of them. Always made
    2 first, then topped up: a top-up draws new candidates, so the file's tasks depend on the order of the requests,
    and tests that name a task (``tests/unit/test_measures.py``) need the same file whichever test runs first."""
    from aitlrt.training.dataset import generated_tasks

    generated_tasks("pypi:cachetools==8.0.1", 2, 200)
    return generated_tasks("pypi:cachetools==8.0.1", n, 200)

"""Run ``aitlrt-serve`` as a child process (used by the demo, the trainer, tests and benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def wait_http(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout_s: float = 60.0,
    any_status: bool = False,
    progress: str | None = None,
) -> float:
    """Poll ``url`` until it answers 200 (any status with ``any_status``); return the seconds waited.

    Raises RuntimeError if ``proc`` exits first, TimeoutError after ``timeout_s``.
    """
    start = last = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=5).status_code == 200 or any_status:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")
        if progress and now - last > 10:
            print(f"[aitlrt] {progress} ({now - start:.0f}s) ...", flush=True)
            last = now
        time.sleep(0.25)


class ServeProcess:
    """``aitlrt-serve ARGS`` in its own process group; ``with`` waits for health and stops it afterwards."""

    def __init__(self, args: list[str], port: int, log_path: Path, host: str = "127.0.0.1") -> None:
        self.args = args
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._argv = [sys.executable, "-m", "aitlrt_server.cli", "--host", host, "--port", str(port), *args]

    def start(self) -> ServeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        return self

    def wait_ready(self, timeout_s: float = 900.0, progress: bool = False, upstream: bool = True) -> float:
        """Until ``/health`` is 200 (vLLM included; any answer with ``upstream=False``); raises with the
        log's tail if the process dies."""
        try:
            return wait_http(
                f"{self.url}/health",
                self.proc,
                timeout_s,
                any_status=not upstream,
                progress="waiting for aitlrt-serve and vLLM" if progress else None,
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; log tail:\n{self.log_path.read_text(errors='replace')[-4000:]}") from None
        except TimeoutError:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the proxy alone, as a crash would (a supervised vLLM is left orphaned: use with --upstream)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM (the proxy then stops its vLLM), SIGKILL the group if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> ServeProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""Child processes and local servers: run or kill a process group, tail its log, find a free port, wait for HTTP."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessExit:
    returncode: int | None
    """None when the process was killed for running out of time."""
    timed_out: bool
    log_tail: str
    seconds: float


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_process_group(
    cmd: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, timeout_s: float, stdin_text: str | None = None
) -> ProcessExit:
    """Run ``cmd`` in a new session; on timeout (or any exception, Ctrl-C included) kill its whole group."""
    start = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            start_new_session=True,
        )
    timed_out = False
    try:
        proc.communicate(stdin_text.encode() if stdin_text is not None else None, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        kill_group(proc)
    return ProcessExit(None if timed_out else proc.returncode, timed_out, tail(log_path), time.monotonic() - start)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session``) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_http(
    url: str,
    proc: subprocess.Popen | None = None,
    timeout_s: float = 60.0,
    any_status: bool = False,
    progress: str | None = None,
) -> float:
    """Poll ``url`` until it answers 200 (any status with ``any_status``); return the seconds waited. With
    ``progress`` (a message), log it every 10 s while waiting.

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
            log.info("%s (%.0fs) ...", progress, now - start)
            last = now
        time.sleep(0.25)

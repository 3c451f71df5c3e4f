"""Child processes and local servers: start, run or kill a process group, make a child die with its parent, end a
process on SIGTERM through its ``finally`` blocks, tail a log, find a free port, wait for HTTP."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger(__name__)
_sessions: set[subprocess.Popen] = set()
_sessions_lock = threading.Lock()


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


def exit_on_sigterm() -> None:
    """Make SIGTERM (``kill``, SLURM's ``scancel``) raise ``SystemExit(143)`` in the main thread, so that the
    ``finally`` blocks that stop child servers and agents run, as they do on Ctrl-C (the default kills at once)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def die_with_parent(sig: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``sig`` when this process dies, SIGKILL included: Linux's
    ``prctl(PR_SET_PDEATHSIG)``; elsewhere None. It fires when the forking *thread* exits: start the child from a
    thread that outlives it. Safe with threads (syscalls only, no lock)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None).prctl  # looked up before the fork
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the prctl
            os.kill(os.getpid(), sig)

    return preexec


def start_session(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """``cmd`` in a new session (its own process group), remembered until ``kill_group`` so that ``kill_sessions``
    can stop it."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    with _sessions_lock:
        _sessions.add(proc)
    return proc


def kill_sessions() -> int:
    """SIGKILL every process group ``start_session`` started and ``kill_group`` has not killed yet (the agents of an
    interrupted run); how many."""
    with _sessions_lock:
        live = list(_sessions)
    for proc in live:
        kill_group(proc)
    return len(live)


def run_process_group(
    cmd: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, timeout_s: float, stdin_text: str | None = None
) -> ProcessExit:
    """Run ``cmd`` in a new session; on timeout (or any exception, Ctrl-C included) kill its whole group. It dies
    with this process (SIGKILL: it is waited for in the thread that starts it)."""
    start = time.monotonic()
    with open(log_path, "ab") as log:
        proc = start_session(
            cmd,
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGKILL),
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
    """SIGKILL the process group of ``proc`` (started with ``start_session``) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with _sessions_lock:
        _sessions.discard(proc)


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

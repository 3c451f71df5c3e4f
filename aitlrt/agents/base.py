"""The agent protocol: run on a workspace with a task and an OpenAI endpoint, report how the process ended.

The patch and the outcome are judged by the rollout runner from the workspace and the proxy's trace, never
from the agent's own word (Aider exits 0 even when every call failed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aitlrt.workspace import Workspace


@dataclass(frozen=True)
class AgentTask:
    task_id: str
    instruction: str
    """What to do: the problem statement."""
    files: tuple[str, ...] = ()
    """Files to open for the agent up front (paths relative to the repository), if known."""


@dataclass(frozen=True)
class ModelEndpoint:
    base_url: str
    """OpenAI base URL for this rollout, e.g. ``http://127.0.0.1:8000/rollouts/<id>/v1``."""
    model: str
    """Served model name."""
    api_key: str = "aitlrt"
    context_window: int = 8192


@dataclass(frozen=True)
class AgentExit:
    returncode: int | None
    """None when the agent was killed for running out of time."""
    timed_out: bool
    log_tail: str
    seconds: float


class Agent(Protocol):
    name: str

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        """Work on ``ws.repo`` until done or ``timeout_s``; never outlive the call."""
        ...


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def run_process_group(
    cmd: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, timeout_s: float, stdin_text: str | None = None
) -> AgentExit:
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
    return AgentExit(None if timed_out else proc.returncode, timed_out, tail(log_path), time.monotonic() - start)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session``) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

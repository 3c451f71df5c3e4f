"""Warm workers: agent processes that pay their start-up once (importing litellm: 3-14 s) and then take jobs, one at a
time, over JSON lines on stdin/stdout (``aider_worker.py``, ``miniswe_env/miniswe_worker.py``).

Each worker runs in its own process group (``start_session``: an interrupted run's ``kill_sessions`` stops it) and
is told its owner's pid, so that it kills itself and its job when the owner dies, however it died. ``WarmWorkers``
holds them: idle ones are reused hottest first, one that dies or hangs is killed with its group and replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from aitlrt.common.paths import scratch_dir
from aitlrt.common.procs import kill_group, start_session, tail


class Worker:
    """One worker process (``python -u SCRIPT OWNER_PID``) in its own process group, its stderr in ``scratch/
    worker.log``."""

    def __init__(self, python: Path, script: Path, env: dict[str, str], scratch: Path) -> None:
        scratch.mkdir(parents=True, exist_ok=True)
        self.log = scratch / "worker.log"
        with open(self.log, "ab") as log:
            self.proc = start_session(
                [str(python), "-u", str(script), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                cwd="/",
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are pipes
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout.fileno()
        self.buffer = b""
        self.jobs = 0
        self.ready = False

    def send(self, message: dict) -> None:
        """Write one protocol line (a dead worker's broken pipe shows as its silence on ``read``)."""
        with contextlib.suppress(BrokenPipeError):
            self.stdin.write(json.dumps(message).encode() + b"\n")
            self.stdin.flush()

    def read(self, timeout_s: float) -> dict | None:
        """The next protocol line, or None on timeout or death. Reads the pipe unbuffered: two replies that arrive
        together are two lines, the second not hidden in a buffer from ``select``."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.stdout], [], [], max(deadline - time.monotonic(), 0.0))
            chunk = os.read(self.stdout, 1 << 16) if ready else b""
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        kill_group(self.proc)


@dataclass
class WarmWorkers:
    """An agent's pool of warm workers, as a dataclass base of the agent (its fields are the agent's keyword
    arguments). The agent says how to start one (``_new_worker``) and what it is called (``worker_name``), takes one
    for a rollout (``_take``) and gives it back (``_release``) or, dead or hung, kills it (``_retire``)."""

    jobs_per_worker: int = 0
    """Rollouts after which a worker is replaced (0: never)."""
    start_timeout_s: float = 120.0
    _idle: queue.LifoQueue = field(default_factory=queue.LifoQueue, init=False, repr=False)  # hottest first
    _all: list[Worker] = field(default_factory=list, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    worker_name = "worker"

    def _new_worker(self, scratch: Path) -> Worker:
        raise NotImplementedError

    def prestart(self, n: int, wait: bool = False) -> None:
        """Start ``n`` more workers now; with ``wait``, return once they are ready."""
        workers = [self._spawn() for _ in range(n)]
        for worker in workers:
            if wait:
                self._ready(worker)
            self._idle.put(worker)

    def _ready(self, worker: Worker) -> None:
        if not worker.ready:
            hello = worker.read(self.start_timeout_s)
            if not hello or not hello.get("ready"):
                self._retire(worker)
                raise RuntimeError(f"{self.worker_name} did not start: {tail(worker.log)}")
            worker.ready = True

    def _spawn(self) -> Worker:
        folder = self.worker_name.lower().replace(" ", "-") + "s"
        worker = self._new_worker(scratch_dir() / folder / f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with self._lock:
            self._all.append(worker)
        return worker

    def _retire(self, worker: Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.remove(worker)
        shutil.rmtree(worker.log.parent, ignore_errors=True)

    def _take(self) -> Worker:
        """An idle worker, or a new one; ready."""
        try:
            worker = self._idle.get_nowait()
        except queue.Empty:
            worker = self._spawn()
        if not worker.alive():
            self._retire(worker)
            return self._take()
        self._ready(worker)
        return worker

    def _release(self, worker: Worker) -> None:
        """Back to the idle workers after a job, or replaced once it has run ``jobs_per_worker``."""
        worker.jobs += 1
        if self.jobs_per_worker and worker.jobs >= self.jobs_per_worker:
            self._retire(worker)
        else:
            self._idle.put(worker)

    def close(self) -> None:
        """Stop every worker."""
        for worker in list(self._all):
            self._retire(worker)

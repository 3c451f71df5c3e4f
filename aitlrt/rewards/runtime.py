"""The I/O behind the built-in rewards, each part bounded by a timeout so that a reward never blocks a step
indefinitely: the grades (``grade`` in the sandbox, memoised per task and patch, run early as each rollout ends:
``EarlyGrader``), the apply check and the task's files at its starting commit (git), and a process pool for the
CPU-bound patch similarities. ``aitlrt.rewards.builtin`` gathers with these what ``aitlrt.rewards.terms`` scores.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import multiprocessing
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from aitlrt.common.git import git
from aitlrt.common.resources import usable_cores
from aitlrt.rollout.status import AGENT_FAILED, BAD_TASK, agent_failed, grader_failed
from aitlrt.tasks.grading import Grade, grade
from aitlrt.tasks.patches import changed_paths
from aitlrt.tasks.task import Task, TaskError, task_from_row

log = logging.getLogger(__name__)

SIMILARITY_TIMEOUT_S = 60.0
"""One similarity's limit in the process pool: past it the rollout scores 0 and the pool is replaced."""
GRADE_TIMEOUT_S = 600.0
"""The tests' limit per grade (past it the grade is ``timeout``: the patch's fault, scored 0)."""
APPLY_TIMEOUT_S = 60.0
"""``applies``' limit on ``git apply --check``: past it the patch counts as not applying (the step goes on)."""
MEMO_SIZE = 4096
"""Grades the memo holds before it starts over: its memory stays bounded over a long run."""


def task_of(row: Mapping[str, Any]) -> Task | None:
    """The rollout's ``Task`` (the ``task`` column of ``aitlrt.rewards.inputs.reward_row``), else built from the row;
    None when the row is not a valid task."""
    if isinstance(row.get("task"), Task):
        return row["task"]
    try:
        return task_from_row(dict(row))
    except TaskError:
        return None


class _SimilarityPool:
    """A lazily started process pool for the CPU-bound comparisons of two patches; a computation past its timeout
    scores 0 and the pool is replaced. Stopped at exit: a pool left to the interpreter's teardown prints
    ``Exception ignored in: Pool.__del__`` at the end of every run that used it."""

    def __init__(self) -> None:
        self._pool = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def _fresh(self):
        if self._pool is not None:
            self._pool.terminate()
        self._pool = multiprocessing.get_context("forkserver").Pool(min(4, usable_cores()))
        return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None

    def map(self, func: Callable[[str, str], float], pairs: list[tuple[str, str]], timeout: float) -> list[float]:
        with self._lock:
            pool = self._pool or self._fresh()
            out: list[float] = []
            while len(out) < len(pairs):
                jobs = [pool.apply_async(func, pair) for pair in pairs[len(out) :]]
                try:
                    for job in jobs:
                        out.append(job.get(timeout))
                except multiprocessing.TimeoutError:
                    out.append(0.0)
                    pool = self._fresh()
            return out


_similarity_pool = _SimilarityPool()


def similarities(func: Callable[[str, str], float], pairs: Sequence[tuple[str, str]]) -> list[float]:
    """``func(agent_patch, oracle_patch)`` of each pair: several in the process pool, each bounded by
    ``SIMILARITY_TIMEOUT_S`` (0 past it); one alone in this process."""
    if len(pairs) > 1:
        return _similarity_pool.map(func, list(pairs), SIMILARITY_TIMEOUT_S)
    return [func(*pair) for pair in pairs]


def applies(task: Task, patch: str) -> bool:
    """Whether ``patch`` applies to the task's starting commit (checked on a scratch index, no checkout)."""
    repo, base = task.checkout()
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}  # git() adds it over os.environ and GIT_ENV
        git("read-tree", base, cwd=repo, env=env)
        text = patch if patch.endswith("\n") else patch + "\n"
        try:
            git("apply", "--cached", "--check", "-", cwd=repo, env=env, input=text, timeout=APPLY_TIMEOUT_S)
        except RuntimeError:  # git's own "does not apply"
            return False
        except subprocess.TimeoutExpired:
            log.warning("%s: `git apply --check` took over %.0f s: the patch counts as not applying",
                        task.instance_id, APPLY_TIMEOUT_S)  # fmt: skip
            return False
    return True


def start_texts(task: Task) -> list[str]:
    """The text of the task's files at its starting commit: those in the agent's chat (``files``), else those its
    oracle fix changes; a file missing there is left out."""
    repo, base = task.checkout()
    texts = []
    for path in task.files or changed_paths(task.patch):
        try:
            texts.append(git("show", f"{base}:{path}", cwd=repo))
        except RuntimeError:
            log.warning("%s: %s is not in the starting commit", task.instance_id, path)
    return texts


_grades: dict[tuple[str, str], Future[Grade]] = {}
_grades_lock = threading.Lock()


def _grade_key(task: Task, patch: str) -> tuple[str, str]:
    return task.instance_id, hashlib.sha256(patch.encode()).hexdigest()


def grade_cached(task: Task, patch: str, timeout: float = GRADE_TIMEOUT_S) -> Grade:
    """``grade`` memoised per (task, patch), so the rewards that grade (``aitlrt.rewards.builtin.GRADED``) run the
    tests once; a caller that finds the same grade already running (``EarlyGrader``) waits for it instead of running
    it again. An exception of the grader becomes a ``grader_error`` grade (logged), memoised like any grade."""
    key = _grade_key(task, patch)
    with _grades_lock:
        pending = _grades.get(key)
        owner = pending is None
        if pending is None:
            if len(_grades) > MEMO_SIZE:
                _grades.clear()
            pending = _grades[key] = Future()
    if owner:
        try:
            result = grade(task, patch, timeout)
        except Exception as exc:
            log.warning("%s: the grader failed: %s: %s", task.instance_id, type(exc).__name__, exc, exc_info=exc)
            result = Grade("grader_error", reason=f"{type(exc).__name__}: {exc}")
        except BaseException as exc:  # interrupted: not memoised, the next caller tries again
            with _grades_lock:
                _grades.pop(key, None)
            pending.set_exception(exc)
            raise
        pending.set_result(result)
    return pending.result()


def grade_row(row: Mapping[str, Any]) -> Grade:
    """The grade of one rollout's row (``aitlrt.rewards.inputs.reward_row``): ungraded if its agent failed."""
    if agent_failed(row.get("rollout_status")):
        return Grade(AGENT_FAILED, reason=f"rollout {row['rollout_status']}")
    task = task_of(row)
    if task is None:
        return Grade(BAD_TASK, reason="the row is not a valid task")
    return grade_cached(task, row["agent_patch"] or "")


def grade_rollouts(rows: Sequence[Mapping[str, Any]], workers: int | None = None) -> list[Grade]:
    """The grade of every rollout's row, graded concurrently."""
    with ThreadPoolExecutor(workers or min(4, usable_cores())) as pool:
        return list(pool.map(grade_row, rows))


def grader_failure(row: Mapping[str, Any]) -> str:
    """``grade STATUS: reason`` when the grade already made of ``row`` (``reward_row``) failed on the grader's side
    (``aitlrt.rollout.status.GRADER_FAILURES``), else "" (also when it was not graded, or is still running)."""
    failed = agent_failed(row.get("rollout_status"))
    task = None if failed else task_of(row)
    if task is None:
        return "" if failed else f"grade {BAD_TASK}: the row is not a valid task"
    with _grades_lock:
        pending = _grades.get(_grade_key(task, row["agent_patch"] or ""))
    if pending is None or not pending.done() or pending.exception() is not None:
        return ""
    g = pending.result()
    return f"grade {g.status}: {g.reason}" if grader_failed(g.status) else ""


class EarlyGrader:
    """Grades each rollout in the background as soon as it ends, while the other agents still run, so that the
    rewards that grade (``aitlrt.rewards.builtin.GRADED``) find its grade done (or running) when the batch is
    scored; a grader that raises leaves a ``grader_error`` grade (``grade_cached``)."""

    def __init__(self, workers: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(workers or min(4, usable_cores()), thread_name_prefix="grade")

    def submit(self, row: Mapping[str, Any]) -> None:
        self._pool.submit(grade_row, row)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

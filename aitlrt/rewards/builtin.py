"""Built-in reward functions, each in [0, 1], with trl's reward-function signature.

trl calls ``f(prompts=..., completions=..., completion_ids=..., **columns)`` where every dataset column arrives as
a list, one entry per rollout, with the rollout's results added by ``aitlrt.rewards.inputs.reward_row``
(``task``, ``agent_patch``, ``rollout_status``, ``rollout_calls``, ``rollout_completion_tokens``,
``rollout_answers``, ``rollout_finish_reasons``). So any trl
reward function composes with these, and these work on any task dataset with the SWE-bench columns. Grading and
similarity run concurrently (threads driving sandboxed test processes; a process pool for the CPU-bound
similarity) and every one is bounded by a timeout: a reward never blocks a step indefinitely. A rollout whose
agent failed (timeout, crash, agent error) scores 0 everywhere, without grading. In training, a rollout that failed
outside the policy (``aitlrt.rollout.runner.infrastructure_failure``: ``agent_error``, or ``crashed`` before any
answered call) is unscorable instead: the trainer makes all its rewards NaN, whatever the functions returned, so
it leaves its group's baseline; here (evaluation, ``aitlrt rollout --rewards``) it stays a 0. A grade that failed on
the grader's side (``GRADER_FAILURES``: the test environment, the task's test patch, the sandbox, the task row) says
nothing of the patch: the functions that grade return NaN for it, which makes the rollout unscorable in training
(the trainer treats any NaN reward so); tests that time out stay the patch's fault (0).
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import math
import multiprocessing
import os
import re
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from aitlrt.common.git import git
from aitlrt.common.resources import usable_cores
from aitlrt.tasks import patches
from aitlrt.tasks.grading import Grade, grade
from aitlrt.tasks.patches import changed_paths, code_lines, shares_changed_line, similarity
from aitlrt.tasks.task import Task, TaskError, task_from_row

log = logging.getLogger(__name__)

FAILED_ROLLOUT = ("timeout", "agent_error", "crashed")
GRADER_FAILURES = ("env_failed", "test_patch_failed", "grader_error", "bad_task")
"""Grade statuses that are the grader's failure, not the patch's: the rewards that grade are NaN (unscorable)."""
SIMILARITY_TIMEOUT_S = 60.0
GRADE_TIMEOUT_S = 600.0
APPLY_TIMEOUT_S = 60.0
"""``applies``' limit on ``git apply --check``: past it the patch counts as not applying (the step goes on)."""


def _columns(n: int, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """Rebuild each rollout's row from trl's per-column lists."""
    lists = {k: v for k, v in kwargs.items() if isinstance(v, list | tuple) and len(v) == n}
    return [{k: v[i] for k, v in lists.items()} for i in range(n)]


def _failed(row: dict[str, Any]) -> bool:
    return row.get("rollout_status") in FAILED_ROLLOUT


class _SimilarityPool:
    """A lazily started process pool for the CPU-bound comparisons of two patches; a computation past its timeout
    scores 0 and the pool is replaced."""

    def __init__(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    def _fresh(self):
        if self._pool is not None:
            self._pool.terminate()
        self._pool = multiprocessing.get_context("forkserver").Pool(min(4, usable_cores()))
        return self._pool

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


def _against_oracle(func: Callable[[str, str], float], kwargs: dict[str, Any]) -> list[float]:
    """``func(agent_patch, patch)`` of each rollout (a batch's in the process pool, bounded by its timeout); 0 for a
    failed rollout."""
    rows = _columns(len(kwargs["agent_patch"]), kwargs)
    pairs = [(r["agent_patch"] or "", r.get("patch") or "") for r in rows]
    scores = _similarity_pool.map(func, pairs, SIMILARITY_TIMEOUT_S) if len(pairs) > 1 else [func(*pairs[0])]
    return [0.0 if _failed(r) else s for r, s in zip(rows, scores, strict=True)]


def patch_similarity(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """SWE-RL similarity of ``agent_patch`` to the oracle ``patch`` (tasks.patches.similarity)."""
    return _against_oracle(similarity, kwargs)


def changed_lines_similarity(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """Similarity of ``agent_patch``'s effective changed lines to the oracle ``patch``'s
    (tasks.patches.changed_lines_similarity): 0 for no edit, a comment or whitespace, 1 for the exact fix."""
    return _against_oracle(patches.changed_lines_similarity, kwargs)


def localised(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """1 when ``agent_patch``'s effective changes touch a base line that the oracle ``patch``'s touch, in the same
    file (tasks.patches.shares_changed_line): the agent edited where the bug is."""
    return _against_oracle(shares_changed_line, kwargs)


def _task(row: dict[str, Any]) -> Task | None:
    """The rollout's ``Task`` (the ``task`` column of ``aitlrt.rewards.inputs.reward_row``), else built from the row."""
    if isinstance(row.get("task"), Task):
        return row["task"]
    try:
        return task_from_row(row)
    except TaskError:
        return None


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


def non_empty_patch(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """1 when the agent produced a non-empty patch that applies to the task's starting commit."""
    out = []
    for row in _columns(len(kwargs["agent_patch"]), kwargs):
        patch = row["agent_patch"] or ""
        task = _task(row) if patch.strip() and not _failed(row) else None
        out.append(float(task is not None and applies(task, patch)))
    return out


_grades: dict[tuple[str, str], Future[Grade]] = {}
_grades_lock = threading.Lock()


def _grade_key(task: Task, patch: str) -> tuple[str, str]:
    return task.instance_id, hashlib.sha256(patch.encode()).hexdigest()


def grade_cached(task: Task, patch: str, timeout: float = GRADE_TIMEOUT_S) -> Grade:
    """``grade`` memoised per (task, patch), so the rewards that grade (``GRADED``) run the tests once; a caller
    that finds the same grade already running (``EarlyGrader``) waits for it instead of running it again. An
    exception of the grader becomes a ``grader_error`` grade (logged), memoised like any grade."""
    key = _grade_key(task, patch)
    with _grades_lock:
        pending = _grades.get(key)
        owner = pending is None
        if pending is None:
            if len(_grades) > 4096:
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


def grader_failure(row: dict[str, Any]) -> str:
    """``grade STATUS: reason`` when the grade already made of ``row`` (``reward_row``) failed on the grader's side
    (``GRADER_FAILURES``), else "" (also when it was not graded, or is still running)."""
    task = None if _failed(row) else _task(row)
    if task is None:
        return "" if _failed(row) else "grade bad_task: the row is not a valid task"
    with _grades_lock:
        pending = _grades.get(_grade_key(task, row["agent_patch"] or ""))
    if pending is None or not pending.done() or pending.exception() is not None:
        return ""
    g = pending.result()
    return f"grade {g.status}: {g.reason}" if g.status in GRADER_FAILURES else ""


def _scored(g: Grade, value: float) -> float:
    """``value``, or NaN (unscorable) where grading failed on the grader's side."""
    return math.nan if g.status in GRADER_FAILURES else value


def grade_row(row: dict[str, Any]) -> Grade:
    """The grade of one rollout's row (``aitlrt.rewards.inputs.reward_row``): ungraded if its agent failed."""
    if _failed(row):
        return Grade("agent_failed", reason=f"rollout {row['rollout_status']}")
    task = _task(row)
    if task is None:
        return Grade("bad_task", reason="the row is not a valid task")
    return grade_cached(task, row["agent_patch"] or "")


def grade_rollouts(kwargs: dict[str, Any], workers: int | None = None) -> list[Grade]:
    """Grade every rollout of the batch concurrently."""
    with ThreadPoolExecutor(workers or min(4, usable_cores())) as pool:
        return list(pool.map(grade_row, _columns(len(kwargs["agent_patch"]), kwargs)))


class EarlyGrader:
    """Grades each rollout in the background as soon as it ends, while the other agents still run, so that the
    rewards that grade (``GRADED``) find its grade done (or running) when the batch is scored; a grader that raises
    leaves a ``grader_error`` grade (``grade_cached``)."""

    def __init__(self, workers: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(workers or min(4, usable_cores()), thread_name_prefix="grade")

    def submit(self, row: dict[str, Any]) -> None:
        self._pool.submit(grade_row, row)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tests_pass(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """1 when every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks with the agent's patch applied (NaN:
    ``GRADER_FAILURES``)."""
    return [_scored(g, float(g.resolved)) for g in grade_rollouts(kwargs)]


def tests_pass_fraction(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """The share of FAIL_TO_PASS + PASS_TO_PASS tests that pass (a metric: give it weight 0 to only log it; NaN:
    ``GRADER_FAILURES``)."""
    return [_scored(g, g.fraction) for g in grade_rollouts(kwargs)]


def breaks_no_test(g: Grade) -> bool:
    """The patch was graded and every PASS_TO_PASS test still passes (true of a task that has none)."""
    return g.status in ("resolved", "unresolved") and g.p2p_passed == g.p2p_total


def unbroken_patch_similarity(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``patch_similarity``, paid only when no PASS_TO_PASS test broke (0 otherwise): an edit in the right place
    that breaks other code earns nothing for being in the right place (NaN: ``GRADER_FAILURES``)."""
    grades = grade_rollouts(kwargs)
    similar = patch_similarity(**kwargs)
    return [_scored(g, s if breaks_no_test(g) else 0.0) for s, g in zip(similar, grades, strict=True)]


def unbroken_changed_lines_similarity(
    prompts=None, completions=None, completion_ids=None, **kwargs: Any
) -> list[float]:
    """``changed_lines_similarity``, paid only when no PASS_TO_PASS test broke (0 otherwise), as
    ``unbroken_patch_similarity`` (NaN: ``GRADER_FAILURES``)."""
    grades = grade_rollouts(kwargs)
    similar = changed_lines_similarity(**kwargs)
    return [_scored(g, s if breaks_no_test(g) else 0.0) for s, g in zip(similar, grades, strict=True)]


def keeps_pass_to_pass(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """1 when the agent's patch is non-empty, applied, was graded and every PASS_TO_PASS test still passes
    (``breaks_no_test``), 0 otherwise (no edit: 0 whatever its grade): over the rollouts that edited, the share of
    edits that keep the working code working (NaN for an edit: ``GRADER_FAILURES``)."""
    rows = _columns(len(kwargs["agent_patch"]), kwargs)
    edited = [bool((r["agent_patch"] or "").strip()) and not _failed(r) for r in rows]
    return [
        _scored(g, float(breaks_no_test(g))) if e else 0.0 for g, e in zip(grade_rollouts(kwargs), edited, strict=True)
    ]


def edit_tests_pass_fraction(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``tests_pass_fraction`` of an edit (``non_empty_patch``), 0 without one: keeping the tests green pays only an
    agent that changed the code, so no edit scores below any edit and an edit that breaks tests below one that
    does not (plain ``tests_pass_fraction`` pays a no-op for the tests it leaves passing; NaN for an edit:
    ``GRADER_FAILURES``)."""
    edited = non_empty_patch(**kwargs)
    return [_scored(g, g.fraction) if e else 0.0 for g, e in zip(grade_rollouts(kwargs), edited, strict=True)]


_EDIT_BLOCK = re.compile(r"^<{5,9} SEARCH>?[ \t]*\n(.*?)^={5,9}[ \t]*\n(.*?)^>{5,9} REPLACE>?[ \t]*$", re.M | re.S)
"""A whole SEARCH/REPLACE block of Aider's ``diff`` format: its HEAD, DIVIDER and UPDATED marker lines, in order,
with the SEARCH and REPLACE texts as its two groups."""


def _last_answer_blocks(kwargs: dict[str, Any]) -> list[list[tuple[str, str]] | None]:
    """Per rollout, the (SEARCH, REPLACE) texts of the whole blocks in the agent's last answer; None for a failed
    rollout."""
    out: list[list[tuple[str, str]] | None] = []
    for row in _columns(len(kwargs["agent_patch"]), kwargs):
        answers = row.get("rollout_answers") or [""]
        out.append(None if _failed(row) else _EDIT_BLOCK.findall(answers[-1] or ""))
    return out


def well_formed_edit(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """1 when the agent's last answer holds a whole SEARCH/REPLACE block (Aider's ``diff`` edit format), whether its
    SEARCH part matched the file or not: a format term, so that answers Aider cannot parse (one that stops after
    ``<<<<<<< SEARCH``) score below well-formed ones and a policy drifting into them is pushed back."""
    return [float(bool(blocks)) for blocks in _last_answer_blocks(kwargs)]


def _changing_searches(blocks: list[tuple[str, str]] | None) -> list[str]:
    """The SEARCH texts of the blocks that change something: REPLACE's code differs from SEARCH's in more than
    whitespace or comments (``aitlrt.tasks.patches.code_lines``: a comment on the buggy line changes nothing)."""
    return [search for search, replace in blocks or () if code_lines(search) != code_lines(replace)]


def well_formed_change(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``well_formed_edit`` for a block that changes something: 1 when the last answer holds a whole SEARCH/REPLACE
    block whose REPLACE code differs from its SEARCH code in more than whitespace or comments, matched or not. An
    identity edit (REPLACE == SEARCH, which changes nothing) or a comment scores with a cut or missing block, below
    an attempted change."""
    return [float(bool(_changing_searches(blocks))) for blocks in _last_answer_blocks(kwargs)]


def _found_share(search: str, text: str) -> float:
    """The share of ``search``'s non-blank lines found in ``text`` in order, indentation aside (difflib's matching
    blocks): 1 for a SEARCH text the file holds, 0 for one made up, and 0 for an empty one (Aider's way to append to
    a file or write a new one: it anchors nothing)."""
    wanted = [line.strip() for line in search.splitlines() if line.strip()]
    held = [line.strip() for line in text.splitlines() if line.strip()]
    if not wanted:
        return 0.0
    blocks = difflib.SequenceMatcher(None, wanted, held, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks) / len(wanted)


def _file_texts(task: Task) -> list[str]:
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


def anchored_change(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``well_formed_change`` paid by how much of the block the file holds: per block of the last answer that
    changes something, the share of its SEARCH lines found, in order, in one of the task's files (indentation
    aside); the best block counts. A matched change scores 1, a SEARCH that missed by a line or two nearly as much,
    and one made up 0, with an identity edit and an empty SEARCH (appending text is no targeted change: paid 1, it
    paid a comment appended to the file): paying every attempted change alike paid made-up SEARCH texts over
    identity edits, and GRPO learnt to write them (DIARY 2026-11-27, evening)."""
    out = []
    for row, blocks in zip(_columns(len(kwargs["agent_patch"]), kwargs), _last_answer_blocks(kwargs), strict=True):
        changes = _changing_searches(blocks)
        task = _task(row) if changes else None
        texts = _file_texts(task) if task is not None else []
        out.append(max((_found_share(s, t) for s in changes for t in texts), default=0.0))
    return out


def finished_answers(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """1 when the rollout answered and no answer was cut at the per-call token cap (``max_completion_length``:
    finish reason ``length``), 0 otherwise (a failed rollout, or one with no answer): DAPO's overlong penalty as a
    term in [0, 1]. An answer cut at the cap (in practice a line repeated until it) scores below every answer that
    ends, so a group of them and of chat replies is informative and pushes the policy out of the loop (trl's
    ``mask_truncated_completions`` only takes them out of the loss)."""
    key = "rollout_finish_reasons"
    rows = _columns(len(kwargs["agent_patch"]), kwargs)
    return [float(not _failed(r) and bool(r.get(key)) and "length" not in r[key]) for r in rows]


GRADED: tuple[Callable[..., list[float]], ...] = (
    tests_pass,
    tests_pass_fraction,
    unbroken_patch_similarity,
    edit_tests_pass_fraction,
    unbroken_changed_lines_similarity,
    keeps_pass_to_pass,
)
"""The reward functions that run the tests (the trainer grades each rollout as soon as it ends when one is used)."""
REWARDS: dict[str, Callable[..., list[float]]] = {
    f.__name__: f
    for f in (
        patch_similarity,
        tests_pass,
        tests_pass_fraction,
        non_empty_patch,
        unbroken_patch_similarity,
        edit_tests_pass_fraction,
        well_formed_edit,
        well_formed_change,
        anchored_change,
        finished_answers,
        changed_lines_similarity,
        localised,
        keeps_pass_to_pass,
        unbroken_changed_lines_similarity,
    )
}

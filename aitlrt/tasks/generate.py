"""Offline task generation: bug-fix tasks made from any repository with a test suite, no LLM and no network
beyond PyPI (SWE-smith's procedural method).

For each candidate mutation (``tasks.mutations``) of the library's code, run the test suite on the mutated code;
keep it when at least one test goes pass→fail and at least one still passes, and the grader (in its sandbox, with its
plugin) resolves the task with the oracle fix (a fix the grader cannot pass, e.g. one to the file that installs the
library's import hook, would make a task no policy can solve). The task's starting point is the
source plus the bug (``setup_patch``), its oracle git's diff back to the source (what an agent's exact fix gives),
FAIL_TO_PASS the broken tests, PASS_TO_PASS the ones still passing, and its problem statement names the failing
tests.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from aitlrt.common.git import git
from aitlrt.common.workspace import workspace
from aitlrt.tasks.envs import TestEnv, ensure_env
from aitlrt.tasks.grading import grade
from aitlrt.tasks.mutations import Mutation, mutations
from aitlrt.tasks.pytest_run import PASSED, run_pytest
from aitlrt.tasks.sources import Source, materialise
from aitlrt.tasks.task import PROBLEM_TEMPLATE, Task, task_from_row

log = logging.getLogger(__name__)

NOT_LIBRARY = {"tests", "test", "testing", "docs", "doc", "examples", "example", "benchmarks", "bench", "scripts"}


def library_files(repo: Path, commit: str, max_lines: int | None = None) -> list[str]:
    """Tracked Python files that are library code: not tests, docs, examples, ``setup.py`` or ``conftest.py``;
    with ``max_lines``, only files that short (small models edit whole files)."""
    out = []
    for path in git("ls-tree", "-r", "--name-only", commit, cwd=repo).split():
        p = PurePosixPath(path)
        if p.suffix != ".py" or p.name in ("setup.py", "conftest.py", "noxfile.py") or p.name.startswith("test_"):
            continue
        if any(part.lower() in NOT_LIBRARY or part.startswith(".") for part in p.parts[:-1]):
            continue
        if max_lines is None or git("show", f"{commit}:{path}", cwd=repo).count("\n") <= max_lines:
            out.append(path)
    return out


@dataclass
class Report:
    """What a generation run did, for the progress line and the closing summary."""

    candidates: int = 0
    kept: int = 0
    no_failure: int = 0
    all_fail: int = 0
    ungradeable: int = 0
    """Mutations whose oracle fix the grader does not resolve."""
    timeouts: int = 0
    baseline_s: float = 0.0
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)

    def line(self) -> str:
        return (
            f"tried {self.candidates} mutations: kept {self.kept}, no test broke {self.no_failure}, "
            f"every test broke {self.all_fail}, oracle fix not resolved by the grader {self.ungradeable}, "
            f"timed out {self.timeouts} ({self.seconds:.0f} s)"
        )


def _run_suite(env: TestEnv, repo: Path, timeout: float) -> tuple[dict[str, str], bool, str]:
    run = run_pytest(env, repo, [], timeout)
    return run.statuses, run.timed_out, "\n".join([*run.problems, run.output])


def _candidates(
    repo: Path, base: str, files: list[str], seed: int, per_function: int
) -> Iterator[tuple[str, Mutation]]:
    """Mutations of every library file, interleaved across files so that early stops still cover the package."""
    per_file = []
    for path in files:
        text = git("show", f"{base}:{path}", cwd=repo)
        per_file.append([(path, m) for m in mutations(text, seed=seed, per_function=per_function)])
    for group in itertools.zip_longest(*per_file):
        yield from (c for c in group if c is not None)


def _fix_diff(repo: Path, path: str, original: str) -> str:
    """The oracle fix as git writes it from the bug to the fix, as an agent's patch is taken (the bug's diff
    reversed differs in text where the bug moved lines: git keeps other lines as context); restores ``path``."""
    git("add", "--", path, cwd=repo)
    (repo / path).write_text(original)
    fix = git("diff", cwd=repo)
    git("reset", "-q", "--", path, cwd=repo)
    return fix


def _row(
    source: Source,
    name: str,
    version: str,
    path: str,
    mutation: Mutation,
    bug: str,
    fix: str,
    f2p: list[str],
    p2p: list[str],
    env: dict[str, Any] | None,
) -> dict[str, Any]:
    digest = hashlib.sha256(bug.encode()).hexdigest()[:8]
    return {
        "instance_id": f"{name}-{version}.{mutation.kind}__{digest}",
        "repo": name,
        "version": version,
        "source": str(source),
        "setup_patch": bug,
        "patch": fix,
        "test_patch": "",
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "problem_statement": PROBLEM_TEMPLATE.format(tests="\n".join(f"- {t}" for t in f2p[:5])),
        "strategy": mutation.kind,
        "mutation": f"{path}: {mutation.description}",
        "function": f"{path}:{mutation.function}",
        "env": json.dumps(env) if env else "",
        "files": [path],
        "created_by": "aitlrt tasks generate",
    }


def generate_tasks(
    source: Source,
    out: Path,
    *,
    max_tasks: int = 30,
    max_candidates: int | None = None,
    seed: int = 0,
    per_function: int = 2,
    workers: int = 2,
    max_file_lines: int | None = None,
    env: dict[str, Any] | None = None,
) -> Report:
    """Write up to ``max_tasks`` validated bug-fix tasks made from ``source`` to ``out`` (JSON lines, appended as
    they are found, so an interrupted run keeps its tasks)."""
    started = time.monotonic()
    repo, base = materialise(source)
    name, _, version = source.location.partition("==") if source.kind == "pypi" else (Path(repo).name, "", base[:12])
    stub = Task(f"{name}-{version}.base", "-", source, repo=name, version=version, env=env)
    test_env = ensure_env(stub)
    report = Report()
    with workspace(repo, base) as ws:
        t0 = time.monotonic()
        baseline, timed_out, output = _run_suite(test_env, ws.repo, timeout=1800)
        report.baseline_s = time.monotonic() - t0
    passing = sorted(t for t, s in baseline.items() if s == PASSED)
    if timed_out or not passing:
        raise RuntimeError(f"the test suite of {source} does not pass at its base; pytest said:\n{output[-1500:]}")
    log.info("baseline: %d passing tests in %.1f s", len(passing), report.baseline_s)
    timeout = max(20.0, 5 * report.baseline_s)
    files = library_files(repo, base, max_file_lines)
    queue = _candidates(repo, base, files, seed, per_function)
    lock = threading.Lock()
    out.parent.mkdir(parents=True, exist_ok=True)

    def worker(index: int) -> None:
        with workspace(repo, base) as ws, open(out, "a") as sink:
            while True:
                with lock:
                    if report.kept >= max_tasks or (max_candidates and report.candidates >= max_candidates):
                        return
                    candidate = next(queue, None)
                    if candidate is None:
                        return
                    report.candidates += 1
                path, mutation = candidate
                original = (ws.repo / path).read_text()
                (ws.repo / path).write_text(mutation.source)
                bug = git("diff", cwd=ws.repo)
                statuses, timed_out, _ = _run_suite(test_env, ws.repo, timeout)
                fix = _fix_diff(ws.repo, path, original)
                f2p = [t for t in passing if statuses.get(t) != PASSED]
                p2p = [t for t in passing if statuses.get(t) == PASSED]
                row = _row(source, name, version, path, mutation, bug, fix, f2p, p2p, env)
                with lock:
                    wanted = report.kept < max_tasks  # another worker may have kept the last task meanwhile
                keepable = wanted and f2p and p2p and not timed_out
                gold = grade(task_from_row(row), fix, timeout) if keepable else None
                with lock:
                    if timed_out:
                        report.timeouts += 1
                    elif not f2p:
                        report.no_failure += 1
                    elif not p2p:
                        report.all_fail += 1
                    elif gold is not None and not gold.resolved:
                        report.ungradeable += 1
                        log.info(
                            "dropped %s: the grader does not resolve its oracle fix (%s: %s)",
                            row["instance_id"],
                            gold.status,
                            gold.reason[:200],
                        )
                    elif report.kept < max_tasks:
                        report.kept += 1
                        report.kinds[mutation.kind] = report.kinds.get(mutation.kind, 0) + 1
                        sink.write(json.dumps(row) + "\n")
                        sink.flush()
                        log.info(
                            "task %d/%d: %s: %s (%d failing, %d passing)",
                            report.kept,
                            max_tasks,
                            path,
                            mutation.description,
                            len(f2p),
                            len(p2p),
                        )

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(worker, range(workers)))
    report.seconds = time.monotonic() - started
    log.info("%s", report.line())
    return report

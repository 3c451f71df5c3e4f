"""Grade a patch by running the task's tests: SWE-bench semantics.

In a private copy of the task's starting commit: apply the patch (``git apply``, then ``patch --fuzz``), restore
the test files the grading runs to their original state (an agent cannot pass by editing the tests), apply the
task's ``test_patch``, run the test command on those files in the sandbox, and read pytest's ``-rA`` summary.
Resolved = every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from aitlrt.common.git import git
from aitlrt.common.workspace import workspace
from aitlrt.tasks import patches
from aitlrt.tasks.envs import EnvBuildError, ensure_env
from aitlrt.tasks.sandbox import run_sandboxed
from aitlrt.tasks.task import Task

PASSING = ("PASSED", "XFAIL")
STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


@dataclass(frozen=True)
class Grade:
    status: str
    """``resolved``, ``unresolved``, ``patch_failed``, ``test_patch_failed``, ``env_failed``, ``timeout``."""
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_passed: int = 0
    p2p_total: int = 0
    reason: str = ""
    seconds: float = 0.0
    isolation: str = ""

    @property
    def resolved(self) -> bool:
        return self.status == "resolved"

    @property
    def fraction(self) -> float:
        """Share of the FAIL_TO_PASS and PASS_TO_PASS tests that pass."""
        total = self.f2p_total + self.p2p_total
        return (self.f2p_passed + self.p2p_passed) / total if total else 0.0


def parse_pytest(output: str) -> dict[str, str]:
    """``{test id: status}`` from pytest's ``-rA`` short summary (ids cut at the first space, as SWE-bench)."""
    statuses = {}
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word in STATUSES and rest and not rest.startswith("["):
            statuses[rest.replace(" - ", " ").split()[0]] = word
    return statuses


def test_targets(task: Task) -> list[str]:
    """The test files to run: those the test patch touches, else those the test ids name."""
    files = patches.changed_paths(task.test_patch) if task.test_patch else []
    files = files or [t.split("::", 1)[0] for t in (*task.fail_to_pass, *task.pass_to_pass)]
    return list(dict.fromkeys(files))


def apply_patch(repo: Path, patch: str) -> str | None:
    """Apply ``patch`` in the work tree; None, or why it does not apply."""
    if not patch.strip():
        return None
    text = patch if patch.endswith("\n") else patch + "\n"
    tries = (["git", "apply", "--whitespace=nowarn", "-"], ["patch", "--batch", "--fuzz=5", "-p1", "--forward"])
    errors = []
    for cmd in tries:
        proc = subprocess.run(cmd, cwd=repo, input=text, capture_output=True, text=True)
        if proc.returncode == 0:
            return None
        errors.append((proc.stderr or proc.stdout).strip()[-300:])
        git("checkout", "-q", "--", ".", cwd=repo)  # undo a partial application before the next try
        git("clean", "-q", "-fd", cwd=repo)
    return "patch does not apply: " + errors[0]


def grade(task: Task, patch: str, timeout: float = 600) -> Grade:
    """Run the task's tests on ``patch``; never raises for a bad patch, a broken environment or a hang."""
    started = time.monotonic()
    try:
        env = ensure_env(task)
    except EnvBuildError as exc:
        return Grade("env_failed", reason=str(exc)[-1500:])
    repo, base = task.checkout()
    with workspace(repo, base) as ws:
        if why := apply_patch(ws.repo, patch):
            return Grade("patch_failed", reason=why, seconds=time.monotonic() - started)
        targets = test_targets(task)
        tracked = set(git("ls-tree", "-r", "--name-only", base, "--", *targets, cwd=ws.repo).split()) if targets else ()
        if tracked:
            git("checkout", base, "--", *sorted(tracked), cwd=ws.repo)
        if why := apply_patch(ws.repo, task.test_patch):
            return Grade("test_patch_failed", reason=why, seconds=time.monotonic() - started)
        paths = [str(ws.repo / "src"), str(ws.repo)] if (ws.repo / "src").is_dir() else [str(ws.repo)]
        run_env = {**env.environ(), "PYTHONPATH": ":".join(paths), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "240"}
        command = " ".join([env.spec.test_cmd, *targets])
        result = run_sandboxed(command, ws.repo, run_env, timeout, binds=[env.root])
    statuses = parse_pytest(result.output)
    f2p = sum(statuses.get(t) in PASSING for t in task.fail_to_pass)
    p2p = sum(statuses.get(t) in PASSING for t in task.pass_to_pass)
    failing = [t for t in (*task.fail_to_pass, *task.pass_to_pass) if statuses.get(t) not in PASSING]
    if result.timed_out:
        status, reason = "timeout", f"tests ran past {timeout:.0f} s"
    elif not failing and (task.fail_to_pass or task.pass_to_pass):
        status, reason = "resolved", ""
    elif statuses:
        status = "unresolved"
        reason = f"{len(failing)} test(s) fail, e.g. {failing[0]}" if failing else "no FAIL_TO_PASS/PASS_TO_PASS tests"
    else:
        status, reason = "unresolved", f"no test results (exit {result.returncode}): {result.output.strip()[-600:]}"
    return Grade(
        status,
        f2p_passed=f2p,
        f2p_total=len(task.fail_to_pass),
        p2p_passed=p2p,
        p2p_total=len(task.pass_to_pass),
        reason=reason,
        seconds=time.monotonic() - started,
        isolation=result.isolation,
    )

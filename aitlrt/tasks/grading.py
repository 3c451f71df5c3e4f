"""Grade a patch by running the task's tests: SWE-bench semantics, with a grade only a fix can pass.

In a private copy of the task's starting commit (the grader's own, never the agent's workspace): refuse a patch
that writes outside the repository, into ``.git`` or through a symbolic link; apply it (``git apply``, then
``patch --fuzz``); put the test infrastructure back as the base has it (``protected``: every test file and
folder, ``conftest.py``, pytest's ini files, ``setup.cfg``/``pyproject.toml``/``tox.ini``, ``sitecustomize``,
``usercustomize``, ``*.pth``; new modules or packages at the top of the repository or ``src/``, which would shadow
pytest or the standard library), naming what was put back in the grade's ``restored``; apply the task's
``test_patch``; and run the tests in the sandbox with the grader's own pytest plugin reporting each outcome
(``aitlrt.tasks.pytest_run``). Resolved = every FAIL_TO_PASS test passed and every PASS_TO_PASS test passed (or
failed as expected, ``XFAIL``) in a run the plugin vouches for. A run it cannot vouch for (tampering, an
incomplete run) is ``unresolved`` with the reason; one that never reached pytest is ``grader_error``
(unscorable: the grader's failure, not the patch's).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from aitlrt.common.git import git
from aitlrt.common.workspace import workspace
from aitlrt.tasks import patches
from aitlrt.tasks.envs import EnvBuildError, TestEnv, ensure_env
from aitlrt.tasks.pytest_run import PASSED, XFAIL, TestRun, run_pytest
from aitlrt.tasks.task import Task

F2P_PASSING = (PASSED,)
"""A FAIL_TO_PASS test must pass: a failure marked as expected is not a fix."""
P2P_PASSING = (PASSED, XFAIL)
TEST_DIRS = frozenset({"test", "tests"})
INFRASTRUCTURE = frozenset(
    {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "sitecustomize.py",
     "usercustomize.py"}
)  # fmt: skip


@dataclass(frozen=True)
class Grade:
    status: str
    """``resolved``, ``unresolved``, ``patch_failed``, ``test_patch_failed``, ``env_failed``, ``timeout``,
    ``grader_error``."""
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_passed: int = 0
    p2p_total: int = 0
    reason: str = ""
    seconds: float = 0.0
    isolation: str = ""
    restored: tuple[str, ...] = ()
    """Test infrastructure the patch changed, put back as the base has it before the tests ran."""

    @property
    def resolved(self) -> bool:
        return self.status == "resolved"

    @property
    def fraction(self) -> float:
        """Share of the FAIL_TO_PASS and PASS_TO_PASS tests that pass."""
        total = self.f2p_total + self.p2p_total
        return (self.f2p_passed + self.p2p_passed) / total if total else 0.0


@dataclass(frozen=True)
class GradeInputs:
    """What grading a patch of a task needs, and nothing of its fix (no oracle patch, no setup patch): the cached
    repository and the commit the agent starts from, the test environment, the test patch and the deciding tests."""

    instance_id: str
    repo: Path
    base: str
    env: TestEnv
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    targets: tuple[str, ...]


def test_targets(task: Task) -> list[str]:
    """The test files to run: those the test patch touches, else those the test ids name."""
    files = patches.changed_paths(task.test_patch) if task.test_patch else []
    files = files or [t.split("::", 1)[0] for t in (*task.fail_to_pass, *task.pass_to_pass)]
    return list(dict.fromkeys(files))


def protected(path: str, targets: list[str]) -> bool:
    """Whether ``path`` is test infrastructure, which a patch may not change (see the module docstring)."""
    parts = PurePosixPath(path).parts
    name = parts[-1]
    return (
        path in targets
        or name in INFRASTRUCTURE
        or name.endswith(".pth")
        or (name.startswith("test_") and name.endswith(".py"))
        or name.endswith("_test.py")
        or any(part in TEST_DIRS for part in parts[:-1])
    )


def apply_patch(repo: Path, patch: str) -> str | None:
    """Apply ``patch`` in the work tree; None, or why it does not apply (or is refused)."""
    if not patch.strip():
        return None
    if unsafe := patches.unsafe_paths(patch):
        return "patch refused: it writes outside the repository's files: " + ", ".join(unsafe[:3])
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


def _import_root_entry(path: str) -> str:
    """The entry of an import root (the repository, ``src/``: both on the tests' ``PYTHONPATH``) that holds ``path``."""
    parts = path.split("/")
    return "/".join(parts[:2]) if parts[0] == "src" and len(parts) > 1 else parts[0]


def changed_paths(repo: Path) -> list[str]:
    """The paths the work tree of the grader's copy ``repo`` changed, added or deleted, ignored ones included."""
    flags = ("--porcelain", "-z", "--untracked-files=all", "--ignored=traditional", "--no-renames")
    return [entry[3:] for entry in git("status", *flags, cwd=repo).split("\0") if entry]


def restore_infrastructure(repo: Path, base: str, targets: list[str]) -> list[str]:
    """Put every protected path the work tree changed back as ``base`` has it (new ones removed); return them.
    New entries at the top of an import root go too: ahead of the test venv on ``PYTHONPATH``, a new ``pytest.py``
    or ``json/`` would shadow pytest or the standard library (a fake pytest could speak the grader's channel)."""
    changed = changed_paths(repo)
    entries = set(git("ls-tree", "-z", "--name-only", base, "--", ".", "src/", cwd=repo).split("\0")) - {""}
    restored = sorted(p for p in changed if protected(p, targets) or _import_root_entry(p) not in entries)
    if not restored:
        return []
    in_base = set(git("ls-tree", "-r", "-z", "--name-only", base, "--", *restored, cwd=repo).split("\0")) - {""}
    if in_base:
        git("checkout", base, "--", *sorted(in_base), cwd=repo)
    for path in set(restored) - in_base:
        (repo / path).unlink(missing_ok=True)
    return restored


def _grade_run(inputs: GradeInputs, run: TestRun) -> tuple[str, str, int, int]:
    """Status, reason and the FAIL_TO_PASS / PASS_TO_PASS tests that passed, from one test run."""
    if run.timed_out:
        return "timeout", f"tests ran past {run.seconds:.0f} s", 0, 0
    if not run.statuses and any(p.startswith("pytest did not start") for p in run.problems):
        return "grader_error", f"no result from the tests (exit {run.returncode}): {run.output.strip()[-600:]}", 0, 0
    if run.problems:
        return "unresolved", "untrusted test run: " + "; ".join(run.problems), 0, 0
    f2p = sum(run.statuses.get(t) in F2P_PASSING for t in inputs.fail_to_pass)
    p2p = sum(run.statuses.get(t) in P2P_PASSING for t in inputs.pass_to_pass)
    failing = [t for t in inputs.fail_to_pass if run.statuses.get(t) not in F2P_PASSING]
    failing += [t for t in inputs.pass_to_pass if run.statuses.get(t) not in P2P_PASSING]
    if not failing and (inputs.fail_to_pass or inputs.pass_to_pass):
        return "resolved", "", f2p, p2p
    if not (inputs.fail_to_pass or inputs.pass_to_pass):
        return "unresolved", "no FAIL_TO_PASS/PASS_TO_PASS tests", f2p, p2p
    example = f"{failing[0]} ({run.statuses.get(failing[0], 'not run')})"
    return "unresolved", f"{len(failing)} test(s) fail, e.g. {example}", f2p, p2p


def grade_inputs(task: Task) -> GradeInputs:
    """``task``'s grading inputs, its test environment built if need be (``EnvBuildError`` if it cannot be)."""
    env = ensure_env(task)
    repo, base = task.checkout()
    return GradeInputs(
        task.instance_id, repo, base, env, task.test_patch, task.fail_to_pass, task.pass_to_pass,
        tuple(test_targets(task)),
    )  # fmt: skip


def grade(task: Task, patch: str, timeout: float = 600) -> Grade:
    """Run the task's tests on ``patch``; never raises for a bad patch, a broken environment or a hang."""
    started = time.monotonic()
    try:
        inputs = grade_inputs(task)
    except EnvBuildError as exc:
        return Grade("env_failed", reason=str(exc)[-1500:])
    return run_grade(inputs, patch, timeout, started)[0]


def run_grade(
    inputs: GradeInputs, patch: str, timeout: float = 600, started: float | None = None
) -> tuple[Grade, TestRun | None]:
    """The grade of ``patch`` and the test run it comes from (None when the tests did not run: the patch or the
    test patch does not apply), in a private copy of the task's start (``grade``'s, and the test feedback's);
    ``started``: when the grading began (``time.monotonic()``; default now)."""
    started = time.monotonic() if started is None else started
    with workspace(inputs.repo, inputs.base) as ws:
        if why := apply_patch(ws.repo, patch):
            return Grade("patch_failed", reason=why, seconds=time.monotonic() - started), None
        restored = tuple(restore_infrastructure(ws.repo, inputs.base, list(inputs.targets)))
        patched = changed_paths(ws.repo)  # the patch's files: the library's own unchanged code is the base's
        if why := apply_patch(ws.repo, inputs.test_patch):
            failed = Grade("test_patch_failed", reason=why, seconds=time.monotonic() - started, restored=restored)
            return failed, None
        run = run_pytest(inputs.env, ws.repo, inputs.targets, timeout, patched=patched)
    status, reason, f2p, p2p = _grade_run(inputs, run)
    if restored:
        reason = f"{reason}; test infrastructure put back: {', '.join(restored[:5])}".lstrip("; ")
    result = Grade(
        status,
        f2p_passed=f2p,
        f2p_total=len(inputs.fail_to_pass),
        p2p_passed=p2p,
        p2p_total=len(inputs.pass_to_pass),
        reason=reason,
        seconds=time.monotonic() - started,
        isolation=run.isolation,
        restored=restored,
    )
    return result, run

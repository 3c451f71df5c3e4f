"""The test feedback of a rollout (``RolloutSettings.test_feedback_rounds``): Aider's test command (``--test-cmd``,
``--auto-test``), which runs the task's tests on what the agent wrote so far, as the grader runs them, and prints
the failures that Aider sends back to the model.

``feedback_command`` writes what the run needs, and nothing of the fix (``GradeInputs``: no oracle patch, no setup
patch, none of the row's other columns), under ``$AITLRT_SCRATCH/feedback/``, out of the agent's reach, and returns
the command. Aider runs it in the agent's copy (``main``), which:

- takes the work tree's patch with the copy's trusted git directory (``aitlrt.common.workspace``: never the
  agent's ``.git``), and grades it as ``grade`` does (``run_grade``: the grader's own copy of the task's start,
  test infrastructure put back, the tests in the sandbox); the agent's copy is only read, and the rollout's grade
  is taken afresh at its end, so a feedback run cannot change it;
- prints ``AITLRT test feedback: ...`` (how many of the deciding tests fail, and the sandbox), then pytest's
  failures, at most ``max_chars`` of them (``failure_report``), and exits 0 iff the grade is ``resolved``;
- runs the tests at most ``rounds`` times per rollout (counted in the copy's scratch): after that it prints that no
  round is left and exits 0, so that Aider stops (its reflections also serve other retries, so cannot bound them).

Python runs isolated (``-I``): the working directory, the agent's repository, is not on its import path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from aitlrt.common.paths import aitlrt_home, scratch_dir
from aitlrt.common.workspace import agent_copy_at, work_tree_patch
from aitlrt.tasks.envs import EnvSpec, TestEnv
from aitlrt.tasks.grading import Grade, GradeInputs, grade_inputs, run_grade
from aitlrt.tasks.pytest_run import TestRun
from aitlrt.tasks.task import Task

log = logging.getLogger(__name__)

HEADER = "AITLRT test feedback:"
"""The first line of every feedback: how other code (the oracle teacher) recognises a test-output turn."""
LINE_CHARS = 400
"""Characters of one output line kept (a long assertion message, a repr)."""
RUNS_FILE = "test-feedback-runs"
"""In the copy's scratch: how many times the tests ran in this rollout."""
_SECTION = re.compile(r"^=+ (.+?) =+$")
_RULE = re.compile(r"^([=_])\1{2,} (.+?) \1{3,}$")
_RESULT = re.compile(r"^=+ .* in [\d.]+s( \([\d:]+\))? =+$")
"""pytest's last line, e.g. ``=== 2 failed, 5 passed in 0.31s ===``."""
_DETAIL_SECTIONS = ("ERRORS", "FAILURES")


def feedback_dir() -> Path:
    return scratch_dir() / "feedback"


def feedback_command(task: Task, max_chars: int, timeout_s: float, rounds: int) -> tuple[str, ...]:
    """The argv of ``task``'s test feedback, run with the agent's repository as working directory. Builds the task's
    test environment if need be (``EnvBuildError``). Its file is named by its content: written once, shared by every
    rollout of the task."""
    inputs = grade_inputs(task)
    environ = {"AITLRT_HOME": str(aitlrt_home()), "AITLRT_SCRATCH": str(scratch_dir())}  # Aider's has none of ours
    if runner := os.environ.get("AITLRT_TEST_RUNNER"):
        environ["AITLRT_TEST_RUNNER"] = runner  # the grader's sandbox
    spec = {
        "inputs": {**asdict(inputs), "repo": str(inputs.repo), "env": _env_json(inputs.env)},
        "environ": environ,
        "max_chars": max_chars,
        "timeout_s": timeout_s,
        "rounds": rounds,
    }
    text = json.dumps(spec, sort_keys=True)
    path = feedback_dir() / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.rename(path)
    return (sys.executable, "-I", "-m", "aitlrt.tasks.feedback", str(path))


def _env_json(env: TestEnv) -> dict[str, Any]:
    return {"root": str(env.root), "spec": asdict(env.spec)}


def _inputs_of(data: dict[str, Any]) -> GradeInputs:
    env = data["env"]
    spec = EnvSpec(**{**env["spec"], "pip_packages": tuple(env["spec"]["pip_packages"])})
    return GradeInputs(
        data["instance_id"], Path(data["repo"]), data["base"], TestEnv(Path(env["root"]), spec), data["test_patch"],
        tuple(data["fail_to_pass"]), tuple(data["pass_to_pass"]), tuple(data["targets"]),
    )  # fmt: skip


def headline(grade: Grade, run: TestRun | None) -> str:
    """The first line: how many of the task's deciding tests fail (or why no test ran), and the sandbox."""
    total = grade.f2p_total + grade.p2p_total
    if grade.resolved:
        said = f"all {total} tests pass"
    elif grade.status == "unresolved" and run is not None and run.statuses and not run.problems:
        said = f"{total - grade.f2p_passed - grade.p2p_passed} of {total} tests fail"
    else:
        said = f"no test result ({grade.status}): {grade.reason[:300]}"
    return f"{HEADER} {said}; sandbox: {grade.isolation or 'none (the tests did not run)'}"


def _sections(output: str) -> list[tuple[str, list[str]]]:
    """pytest's output cut at its ``=== title ===`` lines: (title, lines); the lines before the first: title ''."""
    sections: list[tuple[str, list[str]]] = [("", [])]
    for line in output.splitlines():
        match = _SECTION.match(line)
        if match:
            sections.append((match.group(1), [line]))
        else:
            sections[-1][1].append(line)
    return sections


def failure_report(output: str, max_chars: int) -> str:
    """The useful part of pytest's ``output`` in at most ``max_chars``: the tracebacks (``FAILURES``, ``ERRORS``),
    then the failing tests of the short summary and pytest's last line (its rules narrowed, lines cut at
    ``LINE_CHARS``). When that is too long, the first lines of each are kept, the tracebacks (the first failures
    whole) in what the list of failing tests (at most a third) leaves. Without those sections (pytest did not get
    that far), the output's end."""
    sections = _sections(output)
    details = [_narrow(line) for title, lines in sections if title in _DETAIL_SECTIONS for line in lines]
    failing = [
        _narrow(line)
        for title, lines in sections
        if title == "short test summary info"
        for line in lines[1:]
        if line.startswith(("FAILED", "ERROR"))
    ]
    last = [_narrow(line) for _, lines in sections for line in lines[:1] if _RESULT.match(line)][-1:]
    if not details and not failing:
        return output.strip()[-max_chars:]
    room = max(max_chars // 3, max_chars - _size(details) - _size(last) - 1)
    tail = [*_first_lines(failing, room - _size(last) - 1, "failing tests"), *last]
    head = _first_lines(details, max_chars - _size(tail) - 1, "tracebacks")
    return "\n".join(head + tail)[:max_chars]


def _narrow(line: str) -> str:
    """``line`` with pytest's rules (``=== title ===``, ``___ test ___``, as wide as the terminal) three characters
    wide, and cut at ``LINE_CHARS``."""
    if match := _RULE.match(line):
        line = f"{match.group(1) * 3} {match.group(2)} {match.group(1) * 3}"
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS] + " [...]"


def _size(lines: list[str]) -> int:
    return len("\n".join(lines))


def _first_lines(lines: list[str], limit: int, what: str) -> list[str]:
    """The first of ``lines`` that fit in ``limit`` characters with a last line saying how many of ``what`` went."""
    if _size(lines) <= limit:
        return lines
    kept: list[str] = []
    for line in lines:
        if _size([*kept, line]) > limit - 60:  # room for the note
            break
        kept.append(line)
    return [*kept, f"[... {len(lines) - len(kept)} more lines of {what} cut]"]


_ADDRESS = re.compile(r"\b0x[0-9a-f]{6,}\b")
_DURATION = re.compile(r" in [\d.]+s( \([\d:]+\))? (=+)$", re.MULTILINE)
STATEMENT_HEADER = "The failing tests' output on the repository as it is now:"
"""What ``starting_failures`` puts before the output in a problem statement."""


def starting_failures(task: Task, max_chars: int, timeout_s: float = 120.0) -> str:
    """The output of ``task``'s tests at its start (no patch), graded as the test feedback grades (the grader's own
    copy, the tests in the sandbox), cut to ``max_chars`` by ``failure_report``: the failing assertion SWE-smith puts
    in its problem statements (``RolloutSettings.statement_test_output``). Memory addresses and pytest's duration are
    blanked, and the text is cached under ``$AITLRT_HOME/statements`` by the task's row: every rollout, warm start and
    evaluation of the task reads the same statement. '' when the tests gave no failures to show (cached too: the
    tests run once per task, not once per rollout; a timed-out run is not cached); ``EnvBuildError`` when the
    task's test environment cannot be built."""
    row = json.dumps({"task": task.as_row(), "max_chars": max_chars}, sort_keys=True, default=str)
    path = aitlrt_home() / "statements" / f"{hashlib.sha256(row.encode()).hexdigest()[:24]}.txt"
    if path.is_file():
        return path.read_text()
    grade, run = run_grade(grade_inputs(task), "", timeout_s)
    if run is None or run.timed_out:  # may go otherwise next time: not cached
        log.warning("task %s: no test output for its statement (%s)", task.instance_id, grade.reason[:300])
        return ""
    text = ""
    if not run.statuses or run.problems or grade.resolved:  # the same at every run: cached, warned once
        log.warning("task %s: no failing test output for its statement (%s: %s)", task.instance_id, grade.status,
                    grade.reason[:300])  # fmt: skip
    else:
        text = failure_report(_DURATION.sub(r" \2", _ADDRESS.sub("0x...", run.output)), max_chars)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.rename(path)
    return text


def with_starting_failures(task: Task, max_chars: int) -> str:
    """``task``'s problem statement followed by ``starting_failures`` under ``STATEMENT_HEADER`` (the statement alone
    when the tests gave no output)."""
    failures = starting_failures(task, max_chars)
    if not failures:
        return task.problem_statement
    return f"{task.problem_statement.rstrip()}\n\n{STATEMENT_HEADER}\n```\n{failures}\n```"


def _next_run(scratch: Path) -> int:
    """Count this run in the copy's scratch; return its number (1 for the first)."""
    runs_file = scratch / RUNS_FILE
    runs = int(runs_file.read_text()) + 1 if runs_file.exists() else 1
    runs_file.write_text(str(runs))
    return runs


def feedback(spec: dict[str, Any], repo: Path) -> tuple[str, bool]:
    """The feedback for the agent copy ``repo`` and whether its patch resolves the task."""
    started = time.monotonic()
    ws = agent_copy_at(repo)
    if _next_run(ws.scratch) > spec["rounds"]:
        return f"{HEADER} no test round left ({spec['rounds']} used): the tests were not run", True
    assert ws.git_dir is not None  # agent_copy_at finds one
    patch = work_tree_patch(ws.git_dir, ws.repo, ws.head)
    timeout = max(spec["timeout_s"] - (time.monotonic() - started), 1.0)
    grade, run = run_grade(_inputs_of(spec["inputs"]), patch, timeout)
    lines = [headline(grade, run)]
    if grade.restored:
        lines.append(f"Put back as the task has them (tests may not be changed): {', '.join(grade.restored[:5])}")
    if run is not None and not grade.resolved:
        lines.append(failure_report(run.output, spec["max_chars"]))
    return "\n".join(lines).strip(), grade.resolved


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: python -I -m aitlrt.tasks.feedback SPEC.json (run in an agent copy)\n{__doc__}")
    try:
        spec = json.loads(Path(sys.argv[1]).read_text())
        os.environ.update(spec["environ"])
        text, resolved = feedback(spec, Path.cwd())
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:  # ours: one line, no traceback
        text, resolved = f"{HEADER} no test result: the test run failed ({type(exc).__name__}: {exc})"[:2000], False
    print(text, flush=True)
    sys.exit(0 if resolved else 1)


if __name__ == "__main__":
    main()

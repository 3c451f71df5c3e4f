"""Run a task's pytest tests in the sandbox and read each test's outcome from the grader's own channel.

The outcomes come from ``grade_channel/aitlrt_grade_channel.py``, a pytest plugin loaded before anything of the
workspace, over a pipe with a per-run nonce (never from stdout or a file the tests could write). A run counts
only when the plugin said ``done``, every collected test reported its setup and teardown, no record was out of
sequence or without the nonce, and the plugin saw nothing of pytest's machinery change (``TestRun.problems``).
The project's ``addopts`` are reset and pytest's cache is off; the test process gets a minimal environment
(nothing of the trainer's: no tokens) and, with bubblewrap, a read-only view of everything, the workspace too,
with a private ``/tmp``.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aitlrt.tasks.envs import TestEnv
from aitlrt.tasks.sandbox import run_sandboxed

CHANNEL_DIR = Path(__file__).parent / "grade_channel"
CHANNEL_ARGS = ("-p", "aitlrt_grade_channel", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short")
"""After the task's test command: our plugin, no cache, the project's ``addopts`` reset, and short tracebacks (the
output is read for the test feedback and reasons only, never for outcomes; SWE-bench's commands often say
``--tb=no``)."""
PASSED, XFAIL = "PASSED", "XFAIL"


@dataclass(frozen=True)
class TestRun:
    statuses: dict[str, str]
    """``{node id: PASSED | FAILED | ERROR | SKIPPED | XFAIL | XPASS}`` for every test the plugin reported."""
    problems: tuple[str, ...]
    """Why the run cannot be believed (tampering, an incomplete run, a forged record); empty when it can."""
    returncode: int | None
    output: str
    """The tail of the test process's output (for the reason of a failure only: never read for outcomes)."""
    timed_out: bool
    isolation: str
    seconds: float


def _status(phases: dict[str, tuple[str, bool]]) -> str:
    """One test's status from its phases' ``(outcome, xfail)``, as pytest's ``-rA`` summary names it."""
    if any(outcome == "failed" for outcome, _ in phases.values()):
        return "FAILED" if phases.get("call", ("", False))[0] == "failed" else "ERROR"
    outcome, xfail = phases.get("call") or phases.get("setup") or ("", False)
    if outcome == "skipped":
        return XFAIL if xfail else "SKIPPED"
    if outcome == "passed":
        return "XPASS" if xfail else PASSED
    return "ERROR"


def read_records(data: bytes, nonce: str) -> tuple[dict[str, str], list[str]]:
    """Statuses and problems from the channel's bytes (see the plugin's docstring for the records)."""
    problems: list[str] = []
    phases: dict[str, dict[str, tuple[str, bool]]] = defaultdict(dict)
    collected: list[str] | None = None
    done = False
    for n, line in enumerate(data.splitlines(), 1):
        try:
            record = json.loads(line)
            ok = isinstance(record, dict) and record.get("nonce") == nonce and record.get("seq") == n
        except ValueError:
            ok = False
        if not ok or done:
            problems.append(f"record {n} of the result channel is forged or out of order")
            break
        kind = record["kind"]
        if kind == "collected":
            collected = [str(i) for i in record["ids"]]
        elif kind == "report":
            phases[str(record["id"])][str(record["when"])] = (str(record["outcome"]), bool(record["xfail"]))
        elif kind == "tamper":
            problems.append("the code under test changed pytest's machinery: " + ", ".join(map(str, record["what"])))
        elif kind == "done":
            done = True
    if not data:
        problems.append("pytest did not start (no record from the grader's plugin)")
    elif not done:
        problems.append("pytest did not finish (the process exited or was killed before its session ended)")
    if collected is not None:
        unfinished = [i for i in collected if not {"setup", "teardown"} <= phases.get(i, {}).keys()]
        if unfinished:
            problems.append(f"{len(unfinished)} collected test(s) did not run to teardown, e.g. {unfinished[0]}")
    return _with_cut_ids({test: _status(p) for test, p in phases.items()}), problems


def _with_cut_ids(statuses: dict[str, str]) -> dict[str, str]:
    """Also each id cut at its first space, as SWE-bench's log parsers (and so task rows) write it: where several
    tests share a cut id, it passes only if each of them does."""
    out = dict(statuses)
    for test, status in statuses.items():
        cut = test.split(" ", 1)[0]
        if cut != test and out.get(cut, PASSED) == PASSED:
            out[cut] = status
    return out


def run_pytest(
    env: TestEnv, repo: Path, targets: Sequence[str], timeout: float, patched: Sequence[str] | None = None
) -> TestRun:
    """Run ``env``'s test command on ``targets`` (files or ids; all when empty) in ``repo``, sandboxed. ``patched``:
    the paths (relative to ``repo``) a graded patch changed; an import hook the library's own unchanged code installs
    (toolz's ``tlz``) is then no tampering. None: every file of ``repo`` may be the patch's."""
    nonce = secrets.token_hex(16)
    result_r, result_w = os.pipe()
    nonce_r, nonce_w = os.pipe()
    os.write(nonce_w, nonce.encode())
    os.close(nonce_w)
    paths = [str(CHANNEL_DIR), *([str(repo / "src")] if (repo / "src").is_dir() else []), str(repo)]
    run_env = {
        "PATH": f"{env.bin}:/usr/local/bin:/usr/bin:/bin",
        "VIRTUAL_ENV": str(env.root / "venv"),
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONPATH": ":".join(paths),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",  # test ids parametrized over a set (isodate's) are the same in every run
        "COLUMNS": "240",
        "AITLRT_GRADE_FD": str(result_w),
        "AITLRT_GRADE_NONCE_FD": str(nonce_r),
        **({"AITLRT_GRADE_PATCHED": json.dumps(list(patched))} if patched is not None else {}),
    }
    line = " ".join([env.spec.test_cmd, *map(shlex.quote, [*CHANNEL_ARGS, *targets])])
    result = run_sandboxed(
        ["bash", "-c", line],
        repo,
        run_env,
        timeout,
        binds=[env.root, (env.root / "venv").resolve(), CHANNEL_DIR],  # the venv itself where it is a link
        pass_fds=(result_w, nonce_r),
        read_fds=(result_r,),
        writable=False,
    )
    statuses, problems = read_records(result.extra[result_r], nonce)
    if result.overflowed:
        problems.append("the result channel carried more than its limit")
    return TestRun(
        statuses, tuple(problems), result.returncode, result.output, result.timed_out, result.isolation, result.seconds
    )

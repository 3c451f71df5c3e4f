"""Benchmark of grading and task generation on real tasks, side by side in one run:

1. tasks graded per minute (gold patches of webargs SWE-smith tasks, 2 at a time): cold (the test environment
   and the sdist are built first, in a fresh ``$AITLRT_HOME``) vs warm (everything cached);
2. sandbox overhead per test run: the same webargs test file run by bare pytest, through ``run_sandboxed`` (the
   sandbox: bubblewrap here, resource limits, bounded output) and as the grader runs it (``run_pytest``: the sandbox,
   a read-only workspace, the grader's result channel plugin), alternating rounds;
3. offline generation: time per valid task and for 20 tasks from ``pypi:cachetools==8.0.1`` (warm environment).

Run: ``python bench/rewards.py`` (no arguments; about 5 minutes here, needs PyPI the first time).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aitlrt.tasks.envs import ensure_env
from aitlrt.tasks.generate import generate_tasks
from aitlrt.tasks.grading import grade
from aitlrt.tasks.loader import load_tasks
from aitlrt.tasks.pytest_run import run_pytest
from aitlrt.tasks.sandbox import run_sandboxed
from aitlrt.tasks.sources import parse_source

DATA = Path(os.environ.get("AITLRT_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
GRADED = 6
ROUNDS = 7
GENERATE_GOAL_S = 300.0
SANDBOX_GOAL = 1.10
"""Issue 43: the hardened test run (sandbox, read-only copy, result channel) within 10% of bare pytest."""
TEST_FILE = "tests/test_core.py"


def grading_rate(tasks) -> tuple[float, float]:
    """(tasks per minute, seconds) for grading every task's gold patch."""
    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        grades = list(pool.map(lambda t: grade(t, t.patch), tasks))
    seconds = time.monotonic() - started
    assert all(g.resolved for g in grades), [g.reason for g in grades if not g.resolved]
    return len(tasks) / seconds * 60, seconds


def sandbox_overhead(task) -> tuple[float, float, float, str]:
    """Median seconds of one test-file run: bare pytest, through the sandbox, and as the grader runs it; and the
    sandbox's isolation."""
    env = ensure_env(task)
    src = env.root / "src"
    run_env = {**env.environ(), "PYTHONPATH": f"{src / 'src'}:{src}", "PYTHONDONTWRITEBYTECODE": "1"}
    command = ["bash", "-c", f"{env.spec.test_cmd} {TEST_FILE}"]
    bare, boxed, graded = [], [], []
    for _ in range(ROUNDS):
        t0 = time.monotonic()
        subprocess.run(command, cwd=src, env=run_env, capture_output=True, check=True)
        bare.append(time.monotonic() - t0)
        result = run_sandboxed(command, src, run_env, timeout=300, binds=[env.root])
        assert result.returncode == 0, result.output[-500:]
        boxed.append(result.seconds)
        run = run_pytest(env, src, [TEST_FILE], timeout=300)
        assert run.statuses and not run.problems and run.returncode == 0, (run.problems, run.output[-500:])
        graded.append(run.seconds)
    return statistics.median(bare), statistics.median(boxed), statistics.median(graded), result.isolation


def main() -> None:
    fast = (DATA / "swesmith_webargs" / "fast_subset.txt").read_text().split()[:GRADED]
    tasks = load_tasks(DATA / "swesmith_webargs" / "tasks.jsonl", ids=set(fast)).require()
    with tempfile.TemporaryDirectory() as home:
        real_home = os.environ.get("AITLRT_HOME")
        os.environ["AITLRT_HOME"] = home
        cold_rate, cold_s = grading_rate(tasks)
        if real_home is None:
            del os.environ["AITLRT_HOME"]
        else:
            os.environ["AITLRT_HOME"] = real_home
    grading_rate(tasks[:1])  # make sure the user's cache has this environment
    warm_rate, warm_s = grading_rate(tasks)
    bare, boxed, graded, isolation = sandbox_overhead(tasks[0])

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "generated.jsonl"
        report = generate_tasks(parse_source("pypi:cachetools==8.0.1"), out, max_tasks=1)
        report = generate_tasks(parse_source("pypi:cachetools==8.0.1"), out, max_tasks=20)
    per_task = report.seconds / max(1, report.kept)

    print(f"\ngrading: {len(tasks)} webargs SWE-smith tasks, gold patches, 2 at a time; {sys.platform}")
    print(f"{'measure':<44} {'value':>10}")
    print(f"{'cold: tasks graded / min (env + sdist built)':<44} {cold_rate:>10.1f}   ({cold_s:.0f} s)")
    print(f"{'warm: tasks graded / min':<44} {warm_rate:>10.1f}   ({warm_s:.0f} s)")
    print(f"{'test run, bare pytest (median s)':<44} {bare:>10.3f}")
    print(f"{'test run, sandboxed (median s)':<44} {boxed:>10.3f}   ({isolation})")
    print(f"{'test run, as graded (median s)':<44} {graded:>10.3f}   (+ read-only copy, result channel)")
    print(f"{'sandbox overhead per run (ms)':<44} {(boxed - bare) * 1000:>10.0f}   (x{boxed / bare:.3f})")
    print(f"{'graded run overhead per run (ms)':<44} {(graded - bare) * 1000:>10.0f}   (x{graded / bare:.3f})")
    print(f"{'generation: mutations tried':<44} {report.candidates:>10}")
    print(f"{'generation: valid tasks':<44} {report.kept:>10}")
    print(f"{'generation: seconds per valid task':<44} {per_task:>10.1f}")
    print(f"{'generation: seconds for the run':<44} {report.seconds:>10.1f}")
    ok = report.kept >= 20 and report.seconds <= GENERATE_GOAL_S
    print(f"TARGET generate_20_tasks_s {report.seconds:.1f} {GENERATE_GOAL_S:.0f} {'PASS' if ok else 'MISS'}")
    ratio, verdict = graded / bare, "PASS" if graded / bare <= SANDBOX_GOAL else "MISS"
    print(f"TARGET sandboxed_test_run_ratio {ratio:.3f} {SANDBOX_GOAL:.2f} {verdict}")


if __name__ == "__main__":
    from results import recorded  # bench/results.py: this run's row in bench/results.jsonl

    recorded("rewards", main)

"""Benchmark of agent rollouts, side by side in one run, against the scripted upstream (no model cost):

1. per-rollout overhead (everything but waiting for the model): warm Aider workers vs the Aider CLI, and
   mini-swe-agent's warm workers (fork servers) vs its ``mini`` CLI (one call that edits and submits, its command in
   the sandbox), when its venv is there;
2. workspace creation vs a full clone, on a real source tree (the installed ``transformers`` package made into
   a git repository): a fresh agent copy (the task's tree checked out by our trusted git, and a ``.git`` of one
   commit copied from the tree's seed: the first copy of a tree packs the seed), a recycled one (a used copy moved
   to the next task's tree, cleaned, checked pristine, given a fresh ``.git``: what ``RolloutRunner`` does after
   its first rollouts), and the grader's plain copy (shared clone at the base commit);
3. rollouts/minute at 1, 8 and 16 concurrent warm agents when every model call takes a fixed 1 s.

Run: ``python bench/rollouts.py`` (no arguments).
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from aitlrt.common.git import git
from aitlrt.common.procs import free_port, wait_http
from aitlrt.common.workspace import WorkspacePool, patch_of, workspace
from aitlrt.rollout.agents.aider import AiderAgent, WarmAiderAgent
from aitlrt.rollout.agents.base import AgentTask
from aitlrt.rollout.agents.mini_swe import MiniSweAgent, miniswe_venv
from aitlrt.rollout.runner import RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.serving.process import ServeProcess
from aitlrt.tasks.sources import cache_local_repo, with_patch

CALC = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
OTHER_BASE = (
    "diff --git a/other_task.py b/other_task.py\nnew file mode 100644\n--- /dev/null\n+++ b/other_task.py\n"
    "@@ -0,0 +1 @@\n+# another task's base\n"
)


def model_seconds(outcome: RolloutOutcome) -> float:
    return sum(c["ended_at"] - c["started_at"] for c in outcome.trace)


def overhead(runner: RolloutRunner, requests: list[RolloutRequest]) -> list[RolloutOutcome]:
    """The rollouts, run by a new runner (fresh workspaces)."""
    with runner:
        return runner.run(requests)


def seconds_outside_the_model(outcomes: list[RolloutOutcome]) -> list[float]:
    return [o.timings["total_s"] - model_seconds(o) for o in outcomes]


def miniswe_overhead(
    runner: Callable[[MiniSweAgent], RolloutRunner], warm: MiniSweAgent, src: Path, base: str, upstream: str
) -> tuple[list[tuple[str, str]], str]:
    """mini-swe-agent's overhead per rollout, CLI vs warm, alternating after a warm-up: one scripted answer whose
    command edits the file and submits (so one call, one sandboxed command, a trajectory written)."""
    print("[bench] per-rollout overhead: mini-swe-agent CLI vs warm workers", flush=True)
    command = f"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && printf '{FIXED}' > calc.py"
    reply = f"THOUGHT: fix it.\n\n```mswea_bash_command\n{command}\n```"
    httpx.post(f"{upstream}/script", json={"match": "MINISWE-BENCH", "reply": reply}).raise_for_status()
    task = AgentTask("calc-mini", "MINISWE-BENCH: fix add() in calc.py")
    overhead(runner(warm), [RolloutRequest("mini-warmup", task, src, base)])
    cli_out, warm_out = [], []
    for i in range(4):
        cli = MiniSweAgent(step_limit=2, warm=False)
        cli_out += overhead(runner(cli), [RolloutRequest(f"mini-cli-{i}", task, src, base)])
        warm_out += overhead(runner(warm), [RolloutRequest(f"mini-warm-{i}", task, src, base)])
    bad = [o.status for o in cli_out + warm_out if o.status != "ok"]
    cli_s, wrm = (statistics.median(seconds_outside_the_model(o)) for o in (cli_out, warm_out))
    rows = [
        ("overhead per rollout, mini-swe-agent CLI", f"{cli_s:.3f} s" + (f" ({bad})" if bad else "")),
        ("overhead per rollout, mini-swe-agent warm (fork server)", f"{wrm:.3f} s"),
        ("mini-swe-agent CLI / warm", f"{cli_s / wrm:.1f}x"),
    ]
    return rows, f"TARGET miniswe_warm_overhead_s {wrm:.3f} 0.2 {'PASS' if wrm <= 0.2 and not bad else 'MISS'}"


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="aitlrt-bench-rollouts-"))
    src = work / "src"
    src.mkdir()
    (src / "calc.py").write_text(CALC)
    git("init", "-q", cwd=src)
    git("add", "-A", cwd=src)
    git("commit", "-q", "-m", "base", cwd=src)
    base = git("rev-parse", "HEAD", cwd=src).strip()
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    null = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.scripted_upstream", "--port", str(port)], stdin=subprocess.DEVNULL
    )
    rows: list[tuple[str, str]] = []
    targets: list[str] = []
    warm = WarmAiderAgent()
    mini = MiniSweAgent(step_limit=2)
    try:
        wait_http(f"{upstream}/health", null)
        httpx.post(f"{upstream}/script", json={"match": "FIXIT", "reply": f"calc.py\n```python\n{FIXED}```\n"})
        task = AgentTask("calc", "FIXIT: fix add()", ("calc.py",))
        slow_task = AgentTask("calc-slow", "fault:slow:1.0 FIXIT: fix add()", ("calc.py",))
        with ServeProcess(
            ["--upstream", upstream, "--run-dir", str(work / "journal")], port=free_port(), log_path=work / "proxy.log"
        ) as proxy:

            def runner(agent, concurrency: int = 1) -> RolloutRunner:
                return RolloutRunner(
                    agent, proxy.url, "scripted", concurrency=concurrency, timeout_s=300, workspaces=work / "ws"
                )

            # 1. overhead, CLI vs warm, alternating
            print("[bench] per-rollout overhead: Aider CLI vs warm workers", flush=True)
            overhead(runner(warm), [RolloutRequest("warmup", task, src, base)])
            cli_s, warm_out = [], []
            for i in range(4):
                cli_s += seconds_outside_the_model(
                    overhead(runner(AiderAgent()), [RolloutRequest(f"cli-{i}", task, src, base)])
                )
                warm_out += overhead(runner(warm), [RolloutRequest(f"warm-{i}", task, src, base)])
            cli, wrm = statistics.median(cli_s), statistics.median(seconds_outside_the_model(warm_out))
            rows += [
                ("overhead per rollout, Aider CLI", f"{cli:.3f} s"),
                ("overhead per rollout, warm", f"{wrm:.3f} s"),
                ("CLI / warm", f"{cli / wrm:.1f}x"),
            ]
            ws_s, diff_s = (statistics.median(o.timings[k] for o in warm_out) for k in ("workspace_s", "diff_s"))
            rows += [
                ("workspace_s per warm rollout (a fresh copy of 1 file)", f"{ws_s:.3f} s"),
                ("diff_s per warm rollout", f"{diff_s:.3f} s"),
            ]
            targets += [
                f"TARGET warm_overhead_s {wrm:.3f} 0.2 {'PASS' if wrm <= 0.2 else 'MISS'}",
                f"TARGET cli_over_warm {cli / wrm:.1f} 15 {'PASS' if cli / wrm >= 15 else 'MISS'}",
            ]
            if (miniswe_venv() / "bin" / "mini").exists():
                mini_rows, mini_target = miniswe_overhead(runner, mini, src, base, upstream)
                rows += mini_rows
                targets.append(mini_target)

            # 3. throughput with a fixed-latency model
            rpm = {}
            warm.prestart(16, wait=True)
            # A worker's first rollout still imports what Aider loads lazily: warm all 16 once.
            with runner(warm, 16) as r16:
                r16.run([RolloutRequest(f"warm16-{i}", task, src, base) for i in range(16)])
            for conc in (1, 8, 16):
                n = max(8, conc * 4)  # enough waves that start-up and tail do not dominate
                print(f"[bench] throughput: {n} rollouts, {conc} concurrent, 1 s per model call", flush=True)
                reqs = [RolloutRequest(f"tp{conc}-{i}", slow_task, src, base) for i in range(n)]
                with runner(warm, conc) as r:
                    t0 = time.monotonic()
                    outcomes = r.run(reqs)
                    rpm[conc] = n / (time.monotonic() - t0) * 60
                bad = [o.status for o in outcomes if o.status != "ok"]
                rows.append((f"rollouts/min at {conc} concurrent", f"{rpm[conc]:.1f}" + (f" ({bad})" if bad else "")))
            for conc in (8, 16):
                eff = rpm[conc] / (rpm[1] * conc)
                rows.append((f"scaling efficiency 1 -> {conc}", f"{eff:.2f}"))
            eff8 = rpm[8] / (rpm[1] * 8)
            targets.append(f"TARGET scaling_1_to_8 {eff8:.2f} 0.8 {'PASS' if eff8 >= 0.8 else 'MISS'}")
    finally:
        warm.close()
        mini.close()
        null.terminate()
        null.wait(10)

    # 2. workspace vs full clone on a real tree
    import transformers

    print("[bench] workspace copy vs full clone (transformers source tree)", flush=True)
    repo = cache_local_repo(Path(transformers.__file__).parent)
    head = git("rev-parse", "HEAD", cwd=repo).strip()
    files = git("ls-files", cwd=repo).splitlines()
    # A second task on the same repository: its base differs in one file (as SWE-smith tasks do).
    other = with_patch(repo, head, OTHER_BASE)
    pool, fresh = WorkspacePool(work / "pool", max_idle=1), WorkspacePool(work / "fresh", max_idle=0)
    copy_s, plain_s, recycle_s, patch_s, clone_s = [], [], [], [], []
    for i in range(3):
        t0 = time.monotonic()
        with fresh.workspace(repo, head):
            copy_s.append(time.monotonic() - t0)
        t0 = time.monotonic()
        with workspace(repo, head, work / "plain"):
            plain_s.append(time.monotonic() - t0)
        for commit in (head, other):  # an agent edits, then the copy moves to the next task's base
            t0 = time.monotonic()
            with pool.workspace(repo, commit) as ws:
                recycle_s.append(time.monotonic() - t0)
                (ws.repo / files[0]).write_text("edited by the agent\n")
                (ws.repo / "new_file.py").write_text("x = 1\n")
                t0 = time.monotonic()
                patch_of(ws)
                patch_s.append(time.monotonic() - t0)
        target = work / f"full-{i}"
        t0 = time.monotonic()
        git("clone", "-q", "--no-local", repo, target, cwd=work)
        clone_s.append(time.monotonic() - t0)
        shutil.rmtree(target)
    pool.close()
    fresh.close()
    copy, clone = statistics.median(copy_s[1:]), statistics.median(clone_s)
    recycled = statistics.median(recycle_s[2:])  # the first is the pool's fresh copy, the second packs a seed
    rows += [
        (f"workspace, fresh agent copy, first of its tree (seed packed), {len(files)} files", f"{copy_s[0]:.2f} s"),
        ("workspace, fresh agent copy (seed there)", f"{copy:.2f} s"),
        ("workspace, plain copy (the grader's: clone --shared + checkout)", f"{statistics.median(plain_s):.2f} s"),
        ("workspace, recycled to a new tree (its seed packed, reusing the other's)", f"{recycle_s[1]:.3f} s"),
        ("workspace, recycled copy (checkout --force + clean + pristine check + fresh .git)", f"{recycled:.3f} s"),
        ("patch of a recycled copy (trusted add -A + diff)", f"{statistics.median(patch_s):.3f} s"),
        ("full clone (--no-local)", f"{clone:.2f} s"),
        ("fresh copy / full clone", f"{copy / clone:.2f}"),
        ("recycled copy / full clone", f"{recycled / clone:.3f}"),
    ]
    targets.append(
        f"TARGET workspace_over_clone {recycled / clone:.3f} 0.10 {'PASS' if recycled / clone <= 0.10 else 'MISS'}"
    )
    shutil.rmtree(work, ignore_errors=True)

    print("\n| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print()
    print("\n".join(targets))


if __name__ == "__main__":
    from results import recorded  # bench/results.py: this run's row in bench/results.jsonl

    recorded("rollouts", main)

"""``aitlrt rollout``: run agents on tasks through a running ``aitlrt-serve``, without training.

Tasks file: JSON lines with ``instance_id``, ``problem_statement``, ``repo_path`` (a local directory or git
repository), optional ``base_commit`` (default ``HEAD``) and ``files`` (paths to open for the agent).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx

from aitlrt.agents.aider import AiderAgent, WarmAiderAgent
from aitlrt.agents.base import Agent, AgentTask
from aitlrt.agents.single_call import SingleCallAgent
from aitlrt.rollouts import Progress, RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.workspace import cache_local_repo, git


def load_tasks(path: Path) -> list[tuple[AgentTask, Path, str]]:
    """Read the tasks file; a bad row stops with its line number and id."""
    tasks = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = None
        try:
            row = json.loads(line)
            task_id = row["instance_id"]
            repo = cache_local_repo(Path(row["repo_path"]).expanduser())
            base = git("rev-parse", row.get("base_commit") or "HEAD", cwd=repo).strip()
            task = AgentTask(task_id, row["problem_statement"], tuple(row.get("files") or ()))
        except (json.JSONDecodeError, KeyError, TypeError, OSError, RuntimeError) as exc:
            ident = row.get("instance_id", "?") if isinstance(row, dict) else "?"
            raise SystemExit(f"aitlrt rollout: {path}:{lineno} (task {ident}): {type(exc).__name__}: {exc}") from None
        tasks.append((task, repo, base))
    if not tasks:
        raise SystemExit(f"aitlrt rollout: no tasks in {path}")
    return tasks


def make_agent(name: str, edit_format: str) -> Agent:
    if name == "aider":
        return AiderAgent(edit_format=edit_format)
    if name == "aider-warm":
        return WarmAiderAgent(edit_format=edit_format)
    if name == "single-call":
        return SingleCallAgent()
    raise SystemExit(f"aitlrt rollout: unknown agent {name!r} (aider-warm, aider, single-call)")


def print_table(outcomes: list[RolloutOutcome]) -> None:
    print(f"\n{'rollout':<28} {'task':<24} {'status':<11} {'calls':>5} {'tokens':>6} {'agent s':>7}  reason")
    for o in outcomes:
        print(
            f"{o.rollout_id:<28} {o.task_id[:24]:<24} {o.status:<11} {o.calls:>5} {o.completion_tokens:>6} "
            f"{o.timings.get('agent_s', 0):>7.1f}  {o.reason[:80]}"
        )
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    print("statuses: " + ", ".join(f"{k}={v}" for k, v in sorted(by_status.items())))


def run(args) -> list[RolloutOutcome]:
    proxy = args.proxy.rstrip("/")
    model = args.model
    if model is None:
        models = httpx.get(f"{proxy}/v1/models", timeout=30).raise_for_status().json()["data"]
        model = models[0]["id"]
    tasks = load_tasks(args.tasks)
    stamp = time.strftime("%H%M%S")
    requests = [
        RolloutRequest(f"{task.task_id[:80]}.{stamp}.{g}".replace("/", "_"), task, repo, base)
        for task, repo, base in tasks
        for g in range(args.n)
    ]
    runner = RolloutRunner(
        make_agent(args.agent, args.edit_format),
        proxy,
        model,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        max_calls=args.max_calls,
        context_window=args.context_window,
    )
    last = [0.0]
    lock = threading.Lock()

    def show(progress: Progress) -> None:
        with lock:
            if time.monotonic() - last[0] > 1 or progress.done == progress.total:
                end = "\n" if progress.done == progress.total or not sys.stdout.isatty() else "\r"
                print(f"[aitlrt] {progress.line()}", end=end, flush=True)
                last[0] = time.monotonic()

    print(
        f"[aitlrt] {len(requests)} rollouts ({len(tasks)} tasks x {args.n}) with {args.agent}, "
        f"{args.concurrency} at a time, model {model} via {proxy}",
        flush=True,
    )
    try:
        outcomes = runner.run(requests, on_progress=show)
    finally:
        if hasattr(runner.agent, "close"):
            runner.agent.close()
    print_table(outcomes)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            for o in outcomes:
                f.write(json.dumps({**o.summary(), "trace": o.trace}) + "\n")
        print(f"[aitlrt] outcomes and traces: {args.out}")
    return outcomes


def add_parser(verbs) -> None:
    p = verbs.add_parser("rollout", help="run agents on tasks via aitlrt-serve (no training), with a summary")
    p.add_argument("--tasks", type=Path, required=True, help="JSON lines (see `aitlrt.rollout_cli`)")
    p.add_argument("--proxy", default="http://127.0.0.1:8000", help="aitlrt-serve URL")
    p.add_argument("--n", type=int, default=1, help="rollouts per task")
    p.add_argument("--agent", default="aider-warm", help="aider-warm (warm workers), aider (CLI) or single-call")
    p.add_argument("--edit-format", default="whole", help="Aider's edit format (whole, diff, ...)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0, help="wall-clock seconds per rollout")
    p.add_argument("--max-calls", type=int, default=None, help="model calls per rollout (enforced by the proxy)")
    p.add_argument("--model", default=None, help="served model name (default: the proxy's first)")
    p.add_argument("--context-window", type=int, default=8192)
    p.add_argument("--out", type=Path, default=None, help="write outcomes with traces as JSON lines")

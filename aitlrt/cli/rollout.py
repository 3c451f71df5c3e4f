"""``aitlrt rollout``: run agents on tasks through a running ``aitlrt-serve``, without training.

Tasks: any file or dataset ``aitlrt.tasks.loader`` reads (SWE-bench, SWE-smith or aitlrt rows; a ``repo_path``
column names a local directory or git repository). Bad rows are reported with their line and id and skipped.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx

from aitlrt.common.resources import agent_slots
from aitlrt.rollout.agents import AgentTask, make_agent
from aitlrt.rollout.runner import Progress, RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.tasks.loader import load_tasks, parse_overrides
from aitlrt.tasks.task import Task


def prepared_tasks(args) -> list[tuple[Task, Path, str]]:
    """The valid tasks with their cached repository and starting commit; bad rows reported on stderr."""
    loaded = load_tasks(args.tasks, overrides=parse_overrides(args.source), limit=args.limit)
    for problem in loaded.problems:
        print(f"aitlrt rollout: skipping bad row {problem}", file=sys.stderr)
    out = []
    for task in loaded.require():
        try:
            out.append((task, *task.checkout()))
        except (OSError, RuntimeError) as exc:
            print(f"aitlrt rollout: skipping task {task.instance_id}: {exc}", file=sys.stderr)
    if not out:
        raise SystemExit("aitlrt rollout: no task could be prepared")
    return out


def print_table(outcomes: list[RolloutOutcome]) -> None:
    rid = max([len("rollout"), *(len(o.rollout_id) for o in outcomes)])
    print(f"\n{'rollout':<{rid}} {'status':<11} {'calls':>5} {'tokens':>6} {'agent s':>7}  reason")
    for o in outcomes:  # a rollout id starts with its task id
        print(
            f"{o.rollout_id:<{rid}} {o.status:<11} {o.calls:>5} {o.completion_tokens:>6} "
            f"{o.timings.get('agent_s', 0):>7.1f}  {o.reason[:80]}"
        )
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    print("statuses: " + ", ".join(f"{k}={v}" for k, v in sorted(by_status.items())))


def run(args) -> tuple[list[RolloutOutcome], dict[str, list[float]], list[Task]]:
    """Run the rollouts; return them, their rewards (``--rewards``) and each one's task."""
    proxy = args.proxy.rstrip("/")
    model = args.model
    if model is None:
        models = httpx.get(f"{proxy}/v1/models", timeout=30).raise_for_status().json()["data"]
        model = models[0]["id"]
    tasks = prepared_tasks(args)
    stamp = time.strftime("%H%M%S")
    requests = [
        RolloutRequest(
            f"{task.instance_id[:80]}.{stamp}.{g}".replace("/", "_"),
            AgentTask(task.instance_id, task.problem_statement, task.files),
            repo,
            base,
        )
        for task, repo, base in tasks
        for g in range(args.n)
    ]
    try:
        agent = make_agent(args.agent, args.edit_format)
    except ValueError as exc:
        raise SystemExit(f"aitlrt rollout: {exc}") from None
    args.concurrency = args.concurrency or agent_slots()
    runner = RolloutRunner(
        agent,
        proxy,
        model,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        max_calls=args.max_calls,
        context_window=args.context_window,
        recycle_workspaces=not args.fresh_workspaces,
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
        runner.close()
        if hasattr(runner.agent, "close"):
            runner.agent.close()
    print_table(outcomes)
    per_rollout = [t for t, _, _ in tasks for _ in range(args.n)]
    rewards = score(args.rewards, outcomes, per_rollout) if args.rewards else {}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            for i, o in enumerate(outcomes):
                scores = {name: values[i] for name, values in rewards.items()}
                f.write(json.dumps({**o.summary(), "rewards": scores, "trace": o.trace}) + "\n")
        print(f"[aitlrt] outcomes and traces: {args.out}")
    return outcomes, rewards, per_rollout


def score(names: str, outcomes: list[RolloutOutcome], tasks: list[Task]) -> dict[str, list[float]]:
    """Score each rollout with the named built-in rewards and print them beside the rollout ids."""
    from aitlrt.rewards.builtin import REWARDS

    unknown = [n for n in names.split(",") if n not in REWARDS]
    if unknown:
        raise SystemExit(f"aitlrt rollout: unknown rewards {unknown} (known: {', '.join(REWARDS)})")
    rows = [
        {**t.as_row(), "agent_patch": o.patch, "rollout_status": o.status} for t, o in zip(tasks, outcomes, strict=True)
    ]
    columns = {k: [r.get(k) for r in rows] for k in rows[0]}
    scores = {name: REWARDS[name](**columns) for name in names.split(",")}
    print("\n" + f"{'rollout':<40}" + "".join(f" {n:>20}" for n in scores))
    for i, o in enumerate(outcomes):
        print(f"{o.rollout_id[:40]:<40}" + "".join(f" {v[i]:>20.3f}" for v in scores.values()))
    return scores


def add_rollout_arguments(p) -> None:
    """The arguments ``aitlrt rollout`` and ``aitlrt eval`` share."""
    p.add_argument("--tasks", required=True, help="task file (JSON/JSONL/CSV/parquet) or Hub dataset name")
    p.add_argument("--source", action="append", default=[], help="ID_OR_REPO=SOURCE to override a task's repo")
    p.add_argument("--limit", type=int, default=None, help="use only the first N valid tasks")
    p.add_argument("--n", type=int, default=1, help="rollouts per task")
    p.add_argument("--agent", default="aider-warm", help="aider-warm (warm workers), aider (CLI) or single-call")
    p.add_argument("--edit-format", default="whole", help="Aider's edit format (whole, diff, ...)")
    p.add_argument("--concurrency", type=int, default=None, help="agents at once (default: from cores and memory)")
    p.add_argument("--timeout", type=float, default=600.0, help="wall-clock seconds per rollout")
    p.add_argument("--max-calls", type=int, default=None, help="model calls per rollout (enforced by the proxy)")
    p.add_argument(
        "--fresh-workspaces",
        action="store_true",
        help="a fresh repository copy per rollout (default: recycle finished copies, reset and checked pristine)",
    )
    p.add_argument("--context-window", type=int, default=8192)


def add_parser(verbs) -> None:
    p = verbs.add_parser("rollout", help="run agents on tasks via aitlrt-serve (no training), with a summary")
    add_rollout_arguments(p)
    p.add_argument("--rewards", default="", help="comma-separated built-in rewards to score rollouts with")
    p.add_argument("--proxy", default="http://127.0.0.1:8000", help="aitlrt-serve URL")
    p.add_argument("--model", default=None, help="served model name (default: the proxy's first)")
    p.add_argument("--out", type=Path, default=None, help="write outcomes with traces as JSON lines")

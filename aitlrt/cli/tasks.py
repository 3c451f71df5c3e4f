"""``aitlrt tasks``: generate bug-fix tasks offline, check task files (load, then grade oracle and empty), and
probe their difficulty under a policy (the curriculum's sidecar, ``aitlrt.tasks.difficulty``)."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aitlrt.cli.eval import add_sampling_flags
from aitlrt.cli.rollout import prepared_tasks, progress_printer, reward_weights, rollout_flags, rollout_settings
from aitlrt.tasks.difficulty import SOLVED_REWARD, TaskDifficulty, sidecar_path
from aitlrt.tasks.loader import load_tasks, parse_overrides
from aitlrt.tasks.sources import parse_source

PROBE_REWARDS = "tests_pass,patch_similarity,non_empty_patch"


def add_parser(verbs: argparse._SubParsersAction) -> None:
    tasks = verbs.add_parser("tasks", help="generate and check tasks").add_subparsers(dest="action", required=True)
    gen = tasks.add_parser("generate", help="make bug-fix tasks from a repository's own test suite (AST mutations)")
    gen.add_argument("--from", dest="source", required=True, help="pypi:NAME==VER, git:URL@SHA or a local path")
    gen.add_argument("--out", type=Path, required=True, help="JSON lines to append the tasks to")
    gen.add_argument("--max-tasks", type=int, default=30)
    gen.add_argument("--max-candidates", type=int, default=None, help="stop after trying this many mutations")
    gen.add_argument("--per-function", type=int, default=2, help="mutations tried per function")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--workers", type=int, default=2, help="test suites run at a time")
    gen.add_argument("--max-file-lines", type=int, default=None, help="mutate only library files this short")
    gen.add_argument("--env", default=None, help='test environment spec as JSON, e.g. {"python": "3.11"}')

    check = tasks.add_parser("check", help="load a task file, report bad rows, and validate tasks by running tests")
    check.add_argument("tasks", help="JSON/JSONL/CSV/parquet file or Hub dataset name")
    check.add_argument("--split", default="test", help="Hub dataset split")
    check.add_argument("--source", action="append", default=[], help="ID_OR_REPO=SOURCE (e.g. pypi:pkg==1.0)")
    check.add_argument("--ids", nargs="*", default=None, help="only these instance ids")
    check.add_argument("--limit", type=int, default=None)
    check.add_argument("--load-only", action="store_true", help="only load and report bad rows")
    check.add_argument("--workers", type=int, default=2)
    check.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")

    probe = tasks.add_parser(
        "probe",
        parents=[rollout_flags()],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="roll out a policy k times per task and write each task's difficulty (for the curriculum)",
    )
    probe.add_argument("--k", dest="n", type=int, metavar="K", help="rollouts per task (same as --n; default 4)")
    probe.set_defaults(n=4)
    probe.add_argument(
        "--model", default=None, help="weights folder or 'bundled' (default); with --serve, 'served' (default)"
    )
    probe.add_argument("--serve", "--proxy", dest="serve", default=None, help="a running aitlrt-serve URL")
    probe.add_argument(
        "--rewards",
        default=PROBE_REWARDS,
        help="built-in rewards as NAME[=WEIGHT],... (weight 1 by default) for reward_mean; tests_pass is always "
        "computed (solved_rate), with weight 0 when not listed",
    )
    probe.add_argument("--out", type=Path, default=None, help="the sidecar (default: TASKS.difficulty.jsonl)")
    probe.add_argument("--merge", action="store_true", help="keep the sidecar's other tasks, replace those probed")
    add_sampling_flags(probe)
    probe.add_argument("--run-dir", type=Path, default=Path("runs/probe"), help="the managed server's files")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "probe":
            return probe(args)
        return generate(args) if args.action == "generate" else check(args)
    except (RuntimeError, ValueError, OSError) as exc:  # env build, source fetch, bad spec: one clear line
        print(f"aitlrt tasks {args.action}: {exc}", file=sys.stderr)
        return 1


def generate(args: argparse.Namespace) -> int:
    from aitlrt.tasks.generate import generate_tasks

    report = generate_tasks(
        parse_source(args.source),
        args.out,
        max_tasks=args.max_tasks,
        max_candidates=args.max_candidates,
        seed=args.seed,
        per_function=args.per_function,
        workers=args.workers,
        max_file_lines=args.max_file_lines,
        env=json.loads(args.env) if args.env else None,
    )
    print(f"[aitlrt] {report.kept} tasks appended to {args.out}; kinds: {report.kinds}")
    return 0 if report.kept else 1


def check(args: argparse.Namespace) -> int:
    from aitlrt.tasks.grading import grade

    loaded = load_tasks(
        args.tasks,
        split=args.split,
        overrides=parse_overrides(args.source),
        ids=set(args.ids) if args.ids else None,
        limit=args.limit,
    )
    for problem in loaded.problems:
        print(f"[aitlrt] bad row: {problem}")
    print(f"[aitlrt] {len(loaded.tasks)} tasks loaded, {len(loaded.problems)} bad rows")
    if args.load_only or not loaded.tasks:
        return int(bool(loaded.problems) or not loaded.tasks)

    def validate(task):
        gold, empty = grade(task, task.patch, args.timeout), grade(task, "", args.timeout)
        ok = gold.resolved and empty.f2p_passed == 0
        return task, gold, empty, ok

    print(f"\n{'task':<58} {'oracle':<12} {'empty':<12} {'F2P':>4} {'P2P':>5} {'s':>5}  verdict")
    bad = 0
    with ThreadPoolExecutor(args.workers) as pool:
        for task, gold, empty, ok in pool.map(validate, loaded.tasks):
            bad += not ok
            why = "" if ok else (gold.reason or empty.reason or "FAIL_TO_PASS tests pass without the fix")[:120]
            print(
                f"{task.instance_id[:58]:<58} {gold.status:<12} {empty.status:<12} {gold.f2p_total:>4} "
                f"{gold.p2p_total:>5} {gold.seconds + empty.seconds:>5.1f}  {'valid' if ok else 'INVALID ' + why}",
                flush=True,
            )
    print(f"[aitlrt] {len(loaded.tasks) - bad} valid, {bad} invalid; isolation: {gold.isolation}")
    return int(bad > 0 or bool(loaded.problems))


def probe(args: argparse.Namespace) -> int:
    """Roll out the policy ``--k`` times per task (``aitlrt.evaluation.checkpoints.evaluate``), write the sidecar,
    print each task's difficulty and the counts of each class."""
    from aitlrt.evaluation.checkpoints import SERVED, evaluate
    from aitlrt.evaluation.scoring import reward_funcs
    from aitlrt.rollout.batch import served_model
    from aitlrt.tasks.difficulty import difficulty_from_rollouts, write_difficulty

    out = args.out or sidecar_path(args.tasks)
    if args.out is None and not Path(args.tasks).is_file():
        raise ValueError(f"{args.tasks} is not a file: give the sidecar's path with --out")
    weights = reward_weights(args.rewards)
    weights.setdefault(SOLVED_REWARD, 0.0)  # the solve rate is always computed
    funcs = reward_funcs(list(weights))
    checkpoint = args.model or (SERVED if args.serve else "bundled")
    result = evaluate(
        [checkpoint],
        prepared_tasks(args, "tasks probe"),
        rollout_settings(args),
        funcs,
        proxy=args.serve,
        serve_dir=args.run_dir / "serve",
        max_tokens=args.max_completion_length,
        temperature=args.temperature,
        serve_args=shlex.split(args.serve_args),
        on_progress=progress_printer(),
    )[0]
    model = served_model(args.serve) if checkpoint == SERVED else checkpoint
    probed_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    records: list[TaskDifficulty] = []
    skipped = []
    k = args.n
    for start in range(0, len(result.batch.outcomes), k):
        outcomes = result.batch.outcomes[start : start + k]
        # an infrastructure failure is unscorable, as in training: left out of the task's rates
        rewards = {
            name: [math.nan if o.unscorable else v for o, v in zip(outcomes, values[start:], strict=False)]
            for name, values in result.rewards.items()
        }
        task_id = result.batch.tasks[start].instance_id
        record = difficulty_from_rollouts(
            task_id, rewards, weights, [o.patch for o in outcomes], model=model, probed_at=probed_at
        )
        if record is None:
            skipped.append(task_id)
        else:
            records.append(record)
    for task_id in skipped:
        print(f"[aitlrt] {task_id}: every rollout failed outside the policy; not probed")
    if not records:
        print(f"[aitlrt] no task probed; {out} left as it was")
        return 1
    written = write_difficulty(out, records, merge=args.merge)
    print_difficulty(records)
    print(f"[aitlrt] {len(records)} tasks probed ({len(written)} in the sidecar): {out}")
    return 0


def print_difficulty(records: list[TaskDifficulty]) -> None:
    """A line per task and the count of each class."""
    width = max([len("task"), *(len(r.instance_id[:58]) for r in records)])
    print(f"\n{'task':<{width}} {'k':>3} {'solved':>6} {'edit':>5} {'reward':>7}  class")
    for r in records:
        print(
            f"{r.instance_id[:58]:<{width}} {r.k:>3} {r.solved_rate:>6.2f} {r.edit_rate:>5.2f} {r.reward_mean:>7.3f}"
            f"  {r.level}"
        )
    counts = Counter(r.level for r in records)
    print(
        f"always solved: {counts['solved']}, mixed: {counts['mixed']}, never solved: {counts['failed']} "
        f"(of {len(records)})"
    )

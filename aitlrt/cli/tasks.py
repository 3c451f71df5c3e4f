"""``aitlrt tasks``: generate bug-fix tasks offline, and check task files (load, then grade oracle and empty)."""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aitlrt.tasks.loader import load_tasks, parse_overrides
from aitlrt.tasks.sources import parse_source


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


def run(args: argparse.Namespace) -> int:
    try:
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

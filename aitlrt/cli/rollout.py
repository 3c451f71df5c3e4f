"""``aitlrt rollout``: run agents on tasks through a running ``aitlrt-serve``, without training
(``aitlrt.rollout.batch``), optionally scored with built-in rewards (``aitlrt.evaluation.scoring``).

Tasks: any file or dataset ``aitlrt.tasks.loader`` reads (SWE-bench, SWE-smith or aitlrt rows; a ``repo_path``
column names a local directory or git repository). Bad rows are reported with their line and id and skipped.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path

from aitlrt.rollout.arguments import RolloutArguments, RolloutSettings
from aitlrt.rollout.batch import PreparedTask, prepare_tasks, run_batch, write_outcomes
from aitlrt.rollout.runner import Progress, RolloutOutcome
from aitlrt.tasks.loader import load_tasks, parse_overrides


def rollout_flags() -> argparse.ArgumentParser:
    """A parent parser (``parents=[rollout_flags()]``) of the flags ``aitlrt rollout``, ``eval``, ``tasks probe``
    and ``trajectories`` share: the tasks, rollouts per task and seed, and every knob of ``RolloutArguments`` as
    ``aitlrt train`` reads it (transformers' ``HfArgumentParser``: ``--rollout_max_calls`` or
    ``--rollout-max-calls``, its aliases such as ``--max-calls``, the same default and help). A new one per
    command: a parent's actions are shared with its children, so one command's ``set_defaults`` would reach the
    others."""
    from transformers import HfArgumentParser

    # transformers annotates the dataclass types as NewType("DataClassType", Any), which no class is
    p = HfArgumentParser(RolloutArguments, add_help=False)  # type: ignore[arg-type]
    p.add_argument("--tasks", required=True, help="task file (JSON/JSONL/CSV/parquet) or Hub dataset name")
    p.add_argument("--source", action="append", default=[], help="ID_OR_REPO=SOURCE to override a task's repo")
    p.add_argument("--limit", type=int, default=None, help="use only the first N valid tasks")
    p.add_argument("--n", type=int, default=1, help="rollouts per task")
    p.add_argument(
        "--seed",
        type=seed_value,
        default=None,
        help="seeded sampling: the k-th rollout of a task samples the same tokens from the same weights in every run "
        "with this seed, so that two checkpoints' rollouts pair up ('none': unseeded; default: unseeded, 0 for eval)",
    )
    return p


def seed_value(text: str) -> int | None:
    """``--seed``: a non-negative integer or ``none``."""
    if text.lower() == "none":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a non-negative integer or 'none', not {text!r}")
    return int(text)


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "rollout",
        parents=[rollout_flags()],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="run agents on tasks via aitlrt-serve (no training), with a summary",
    )
    p.add_argument("--rewards", default="", help="comma-separated built-in rewards to score rollouts with")
    p.add_argument(
        "--proxy", default="http://127.0.0.1:8000", help="aitlrt-serve URL (its admin key in $AITLRT_API_KEY)"
    )
    p.add_argument("--model", default=None, help="served model name (default: the proxy's first)")
    p.add_argument("--out", type=Path, default=None, help="write outcomes with traces as JSON lines")


def reward_weights(spec: str) -> dict[str, float]:
    """``NAME[=WEIGHT],...`` → weights by name (1 when not given)."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, weight = item.partition("=")
        try:
            weights[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"bad reward weight in {item!r} (NAME or NAME=WEIGHT)") from None
    return weights


def rollout_settings(args: argparse.Namespace) -> RolloutSettings:
    """The batch settings of the parsed flags of ``rollout_flags``. Raises ``ValueError`` for a knob out of range or
    choice."""
    knobs = RolloutArguments(**{f.name: getattr(args, f.name) for f in fields(RolloutArguments)})
    return knobs.rollout_settings(args.n, args.seed)


def prepared_tasks(args: argparse.Namespace, verb: str) -> list[PreparedTask]:
    """The valid tasks of ``--tasks`` with their cached checkout; bad rows reported on stderr."""
    loaded = load_tasks(args.tasks, overrides=parse_overrides(args.source), limit=args.limit)
    for problem in loaded.problems:
        print(f"aitlrt {verb}: skipping bad row {problem}", file=sys.stderr)
    return prepare_tasks(loaded.require())


def progress_printer() -> Callable[[Progress], None]:
    """An ``on_progress`` callback: the progress line at most once a second, in place on a terminal."""
    last = [0.0]
    lock = threading.Lock()

    def show(progress: Progress) -> None:
        with lock:
            if time.monotonic() - last[0] > 1 or progress.done == progress.total:
                end = "\n" if progress.done == progress.total or not sys.stdout.isatty() else "\r"
                print(f"[aitlrt] {progress.line()}", end=end, flush=True)
                last[0] = time.monotonic()

    return show


def print_outcomes(outcomes: Sequence[RolloutOutcome]) -> None:
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


def print_rewards(outcomes: Sequence[RolloutOutcome], rewards: Mapping[str, Sequence[float]]) -> None:
    if not rewards:
        return
    print("\n" + f"{'rollout':<40}" + "".join(f" {n:>20}" for n in rewards))
    for i, o in enumerate(outcomes):
        print(f"{o.rollout_id[:40]:<40}" + "".join(f" {v[i]:>20.3f}" for v in rewards.values()))


def run(args: argparse.Namespace) -> None:
    from aitlrt.evaluation.scoring import reward_funcs, score_batch

    try:
        funcs = reward_funcs(args.rewards.split(",")) if args.rewards else {}
        settings = rollout_settings(args)
        prepared = prepared_tasks(args, "rollout")
    except ValueError as exc:  # unknown reward or agent, bad --source, no usable task
        raise SystemExit(f"aitlrt rollout: {exc}") from None
    batch = run_batch(prepared, args.proxy, settings, model=args.model, on_progress=progress_printer())
    print_outcomes(batch.outcomes)
    rewards = score_batch(funcs, batch)
    print_rewards(batch.outcomes, rewards)
    if args.out:
        write_outcomes(args.out, batch.outcomes, rewards)
        print(f"[aitlrt] outcomes and traces: {args.out}")

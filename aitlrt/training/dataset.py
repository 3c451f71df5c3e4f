"""The training dataset's rows: the tasks of ``--tasks`` (a file, a Hub dataset, or ``generate``: made offline once
from ``--generate_from`` and reused), each with its repository fetched and cached before training starts."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aitlrt.common.paths import aitlrt_home
from aitlrt.rollout.batch import prepare_tasks
from aitlrt.tasks.loader import load_tasks, parse_overrides, refuse_duplicates
from aitlrt.tasks.split import split_heldout, split_warm_start

if TYPE_CHECKING:
    from aitlrt.training.config import AgentScriptArguments

log = logging.getLogger(__name__)

GENERATED_TASKS_VERSION = 2
"""Bumped when generated tasks change (2: the oracle patch is git's diff of the fix): older caches are not reused."""


def generated_tasks(source: str, num_tasks: int | None, max_file_lines: int | None) -> Path:
    """The task file generated from ``source`` under ``$AITLRT_HOME/tasks``, topped up to ``num_tasks`` (default 8)
    valid tasks if it has fewer, unless a generation ran out of candidates before (the file then stays as it is, so
    that what is built from it, a cached warm start, stays the same)."""
    from aitlrt.tasks.generate import generate_tasks
    from aitlrt.tasks.sources import parse_source

    name = source.replace(":", "-").replace("/", "_").replace("==", "-")
    name += f"-max{max_file_lines}" if max_file_lines else ""
    name += f"-v{GENERATED_TASKS_VERSION}"
    path = aitlrt_home() / "tasks" / f"{name}.jsonl"
    want = num_tasks or 8
    have = len(path.read_text().splitlines()) if path.exists() else 0
    exhausted = path.with_name(path.name + ".exhausted")
    if have < want and not exhausted.exists():
        log.info("generating %d tasks from %s into %s", want - have, source, path)
        report = generate_tasks(
            parse_source(source), path, max_tasks=want - have, seed=have, max_file_lines=max_file_lines
        )
        if report.kept < want - have:
            log.info("%s gave %d tasks of the %d asked: no more candidates", source, have + report.kept, want)
            exhausted.write_text(f"{report.line()}\n")
    elif have < want:
        log.info("%s: %d tasks, all it gave (%s)", source, have, exhausted)
    return path


def load_task_rows(script: AgentScriptArguments) -> list[dict[str, Any]]:
    """One dataset row per usable task (``prompt`` plus ``Task.as_row``); bad rows and tasks whose repository
    cannot be fetched are logged and skipped. Raises ``TaskLoadError`` when no task is left."""
    spec = script.tasks
    if spec == "generate":
        spec = str(generated_tasks(script.generate_from, script.num_tasks, script.generate_max_file_lines))
    return _rows(spec, script.task_split, parse_overrides(script.task_source), script.num_tasks)


@dataclass
class RunTasks:
    """A run's task rows by use; no task is in both ``grpo`` and ``heldout``."""

    grpo: list[dict[str, Any]]
    """GRPO's: the training tasks of ``--tasks`` not kept for the warm start, then ``--grpo_from``'s."""
    heldout: list[dict[str, Any]] = field(default_factory=list)
    """``heldout_share`` of ``--tasks`` (``split_heldout``), then ``--heldout_from``'s: scored before and after
    training."""
    warm_start: list[dict[str, Any]] = field(default_factory=list)
    """The oracle warm start's: its ``warm_start_share`` of the training tasks, then ``--warm_start_from``'s."""


def run_tasks(script: AgentScriptArguments) -> RunTasks:
    """Load ``--tasks``, split off the held-out and the warm start's tasks and add the other sources' tasks.
    Raises ``TaskLoadError`` (no usable task, or one id twice among GRPO's or the warm start's tasks) or
    ``ValueError`` (a split that cannot be made)."""
    rows = load_task_rows(script)
    heldout: list[dict[str, Any]] = []
    if script.heldout_share > 0:
        rows, heldout = split_heldout(rows, script.heldout_share, script.heldout_files, script.heldout_seed)
        log.info("%d training tasks, %d held out", len(rows), len(heldout))
    if script.heldout_from:
        unseen = source_rows(script.heldout_from, script.heldout_from_tasks, script.generate_max_file_lines)
        heldout += unseen
        log.info("%d held-out tasks of heldout_from (a package nothing trains on)", len(unseen))
    warm: list[dict[str, Any]] = []
    warm_extra = source_rows(script.warm_start_from, script.warm_start_from_tasks, script.generate_max_file_lines)
    if script.warm_start != "none":
        warm, rows = split_warm_start(rows, script.warm_start_share, script.heldout_seed)
        if script.warm_start_share < 1 or warm_extra:
            log.info("warm start on %d training tasks and %d of warm_start_from", len(warm), len(warm_extra))
    grpo_extra = source_rows(script.grpo_from, script.grpo_from_tasks, script.generate_max_file_lines)
    log.info("GRPO on %d training tasks%s", len(rows), f" and {len(grpo_extra)} of grpo_from" if grpo_extra else "")
    leaked = {r["instance_id"] for r in heldout} & {r["instance_id"] for r in warm_extra + grpo_extra}
    if leaked:
        raise ValueError(
            f"{len(leaked)} held-out tasks ({', '.join(sorted(leaked)[:3])}, ...) are also tasks of warm_start_from "
            "or grpo_from: they would be trained on"
        )
    out = RunTasks(rows + grpo_extra, heldout, warm + warm_extra)
    for use, what in ((out.grpo, "GRPO's tasks (--tasks, grpo_from)"), (out.warm_start, "the warm start's tasks")):
        refuse_duplicates(((r["instance_id"], str(r.get("source", "?"))) for r in use), what)
    return out


def source_rows(sources: list[str], per_source: int, max_file_lines: int | None) -> list[dict[str, Any]]:
    """The tasks generated from each of ``sources`` (``per_source`` each, cached like ``--tasks generate``), rows
    like ``load_task_rows``'s: ``--warm_start_from``'s for the warm start, ``--grpo_from``'s for GRPO."""
    rows = []
    for source in sources:
        path = generated_tasks(source, per_source, max_file_lines)
        rows += _rows(str(path), "test", {}, per_source)
    return rows


def _rows(spec: str, split: str, overrides: dict[str, str], limit: int | None) -> list[dict[str, Any]]:
    loaded = load_tasks(spec, split=split, overrides=overrides, limit=limit)
    for problem in loaded.problems:
        log.warning("skipping bad task row: %s", problem)
    rows = [{"prompt": p.task.problem_statement, **p.task.as_row()} for p in prepare_tasks(loaded.require())]
    log.info("%d tasks from %s", len(rows), spec)
    return rows

"""Train / held-out splits of bug-fix tasks that measure generalisation: no mutated function in both, and whole
files that the training tasks never touch."""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

_IN_FUNCTION = re.compile(r" in ([\w.]+) \(line \d+\)")


def task_file(row: dict[str, Any]) -> str:
    """The file a task's bug is in: its first ``files`` entry, else the path before ``:`` in ``mutation``."""
    files = row.get("files") or []
    if files:
        return str(files[0])
    return str(row.get("mutation") or row["instance_id"]).partition(":")[0]


def task_function(row: dict[str, Any]) -> str:
    """``path:function`` of the mutated function (generated tasks), else the file (one unit per file)."""
    if row.get("function"):
        return str(row["function"])
    found = _IN_FUNCTION.search(str(row.get("mutation") or ""))
    return f"{task_file(row)}:{found.group(1)}" if found else task_file(row)


def split_heldout(
    rows: Sequence[dict[str, Any]],
    share: float,
    heldout_files: Sequence[str] = (),
    seed: int = 0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(train, heldout)``: every task of ``heldout_files`` (default: the file with the fewest tasks, so that at
    least one held-out file is never touched in training) is held out, then whole mutated functions, drawn with
    ``seed``, until about ``share`` of the tasks are; the rest train. Order within each part is kept."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"a held-out share must be in (0, 1), got {share}")
    by_file: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        by_file[task_file(row)].append(task_function(row))
    if len(by_file) < 2 and not heldout_files:
        raise ValueError("a held-out split needs tasks in at least two files (one is held out whole)")
    files = list(heldout_files) or [min(sorted(by_file), key=lambda f: len(by_file[f]))]
    unknown = [f for f in files if f not in by_file]
    if unknown:
        raise ValueError(f"held-out files {unknown} have no task (files with tasks: {sorted(by_file)})")
    held = _draw_functions(rows, {fn for f in files for fn in by_file[f]}, share, seed)
    train = [r for r in rows if task_function(r) not in held]
    heldout = [r for r in rows if task_function(r) in held]
    if not train:
        raise ValueError("the held-out split left no training task")
    return train, heldout


def split_warm_start(
    rows: Sequence[dict[str, Any]], share: float, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(warm_start, rl)``: whole mutated functions, drawn with ``seed``, until about ``share`` of the training tasks
    are the warm start's; RL gets the others, whose fixes the warm start has not seen. ``share`` 1: both get all;
    0: RL gets all, the warm start none (its tasks come from elsewhere: ``warm_start_from``)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"a warm-start share must be in [0, 1], got {share}")
    if share == 1.0:
        return list(rows), list(rows)
    if share == 0.0:
        return [], list(rows)
    if len({task_function(r) for r in rows}) < 2:
        raise ValueError("a warm-start split needs tasks of at least two mutated functions")
    warm = _draw_functions(rows, set(), max(share, 1 / len(rows)), seed)  # a tiny share: still one function
    return [r for r in rows if task_function(r) in warm], [r for r in rows if task_function(r) not in warm]


def _draw_functions(rows: Sequence[dict[str, Any]], held: set[str], share: float, seed: int) -> set[str]:
    """``held`` and whole mutated functions, shuffled with ``seed``, until about ``share`` of ``rows`` are in it;
    at least one function stays out."""
    counts: dict[str, int] = defaultdict(int)
    for row in rows:
        counts[task_function(row)] += 1
    others = sorted(fn for fn in counts if fn not in held)
    random.Random(seed).shuffle(others)
    target = round(share * len(rows))
    held = set(held)
    for fn in others:
        if sum(counts[f] for f in held) >= target or len(held) + 1 > len(counts) - 1:
            break
        held.add(fn)
    return held

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
    held = {fn for f in files for fn in by_file[f]}
    counts: dict[str, int] = defaultdict(int)
    for row in rows:
        counts[task_function(row)] += 1
    others = sorted(fn for fn in counts if fn not in held)
    random.Random(seed).shuffle(others)
    target = round(share * len(rows))
    for fn in others:
        if sum(counts[f] for f in held) >= target or len(held) + 1 > len(counts) - 1:
            break
        held.add(fn)
    train = [r for r in rows if task_function(r) not in held]
    heldout = [r for r in rows if task_function(r) in held]
    if not train:
        raise ValueError("the held-out split left no training task")
    return train, heldout

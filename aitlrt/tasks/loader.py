"""Load task rows from JSON, JSONL, CSV or parquet files, or a Hugging Face Hub dataset name.

Bad rows never stop a run silently: each is reported as a ``RowProblem`` with its line (or row) number and id,
and the caller decides (``aitlrt`` commands print them; training refuses to start with none left). Duplicate
instance ids are refused (``TaskLoadError``): grades, difficulty records and the trainer's tasks are keyed by id.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aitlrt.tasks.task import Task, TaskError, task_from_row


@dataclass(frozen=True)
class RowProblem:
    where: str
    """``file:line`` (or ``file:row N`` for parquet / Hub rows)."""
    instance_id: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where} (task {self.instance_id}): {self.reason}"


class TaskLoadError(ValueError):
    """No usable task could be loaded: a missing file, a bad override, or only bad rows (the message lists them)."""


@dataclass
class TaskSet:
    tasks: list[Task] = field(default_factory=list)
    problems: list[RowProblem] = field(default_factory=list)

    def require(self) -> list[Task]:
        """The tasks; an error listing every problem when there are none."""
        if not self.tasks:
            detail = "\n".join(f"  {p}" for p in self.problems[:20]) or "  (the source has no rows)"
            raise TaskLoadError(f"no usable task rows:\n{detail}")
        return self.tasks


def _rows(spec: str, split: str) -> Iterator[tuple[str, dict[str, Any] | Exception]]:
    """``(where, row or the error reading it)`` for every row of ``spec``."""
    path = Path(spec).expanduser()
    if not path.exists():
        if path.suffix in (".json", ".jsonl", ".csv", ".parquet") or "/" not in spec:
            raise TaskLoadError(f"task file {spec} does not exist")
        import datasets  # only users with network reach this

        for i, row in enumerate(datasets.load_dataset(spec, split=split)):
            yield f"{spec}[{split}] row {i}", row
        return
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
    elif path.suffix == ".csv":
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            for row in reader:
                yield f"{path}:{reader.line_num}", row
    elif path.suffix == ".json" and path.read_text().lstrip().startswith("["):
        for i, row in enumerate(json.loads(path.read_text())):
            yield f"{path}:item {i}", row
    else:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as exc:
                    yield f"{path}:{lineno}", exc


def load_tasks(
    spec: str | Path,
    *,
    split: str = "test",
    overrides: dict[str, str] | None = None,
    ids: set[str] | None = None,
    limit: int | None = None,
) -> TaskSet:
    """Every valid task in ``spec`` (a file or a Hub dataset name), with the bad rows listed.

    ``overrides`` maps an instance id or a repo name to a source (``pypi:marshmallow==2.20.0``) to use instead of
    the row's own, e.g. PyPI sdists standing in for GitHub repos offline. ``ids`` keeps only those instance ids.
    """
    out = TaskSet()
    places: list[tuple[str, str]] = []
    for where, row in _rows(str(spec), split):
        if isinstance(row, Exception):
            out.problems.append(RowProblem(where, "?", f"not JSON: {row}"))
            continue
        if not isinstance(row, dict):
            out.problems.append(RowProblem(where, "?", f"a row must be an object, got {type(row).__name__}"))
            continue
        if ids is not None and str(row.get("instance_id") or "").strip() not in ids:
            continue
        try:
            out.tasks.append(task_from_row(row, overrides))
            places.append((out.tasks[-1].instance_id, where))
        except TaskError as exc:
            out.problems.append(RowProblem(where, exc.instance_id, exc.reason))
        if limit is not None and len(out.tasks) >= limit:
            break
    refuse_duplicates(places, str(spec))
    return out


def refuse_duplicates(places: Iterable[tuple[str, str]], what: str) -> None:
    """``TaskLoadError`` naming the instance ids that occur more than once in ``what``; ``places``: each task's
    (instance id, where it comes from)."""
    found: dict[str, list[str]] = defaultdict(list)
    for instance_id, where in places:
        found[instance_id].append(where)
    repeated = {i: where for i, where in found.items() if len(where) > 1}
    if repeated:
        named = "; ".join(f"{i} ({', '.join(where)})" for i, where in list(repeated.items())[:10])
        raise TaskLoadError(
            f"{len(repeated)} duplicate instance_id(s) in {what}: {named}. Each task needs its own id (grades and "
            "the trainer's tasks are keyed by it)"
        )


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["ID_OR_REPO=SOURCE", ...]`` as a dict (the ``--source`` command-line form)."""
    pairs = [item.partition("=") for item in items]
    bad = [item for item, (_, sep, value) in zip(items, pairs, strict=True) if not sep or not value]
    if bad:
        raise TaskLoadError(f"--source takes ID_OR_REPO=SOURCE, got {bad}")
    return {key: value for key, _, value in pairs}

"""One task row, normalised: the SWE-bench schema plus where the repository comes from.

Accepted row forms:
- **SWE-bench**: ``instance_id, repo, base_commit, problem_statement, patch, test_patch, FAIL_TO_PASS,
  PASS_TO_PASS, version`` (the test lists as JSON strings or lists); the repository is
  ``git:https://github.com/<repo>.git@<base_commit>`` unless a ``source`` column or an override says otherwise.
- **SWE-smith**: ``bug_patch`` + ``pypi_sdist`` (or ``source``); the base is the source with the bug patch
  committed on top, the oracle ``patch`` is its reverse, and the problem statement names the failing tests.
- **aitlrt**: any of the above with ``source`` (``git:URL@SHA``, ``pypi:NAME==VER``, ``local:PATH[@REV]``),
  ``setup_patch``, ``env`` (a test-environment spec) and ``files`` (paths to open for the agent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aitlrt.tasks import patches
from aitlrt.tasks.sources import Source, materialise, parse_source, with_patch

TEXT_COLUMNS = (
    "problem_statement",
    "patch",
    "test_patch",
    "setup_patch",
    "bug_patch",
    "source",
    "repo",
    "repo_path",
    "repo_url",
    "pypi_sdist",
    "base_commit",
    "upstream",
)
"""Columns that must be strings when present (None counts as absent)."""
PROBLEM_TEMPLATE = (
    "The test suite of this repository has failing tests:\n{tests}\n\n"
    "Find the bug in the library code and fix it so that these tests pass, without breaking any other test. "
    "Do not change the tests."
)


class TaskError(ValueError):
    """A row that cannot become a task; carries the row's id."""

    def __init__(self, instance_id: str, reason: str):
        super().__init__(f"task {instance_id}: {reason}")
        self.instance_id = instance_id
        self.reason = reason


@dataclass(frozen=True)
class Task:
    instance_id: str
    problem_statement: str
    source: Source
    setup_patch: str = ""
    """Committed on top of the source's base to make the task's starting point (SWE-smith's bug patch)."""
    patch: str = ""
    """The oracle fix."""
    test_patch: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    repo: str = ""
    version: str = ""
    env: dict[str, Any] | None = None
    files: tuple[str, ...] = ()
    row: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The original row: every column reaches the reward functions."""

    def as_row(self) -> dict[str, Any]:
        """The task as a dataset row (trl hands every column to the reward functions): the original columns
        plus the resolved source, setup patch, oracle and test lists, so ``task_from_row`` rebuilds this task."""
        return {
            **self.row,
            "instance_id": self.instance_id,
            "problem_statement": self.problem_statement,
            "source": str(self.source),
            "setup_patch": self.setup_patch,
            "patch": self.patch,
            "test_patch": self.test_patch,
            "FAIL_TO_PASS": list(self.fail_to_pass),
            "PASS_TO_PASS": list(self.pass_to_pass),
            "repo": self.repo,
            "version": self.version,
            "env": json.dumps(self.env) if self.env else "",
            "files": list(self.files),
        }

    def checkout(self) -> tuple[Path, str]:
        """The cached repository and the commit the agent starts from (materialised on first use)."""
        repo, base = materialise(self.source)
        return repo, with_patch(repo, base, self.setup_patch)


def _check_types(row: dict[str, Any]) -> None:
    """ValueError naming the first column of ``row`` whose type is wrong (``TEXT_COLUMNS``, ``version``)."""
    for name in TEXT_COLUMNS:
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if not isinstance(row.get("version"), str | int | float | None):
        raise ValueError(f"version must be a string or a number, got {type(row['version']).__name__}")


def _json_column(value: Any, name: str, kinds: type | tuple[type, ...], what: str) -> Any:
    """A column given as one of ``kinds`` (``what``, in an error) or as JSON text of one (empty: None)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = json.loads(value)  # a JSONDecodeError is a ValueError: reported with the row
    if not isinstance(value, kinds):
        raise ValueError(f"{name} must be {what} (or JSON text of one), got {type(value).__name__}")
    return value


def _tests(value: Any, name: str) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is neither a list nor a JSON list: {exc}") from None
    if not isinstance(value, list | tuple) or not all(isinstance(t, str) for t in value):
        got = type(value).__name__ if not isinstance(value, list | tuple) else "a list holding other than strings"
        raise ValueError(f"{name} must be a list of test ids (strings), got {got}")
    return tuple(value)


def _source(row: dict[str, Any], overrides: dict[str, str]) -> Source:
    override = overrides.get(row["instance_id"]) or overrides.get(row.get("repo", ""))
    if override or row.get("source"):
        return parse_source(override or row["source"])
    if row.get("repo_path"):
        return Source("local", str(Path(row["repo_path"]).expanduser().resolve()), row.get("base_commit") or "")
    if row.get("pypi_sdist"):
        return parse_source(f"pypi:{row['pypi_sdist']}")
    url = row.get("repo_url") or (f"https://github.com/{row['repo']}.git" if row.get("repo") else "")
    if url and row.get("base_commit"):
        return parse_source(f"git:{url}@{row['base_commit']}")
    raise ValueError("no repository source: give source, repo_path, pypi_sdist, or repo/repo_url with base_commit")


def task_from_row(row: dict[str, Any], overrides: dict[str, str] | None = None) -> Task:
    """Normalise one row (SWE-bench, SWE-smith or aitlrt form); raises TaskError naming the row's id."""
    raw_id = row.get("instance_id")
    if not isinstance(raw_id, str | int | None):
        raise TaskError(repr(raw_id)[:60], f"instance_id must be a string, got {type(raw_id).__name__}")
    instance_id = str(raw_id or "").strip()
    if not instance_id:
        raise TaskError("?", "missing instance_id")
    try:
        _check_types(row)
        f2p = _tests(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS")
        p2p = _tests(row.get("PASS_TO_PASS"), "PASS_TO_PASS")
        setup = row.get("setup_patch") or row.get("bug_patch") or ""
        oracle = row.get("patch") or (patches.reverse(row["bug_patch"]) if row.get("bug_patch") else "")
        statement = row.get("problem_statement") or ""
        if not statement and f2p:
            statement = PROBLEM_TEMPLATE.format(tests="\n".join(f"- {t}" for t in f2p[:5]))
        if not statement.strip():
            raise ValueError("no problem_statement and no FAIL_TO_PASS to write one from")
        env = _json_column(row.get("env"), "env", dict, "an object") or None
        files = _json_column(row.get("files"), "files", (list, tuple), "a list") or ()
        if not all(isinstance(f, str) for f in files):
            raise ValueError("files must be a list of paths (strings)")
        version = str(row.get("version") or "") or (row["pypi_sdist"].split("==")[-1] if row.get("pypi_sdist") else "")
        return Task(
            instance_id=instance_id,
            problem_statement=statement,
            source=_source(row, overrides or {}),
            setup_patch=setup,
            patch=oracle,
            test_patch=row.get("test_patch") or "",
            fail_to_pass=f2p,
            pass_to_pass=p2p,
            repo=row.get("upstream") or row.get("repo") or "",
            version=version,
            env=env,
            files=tuple(files),
            row=dict(row),
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise TaskError(instance_id, str(exc)) from None

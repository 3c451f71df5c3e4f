"""Offline task generation on a real PyPI sdist (cachetools), through the real CLI, then re-validated."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from aitlrt.common.git import git
from aitlrt.common.workspace import workspace
from aitlrt.tasks.generate import library_files
from aitlrt.tasks.sources import materialise, parse_source
from tests.conftest import cachetools_tasks

SOURCE = "pypi:cachetools==8.0.1"


def aitlrt(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aitlrt.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_generated_tasks_are_valid_bug_fix_tasks(tmp_path):
    out = tmp_path / "tasks.jsonl"
    made = aitlrt("tasks", "generate", "--from", SOURCE, "--out", str(out), "--max-tasks", "4", "--seed", "1")
    assert made.returncode == 0, made.stdout + made.stderr
    assert "task 4/4" in made.stdout and "4 tasks appended" in made.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and len({r["instance_id"] for r in rows}) == 4
    repo, base = materialise(parse_source(SOURCE))
    library = set(library_files(repo, base))
    for row in rows:
        assert row["source"] == SOURCE
        # The oracle is git's own diff from the bug back to the source: what an agent's exact fix gives.
        with workspace(repo, base) as ws:
            touched_file = row["files"][0]
            original = (ws.repo / touched_file).read_text()
            git("apply", "-", cwd=ws.repo, input=row["setup_patch"])
            git("add", "-A", cwd=ws.repo)
            (ws.repo / touched_file).write_text(original)
            assert git("diff", cwd=ws.repo) == row["patch"]
        assert row["FAIL_TO_PASS"] and row["PASS_TO_PASS"]
        assert not set(row["FAIL_TO_PASS"]) & set(row["PASS_TO_PASS"])
        touched = row["setup_patch"].split("\n", 1)[0].split(" b/")[-1]
        assert touched in library and not touched.startswith("tests/")
        assert row["FAIL_TO_PASS"][0] in row["problem_statement"]
    # Every emitted task re-validates: its oracle fixes it, and without it FAIL_TO_PASS fails.
    checked = aitlrt("tasks", "check", str(out))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "4 valid, 0 invalid" in checked.stdout


def test_generation_reports_a_source_whose_suite_does_not_pass(tmp_path):
    lib = tmp_path / "lib"
    (lib / "tests").mkdir(parents=True)
    (lib / "mini.py").write_text("def inc(x):\n    return x + 1\n")
    (lib / "tests" / "test_mini.py").write_text("from mini import inc\n\ndef test_inc():\n    assert inc(1) == 3\n")
    made = aitlrt("tasks", "generate", "--from", str(lib), "--out", str(tmp_path / "t.jsonl"))
    assert made.returncode != 0 and "does not pass at its base" in made.stderr


def test_source_rows_are_the_generated_tasks_of_each_source():
    from aitlrt.training.dataset import source_rows

    rows = source_rows(["pypi:cachetools==8.0.1"], 2, 200)
    cached = [json.loads(line) for line in cachetools_tasks(2).read_text().splitlines()]
    assert [r["instance_id"] for r in rows] == [c["instance_id"] for c in cached[:2]]
    assert [r["prompt"] for r in rows] == [c["problem_statement"] for c in cached[:2]]
    assert all(r["patch"] and r["FAIL_TO_PASS"] for r in rows)


HOOK = """import sys


class Finder:
    def find_spec(self, name, path=None, target=None):
        return None


def install():
    if not any(isinstance(f, Finder) for f in sys.meta_path):
        sys.meta_path.append(Finder())


def double(x):
    if x < 0:
        return -2 * abs(x)
    return x * 2
"""


def test_a_mutation_whose_oracle_the_grader_does_not_resolve_is_dropped(tmp_path):
    """The library installs an import hook at import (as toolz's ``tlz`` does): the grader takes a hook from a file
    the patch changed for tampering, so a bug in the hook's own file has an oracle no policy could pass."""
    lib = tmp_path / "lib"
    (lib / "mini").mkdir(parents=True)
    (lib / "tests").mkdir()
    (lib / "mini" / "__init__.py").write_text("from mini._hook import install\n\ninstall()\n")
    (lib / "mini" / "_hook.py").write_text(HOOK)
    (lib / "mini" / "core.py").write_text("def inc(x):\n    if x > 100:\n        return x\n    return x + 1\n")
    (lib / "tests" / "test_mini.py").write_text(
        "from mini._hook import double\nfrom mini.core import inc\n\n\n"
        "def test_inc():\n    assert inc(1) == 2 and inc(200) == 200\n\n\n"
        "def test_double():\n    assert double(3) == 6 and double(-1) == -2\n\n\n"
        "def test_other():\n    assert True\n"
    )
    out = tmp_path / "t.jsonl"
    made = aitlrt("tasks", "generate", "--from", str(lib), "--out", str(out), "--max-tasks", "10")
    assert made.returncode == 0, made.stdout + made.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(row["files"] == ["mini/core.py"] for row in rows), [r["files"] for r in rows]
    said = made.stderr + made.stdout
    assert "dropped" in said and "sys.meta_path gained Finder" in said
    assert int(re.search(r"oracle fix not resolved by the grader (\d+)", said).group(1)) >= 1

"""Patch text utilities and SWE-RL similarity: hand-checked cases, and reversal checked by real git."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aitlrt.common.git import git
from aitlrt.tasks.patches import changed_paths, normalised_files, reverse, similarity

A = """diff --git a/pkg/a.py b/pkg/a.py
index 1111111..2222222 100644
--- a/pkg/a.py
+++ b/pkg/a.py
@@ -1,3 +1,3 @@ def f():
 def f(x):
-    return x + 1
+    return x - 1
 print(f(1))
"""
B = """diff --git a/pkg/b.py b/pkg/b.py
--- a/pkg/b.py
+++ b/pkg/b.py
@@ -10,3 +10,3 @@
 y = 2
-z = 3
+z = 4
 w = 5
"""


def test_identical_and_empty_patches():
    assert similarity(A, A) == 1.0
    assert similarity("", "") == 1.0  # both empty: SWE-RL's 1.0
    assert similarity(A, "") == 0.0 and similarity("", A) == 0.0


def test_disjoint_files_score_zero_and_union_is_averaged():
    assert similarity(A, B) == 0.0
    # Predicted touches a.py exactly and also b.py; oracle only a.py: mean over the union {a: 1, b: 0}.
    assert similarity(A + B, A) == pytest.approx(0.5)


def test_partial_edit_is_between_and_ordered():
    near = A.replace("return x - 1", "return x - 2")
    far = A.replace("return x - 1", "raise NotImplementedError('not today')")
    s_near, s_far = similarity(near, A), similarity(far, A)
    assert 0.0 < s_far < s_near < 1.0


def test_whitespace_and_git_context_are_normalised():
    noisy = A.replace("    return x - 1\n", "    return x - 1   \r\n").replace("@@ def f():", "@@ class Other:")
    noisy = noisy.replace("index 1111111..2222222 100644\n", "")
    assert similarity(noisy, A) == 1.0
    assert normalised_files(A)["pkg/a.py"].splitlines()[0] == "@@ -1,3 +1,3 @@"


def test_removed_line_that_looks_like_a_header_stays_in_its_hunk():
    tricky = """--- a/notes.txt
+++ b/notes.txt
@@ -1,2 +1,2 @@
--- old rule
+++ new rule
 keep
"""
    assert changed_paths(tricky) == ["notes.txt"]
    assert normalised_files(tricky)["notes.txt"].splitlines()[1:] == ["--- old rule", "+++ new rule", " keep"]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f(x):\n    return x + 1\n\n\nprint(f(1))\n")
    (tmp_path / "pkg" / "old.py").write_text("gone = True\n")
    git("init", "-q", cwd=tmp_path)
    git("add", "-A", cwd=tmp_path)
    git("commit", "-qm", "base", cwd=tmp_path)
    return tmp_path


def test_reverse_undoes_a_real_git_patch_with_new_and_deleted_files(repo: Path):
    (repo / "pkg" / "a.py").write_text("def f(x):\n    return x - 1\n\n\nprint(f(2))")  # no final newline
    (repo / "pkg" / "new.py").write_text("fresh = 1\n")
    (repo / "pkg" / "old.py").unlink()
    git("add", "-A", cwd=repo)
    forward = git("diff", "--cached", cwd=repo)
    git("commit", "-qm", "change", cwd=repo)
    back = reverse(forward)
    assert reverse(back) == forward
    subprocess.run(["git", "apply", "-"], cwd=repo, input=back, text=True, check=True)
    git("add", "-A", cwd=repo)
    assert git("diff", "--cached", "HEAD~1", cwd=repo) == ""  # the tree is the base again


def test_reverse_round_trips_every_real_task_patch(data_dir: Path):
    rows = [json.loads(line) for line in (data_dir / "swesmith_webargs" / "tasks.jsonl").open()]
    rows += [json.loads(line) for line in (data_dir / "swebench_lite" / "dev.jsonl").open()]
    for row in rows:
        patch = row.get("bug_patch") or row["patch"]
        assert reverse(reverse(patch)) == patch, row["instance_id"]
        assert set(changed_paths(patch)) == set(normalised_files(patch)), row["instance_id"]

"""Patch text utilities and SWE-RL similarity: hand-checked cases, and reversal checked by real git."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aitlrt.common.git import git
from aitlrt.tasks.patches import (
    changed_base_lines,
    changed_lines,
    changed_lines_overlap,
    changed_lines_similarity,
    changed_paths,
    normalised_files,
    reverse,
    shares_changed_line,
    similarity,
)

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


FIX = """diff --git a/pkg/c.py b/pkg/c.py
--- a/pkg/c.py
+++ b/pkg/c.py
@@ -3,5 +3,5 @@ def g(key):
     if key is None:
         return 0
-    if key > 10:
+    if key >= 10:
         return 1
     return 2
"""


def _edit(old: str, new: str, start: int = 5) -> str:
    """A one-hunk patch of ``pkg/c.py`` that replaces line ``start`` (``old``, indented) by ``new``'s lines."""
    added = "".join(f"+{line}\n" for line in new.splitlines())
    return f"--- a/pkg/c.py\n+++ b/pkg/c.py\n@@ -{start},1 +{start},{len(new.splitlines())} @@\n-{old}\n{added}"


def test_changed_lines_similarity_scores_the_exact_fix_1_and_no_effective_change_0():
    buggy = "    if key > 10:"
    assert changed_lines_similarity(FIX, FIX) == 1.0
    assert changed_lines_similarity(_edit(buggy, "    if key >= 10:"), FIX) == 1.0  # context is no part of it
    assert changed_lines_similarity(_edit(buggy, "    if  key  >=  10:  # the fix"), FIX) == 1.0
    assert changed_lines_similarity(_edit(buggy, buggy + "  # the bug is here"), FIX) == 0.0  # a comment
    assert changed_lines_similarity(_edit(buggy, buggy + "   "), FIX) == 0.0  # whitespace
    assert changed_lines_similarity(_edit(buggy, "    # look here\n" + buggy + "\n"), FIX) == 0.0  # a comment line
    assert changed_lines_similarity("", FIX) == changed_lines_similarity("", "") == 0.0
    assert similarity(_edit(buggy, buggy + "  # the bug is here"), FIX) > 0.5, "SWE-RL's form pays the context"
    near = changed_lines_similarity(_edit(buggy, "    if key >= 11:"), FIX)
    far = changed_lines_similarity(_edit(buggy, "    raise NotImplementedError"), FIX)
    assert 0.0 < far < near < 1.0
    assert changed_lines_similarity(FIX + B, FIX) == pytest.approx(0.5), "a file the oracle leaves scores 0"


def test_changed_lines_overlap_pays_the_fix_line_for_line_and_no_line_that_only_looks_like_it():
    buggy = "    if key > 10:"
    assert changed_lines_overlap(FIX, FIX) == 1.0
    assert changed_lines_overlap(_edit(buggy, "    if  key  >=  10:  # the fix"), FIX) == 1.0
    for trivial in (buggy + "  # the bug is here", buggy + "   ", "    # look here\n" + buggy + "\n"):
        assert changed_lines_overlap(_edit(buggy, trivial), FIX) == 0.0  # a comment, whitespace
    assert changed_lines_overlap("", FIX) == changed_lines_overlap("", "") == 0.0
    # a line added beside the bug that shares characters with the fix: paid by the character ratio, not here
    beside = _edit(buggy, buggy + "\n    pass")
    assert changed_lines_similarity(beside, FIX) > 0.05
    assert changed_lines_overlap(beside, FIX) == 0.0
    # a wrong change of the buggy line: its removed line is the fix's (1 of 2 lines each side)
    assert changed_lines_overlap(_edit(buggy, "    if key >= 11:"), FIX) == pytest.approx(0.5)
    # the fix's added line beside the bug kept: 1 of its 1 line, 1 of the fix's 2
    assert changed_lines_overlap(_edit(buggy, buggy + "\n    if key >= 10:"), FIX) == pytest.approx(2 / 3)
    assert changed_lines_overlap(FIX + B, FIX) == pytest.approx(0.5), "a file the oracle leaves scores 0"


def test_a_hash_in_a_string_and_a_python_reindent_are_changes_a_comment_elsewhere_is_not():
    assert changed_lines(_edit('    s = "a"', '    s = "a # b"')) == {"pkg/c.py": '-s = "a"\n+s = "a # b"'}
    assert changed_lines(_edit("    return 2", "        return 2")) == {"pkg/c.py": "-return 2\n+return 2"}
    assert changed_lines(_edit("    f(a,", "    f(a,  # why")) == {}  # an open bracket: the comment still found
    txt = "--- a/notes.txt\n+++ b/notes.txt\n@@ -1 +1 @@\n-x\n+x  # note\n"
    assert changed_lines(txt) == {"notes.txt": "-x\n+x # note"}, "a '#' is text outside Python files"


def test_lines_moved_across_context_are_a_change():
    moved = """--- a/m.py
+++ b/m.py
@@ -4,3 +4,3 @@
-    a = 1
-else:
     b = 2
+else:
+    a = 1
"""
    assert changed_lines(moved) == {"m.py": "-a = 1\n-else:\n+else:\n+a = 1"}
    assert changed_base_lines(moved) == {"m.py": {4, 5, 6, 7}}, "lines 4, 5; an insertion between 6 and 7"


def test_changed_base_lines_are_the_effective_removed_lines_or_an_insertions_neighbours():
    assert changed_base_lines(FIX) == {"pkg/c.py": {5}}
    assert changed_base_lines(_edit("    if key > 10:", "    if key > 10:  # here")) == {}
    inserted = "--- a/m.py\n+++ b/m.py\n@@ -7,0 +8,2 @@\n+    if x is None:\n+        return\n"
    assert changed_base_lines(inserted) == {"m.py": {7, 8}}, "between lines 7 and 8"
    at_top = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,3 @@\n+import os\n x = 1\n y = 2\n"
    assert changed_base_lines(at_top) == {"m.py": {1}}
    # a run whose removed line comes back as it was, with a line added: an insertion around the line kept
    kept = "--- a/m.py\n+++ b/m.py\n@@ -3,3 +3,4 @@\n a\n-b\n+b\n+c\n d\n"
    assert changed_base_lines(kept) == {"m.py": {3, 4, 5}}
    assert changed_base_lines(B) == {"pkg/b.py": {11}}
    appended = "--- a/m.py\n+++ b/m.py\n@@ -9,0 +10 @@\n+# reviewed\n"  # a comment appended: no change
    assert changed_base_lines(appended) == {}
    assert shares_changed_line(FIX, FIX) == 1.0 and shares_changed_line(inserted, FIX) == 0.0
    assert shares_changed_line(_edit("    return 1", "    return 3", start=6), FIX) == 0.0, "the next line"

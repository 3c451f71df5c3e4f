"""The reward terms are pure functions of what a rollout left (its grade, its last answer, its finish reasons, the
task's files): scored here on strings and grades, with no task, repository or sandbox. Aider's edit format is read
and written by one module, so the oracle's blocks read back as the rewards read them, and the rollout statuses
have one owner."""

from __future__ import annotations

import difflib
import math
from typing import get_args

import pytest

from aitlrt.rewards import terms
from aitlrt.rollout.agents.edit_format import DIVIDER, REPLACE, SEARCH, edit_blocks, is_marker
from aitlrt.rollout.status import (
    GRADER_FAILURES,
    STATUSES,
    Status,
    agent_failed,
    grader_failed,
    infrastructure_failure,
)
from aitlrt.tasks.grading import Grade
from aitlrt.tasks.patches import created_paths
from aitlrt.warmstart.oracle import edit_block, search_replace

FILE = "def f(a):\n    if a:\n        return 1\n    return 2\n"


def test_a_block_the_oracle_writes_reads_back_as_its_search_and_replace_texts():
    before, after = FILE, FILE.replace("return 1", "return 3")
    (pair,) = search_replace(before, after, "m.py")
    answer = "Fixed it:\n\n" + edit_block("m.py", *pair) + "\nDone."
    assert edit_blocks(answer) == [pair]
    assert edit_blocks(answer.replace(SEARCH, "<<<<< SEARCH>").replace(REPLACE, ">>>>>>>>> REPLACE")) == [pair]
    assert edit_blocks(answer.split(DIVIDER)[0]) == []  # cut after SEARCH: no block
    assert edit_blocks(answer.replace(REPLACE, REPLACE + ">")) == []  # Aider's UPDATED line takes no stray ">"
    assert all(is_marker(line) for line in (SEARCH, f"  {DIVIDER}  ", REPLACE, "<<<<<<<<< SEARCH>"))
    assert not any(is_marker(line) for line in ("<<<< SEARCH", "== x", "# ======= REPLACE"))


def test_the_format_terms_pay_a_whole_block_that_changes_code_and_anchors_in_the_file():
    change = edit_block("m.py", "        return 1\n", "        return 3\n")
    comment = edit_block("m.py", "        return 1\n", "        return 1  # here\n")
    made_up = edit_block("m.py", "    if key is None:\n", "    if key:\n")
    cut = "m.py\n```python\n<<<<<<< SEARCH\n```\n"
    assert [terms.well_formed_edit(a) for a in (change, comment, cut, "")] == [1.0, 1.0, 0.0, 0.0]
    assert [terms.well_formed_change(a) for a in (change, comment, made_up, cut)] == [1.0, 0.0, 1.0, 0.0]
    assert [terms.anchored_change(a, [FILE]) for a in (change, comment, made_up)] == [1.0, 0.0, 0.0]
    assert terms.anchored_change(change, []) == 0.0, "no file to anchor in"
    half = edit_block("m.py", "    if a:\n    if b:\n", "    pass\n")
    assert terms.anchored_change(half, ["x = 1\n", FILE]) == 0.5, "the best file counts"
    assert terms.found_share("", FILE) == 0.0, "an empty SEARCH anchors nothing"


def test_an_answer_cut_at_the_token_cap_is_not_finished():
    assert terms.finished_answers(["stop", "stop"]) == 1.0
    assert terms.finished_answers(["stop", "length"]) == 0.0
    assert terms.finished_answers([]) == 0.0, "no answer: nothing to pay"


@pytest.mark.parametrize("status", GRADER_FAILURES)
def test_a_grade_failed_on_the_graders_side_is_unscorable_for_every_graded_term(status):
    g = Grade(status, reason="the grader broke")
    values = [
        terms.tests_pass(g),
        terms.tests_pass_fraction(g),
        terms.unbroken(1.0, g),
        terms.keeps_pass_to_pass("diff", g),
        terms.edit_tests_pass_fraction(True, g),
    ]
    assert all(math.isnan(v) for v in values)
    assert terms.keeps_pass_to_pass("", g) == terms.edit_tests_pass_fraction(False, g) == 0.0, "no edit: 0"


def test_the_graded_terms_on_the_patchs_own_results():
    fixed, broke, slow = Grade("resolved", 1, 1, 3, 3), Grade("unresolved", 1, 1, 2, 3), Grade("timeout", 0, 1, 0, 3)
    assert [terms.tests_pass(g) for g in (fixed, broke, slow)] == [1.0, 0.0, 0.0]  # a test timeout: the patch's
    assert [terms.tests_pass_fraction(g) for g in (fixed, broke, slow)] == [1.0, 0.75, 0.0]
    assert [terms.unbroken(0.4, g) for g in (fixed, broke, slow)] == [0.4, 0.0, 0.0]
    assert [terms.keeps_pass_to_pass("diff", g) for g in (fixed, broke, slow)] == [1.0, 0.0, 0.0]
    assert terms.non_empty_patch("diff", True) == 1.0
    assert terms.non_empty_patch(" \n", True) == terms.non_empty_patch("diff", False) == 0.0


def test_the_rollout_statuses_have_one_owner():
    assert STATUSES == get_args(Status) == ("ok", "no_patch", "timeout", "call_limit", "agent_error", "crashed")
    assert [s for s in STATUSES if agent_failed(s)] == ["timeout", "agent_error", "crashed"]
    assert not agent_failed(None), "a row without a status was not a failed rollout"
    assert infrastructure_failure("agent_error", 3) and infrastructure_failure("crashed", 0)
    assert not infrastructure_failure("crashed", 1) and not infrastructure_failure("timeout", 0)
    assert grader_failed("env_failed") and not grader_failed("timeout") and not grader_failed("agent_failed")


def _diff(path: str, before: str, after: str) -> str:
    """A unified diff of one file (``before`` empty: the file is created)."""
    old = "/dev/null" if not before else f"a/{path}"
    lines = difflib.unified_diff(before.splitlines(True), after.splitlines(True), old, f"b/{path}")
    return "".join(lines)


def test_a_code_edit_changes_code_of_a_module_the_repository_has_and_nothing_else_is_one():
    fix = _diff("pkg/m.py", FILE, FILE.replace("return 1", "return 3"))
    tests = ["tests/test_m.py"]
    assert terms.code_paths(fix, tests) == ["pkg/m.py"] and terms.code_edit(fix, True, tests) == 1.0
    assert terms.code_edit(fix, False, tests) == 0.0, "a patch that does not apply changes nothing"
    no_code = {
        "comment": _diff("pkg/m.py", FILE, FILE + "# reviewed\n"),
        "whitespace": _diff("pkg/m.py", FILE, FILE.replace("return 2", "return 2  ")),
        "reject file": _diff("pkg/m.py.rej", "", "--- m.py\n+++ m.py\n@@ -4 +4,2 @@\n return 2\n+# reviewed\n"),
        "new module": _diff("pkg/extra.py", "", "x = 1\n"),
        "test file": _diff("tests/test_m.py", "def test_f():\n    assert 0\n", "def test_f():\n    assert 1\n"),
        "conftest": _diff("conftest.py", "x = 1\n", "x = 2\n"),
        "not Python": _diff("README.md", "m\n", "m, fixed\n"),
        "empty": "",
    }
    for name, patch in no_code.items():
        assert terms.code_edit(patch, True, tests) == 0.0, name
    assert terms.code_edit(fix + no_code["reject file"], True, tests) == 1.0, "a fix beside a reject file"
    assert created_paths(no_code["reject file"]) == {"pkg/m.py.rej"} and not created_paths(fix)

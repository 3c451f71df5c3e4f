"""The format terms (``well_formed_edit``, ``well_formed_change``, ``anchored_change``) and ``finished_answers``,
read from the model's answers and finish reasons that ``reward_row`` carries."""

from __future__ import annotations

from typing import Any

from aitlrt.common.git import git
from aitlrt.rewards.builtin import anchored_change, finished_answers, well_formed_change, well_formed_edit
from aitlrt.rewards.inputs import reward_row, score
from aitlrt.rollout.runner import RolloutOutcome
from aitlrt.rollout.status import Status
from aitlrt.tasks.task import task_from_row
from aitlrt.warmstart.oracle import edit_block


def _outcome(status: Status, *answers: str | None) -> RolloutOutcome:
    """A rollout whose recorded calls answered ``answers`` (None: a call the proxy refused, with no message)."""
    trace: list[dict[str, Any]] = [
        {"request": {}} | ({"message": {"role": "assistant", "content": a}} if a is not None else {}) for a in answers
    ]
    return RolloutOutcome("r", "t", status, "", "", len(answers), 0, 10, "", trace=trace)


def test_a_whole_block_scores_1_matched_or_not_and_a_cut_or_missing_one_0():
    block = edit_block("src/pkg/mod.py", "    return a\n", "    return b\n")
    identity = edit_block("src/pkg/mod.py", "class A:\n", "class A:\n")
    cases = [
        (_outcome("ok", block), 1.0),
        (_outcome("no_patch", identity), 1.0),  # matched, changes nothing: well-formed all the same
        (_outcome("call_limit", block, None), 1.0),  # the refused retry leaves no answer: the last answer counts
        (_outcome("call_limit", "src/pkg/mod.py\n```python\n<<<<<<< SEARCH\n```\n"), 0.0),  # GRPO's collapse
        (_outcome("no_patch", "The bug is in `mod.py`: return b instead."), 0.0),
        (_outcome("call_limit", "```\n<<<<<<< SEARCH\nx = 1\n=======\nx = 2\n```\n"), 0.0),  # no REPLACE marker
        (_outcome("ok", "no block", block), 1.0),
        (_outcome("crashed", block), 0.0),  # a failed rollout scores 0 everywhere
        (_outcome("no_patch"), 0.0),  # no answered call
    ]
    rows = [reward_row({"instance_id": "t"}, None, o) for o, _ in cases]
    assert rows[2]["rollout_answers"] == [block]
    assert score({"well_formed_edit": well_formed_edit}, rows)["well_formed_edit"] == [want for _, want in cases]


def test_a_change_scores_1_and_an_identity_edit_scores_with_a_cut_block():
    block = edit_block("src/pkg/mod.py", "    return a\n", "    return b\n")
    identity = edit_block("src/pkg/mod.py", "class A:\n", "class A:\n")
    spaced = edit_block("src/pkg/mod.py", "x = 1\n", "x  =  1 \n")  # differs only in whitespace
    empty_search = edit_block("src/pkg/new.py", "", "x = 1\n")  # Aider's way to write a new file
    cases = [
        (_outcome("ok", block), 1.0),
        (_outcome("no_patch", identity), 0.0),
        (_outcome("ok", spaced), 0.0),
        (_outcome("ok", empty_search), 1.0),
        (_outcome("ok", identity + block), 1.0),  # one block of two changes something
        (_outcome("call_limit", "src/pkg/mod.py\n```python\n<<<<<<< SEARCH\n```\n"), 0.0),
        (_outcome("crashed", block), 0.0),
        (_outcome("ok", block, identity), 0.0),  # the last answer counts
    ]
    rows = [reward_row({"instance_id": "t"}, None, o) for o, _ in cases]
    got = score({"well_formed_change": well_formed_change, "well_formed_edit": well_formed_edit}, rows)
    assert got["well_formed_change"] == [want for _, want in cases]
    assert got["well_formed_edit"] == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_an_anchored_change_is_paid_by_the_share_of_its_search_lines_the_file_holds(tmp_path):
    code = "def f(a):\n    if a:\n        return 1\n    return 2\n\n\ndef g():\n    return 3\n"
    (tmp_path / "m.py").write_text(code)
    git("init", "-q", cwd=tmp_path)
    git("add", "-A", cwd=tmp_path)
    git("commit", "-qm", "start", cwd=tmp_path)
    row = {"instance_id": "t", "problem_statement": "fix f", "repo_path": str(tmp_path), "files": ["m.py"]}
    task = task_from_row(row)
    block = edit_block("m.py", "    if a:\n        return 1\n", "    if not a:\n        return 1\n")
    four_lines_one_made_up = "def f(a):\n    if b:\n        return 1\n    return 2\n"  # the file holds 3, in order
    cases = [
        (_outcome("ok", block), 1.0),
        (_outcome("call_limit", edit_block("m.py", "  if a:\n", "  if b:\n")), 1.0),  # indentation aside
        (_outcome("call_limit", edit_block("m.py", "    if key is None:\n", "    if key:\n")), 0.0),  # made up
        (_outcome("call_limit", edit_block("m.py", four_lines_one_made_up, "def f(a):\n    return 2\n")), 0.75),
        (_outcome("call_limit", edit_block("m.py", "    return 3\n    return 1\n", "    pass\n")), 0.5),  # out of order
        (_outcome("no_patch", edit_block("m.py", "def g():\n", "def g():\n")), 0.0),  # an identity edit
        (_outcome("ok", edit_block("new.py", "", "x = 1\n")), 0.0),  # an empty SEARCH (a new file) anchors nothing
        (_outcome("ok", edit_block("m.py", "", "# reviewed\n")), 0.0),  # nor does text appended to the file
        (_outcome("no_patch", "The bug is in `f`."), 0.0),
        (_outcome("crashed", block), 0.0),
    ]
    rows = [reward_row(row, task, o) for o, _ in cases]
    assert score({"anchored_change": anchored_change}, rows)["anchored_change"] == [want for _, want in cases]
    # a task without ``files`` is read in the files its oracle fix changes
    oracle = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -2 +2 @@ def f(a):\n-    if a:\n+    if not a:\n"
    bare = task_from_row({**row, "files": [], "patch": oracle})
    assert score({"a": anchored_change}, [reward_row(row, bare, cases[0][0])])["a"] == [1.0]


def test_a_rollout_with_an_answer_cut_at_the_token_cap_scores_0():
    loop = "src/pkg/mod.py\n```python\n<<<<<<< SEARCH\n" + "    return a\n" * 40
    block = edit_block("src/pkg/mod.py", "    return a\n", "    return b\n")

    def outcome(status: Status, *answers: tuple[str, str]) -> RolloutOutcome:
        trace = [{"message": {"role": "assistant", "content": a}, "finish_reason": why} for a, why in answers]
        trace.append({"request": {}})  # a call the proxy refused: no answer, no finish reason
        return RolloutOutcome("r", "t", status, "", "", len(answers), 1, 10, "", trace=trace)

    cases = [
        (outcome("ok", (block, "stop")), 1.0),
        (outcome("call_limit", (loop, "length")), 0.0),  # GRPO's repetition loop
        (outcome("no_patch", ("The bug is in `mod.py`.", "stop")), 1.0),  # a chat reply ends: above a loop
        (outcome("ok", (loop, "length"), (block, "stop")), 0.0),  # any cut answer counts
        (outcome("timeout", (block, "stop")), 0.0),  # a failed rollout scores 0 everywhere
        (outcome("no_patch"), 0.0),  # nothing answered: nothing to pay
    ]
    rows = [reward_row({"instance_id": "t"}, None, o) for o, _ in cases]
    assert rows[3]["rollout_finish_reasons"] == ["length", "stop"]
    assert score({"finished_answers": finished_answers}, rows)["finished_answers"] == [want for _, want in cases]

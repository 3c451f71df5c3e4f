"""Every answer and patch term against the trivial policies on a small real task (a generated cachetools task whose
fix swaps two branches, graded for real in the sandbox): no edit, a comment appended to the file (an empty SEARCH), a
comment on the buggy line, a whitespace-only edit (a blank line appended), a ``pass`` appended (code that does
nothing), and the oracle fix. The test prints the whole table (``pytest -s``); it asserts what the measures are for:
a comment or whitespace changes no line, only the fix resolves or has the fix's lines, and an empty SEARCH anchors
nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from aitlrt.common.git import git
from aitlrt.rewards.builtin import REWARDS
from aitlrt.rewards.inputs import reward_row, score
from aitlrt.rollout.runner import RolloutOutcome
from aitlrt.tasks.loader import load_tasks
from aitlrt.tasks.task import Task
from aitlrt.warmstart.oracle import edit_block
from tests.conftest import cachetools_tasks

TASK = "cachetools-8.0.1.invert_if__21ca41b0"
PATH = "src/cachetools/_cached.py"
BUGGY = "            wrapper = _InfoWrapper(func, cache, key, info)\n"
"""The first line the oracle fix changes (line 98), once in the file."""
TERMS = (
    "tests_pass",
    "keeps_pass_to_pass",
    "non_empty_patch",
    "well_formed_edit",
    "well_formed_change",
    "anchored_change",
    "finished_answers",
    "edit_tests_pass_fraction",
    "code_edit",
    "code_edit_tests_pass_fraction",
    "patch_similarity",
    "changed_lines_similarity",
    "unbroken_patch_similarity",
    "unbroken_changed_lines_similarity",
    "changed_lines_overlap",
    "unbroken_changed_lines_overlap",
    "localised",
)


@pytest.fixture(scope="module")
def task() -> Task:
    (found,) = load_tasks(cachetools_tasks(4), ids={TASK}).tasks
    return found


def _base_text(task: Task) -> str:
    repo, base = task.checkout()
    return git("show", f"{base}:{PATH}", cwd=repo)


def _policies(task: Task) -> dict[str, tuple[str, Callable[[str], str]]]:
    """Each trivial policy's answer (Aider's ``diff`` format) and the edit it makes of the file's text."""
    hunk = task.patch.split("\n@@", 1)[1].splitlines()[1:]  # the fix's one hunk: its base and fixed sides
    search = "".join(line[1:] + "\n" for line in hunk if line[:1] in (" ", "-"))
    fixed = "".join(line[1:] + "\n" for line in hunk if line[:1] in (" ", "+"))
    commented = BUGGY.rstrip("\n") + "  # the bug is here\n"
    return {
        "no edit": ("I could not find the bug.", lambda text: text),
        "comment at end": (edit_block(PATH, "", "# reviewed\n"), lambda text: text + "# reviewed\n"),
        "comment on bug": (edit_block(PATH, BUGGY, commented), lambda text: text.replace(BUGGY, commented)),
        "whitespace": (edit_block(PATH, "", "\n"), lambda text: text + "\n"),
        "pass at end": (edit_block(PATH, "", "pass\n"), lambda text: text + "pass\n"),
        "oracle": (edit_block(PATH, search, fixed), lambda text: text.replace(search, fixed)),
    }


def _patch(make_repo: Callable[..., Path], text: str, edit: Callable[[str], str], name: str) -> str:
    """Git's diff of the file edited as ``edit`` does, in a real repository holding the file at the task's start."""
    repo = make_repo({PATH: text}, name=name.replace(" ", "-"))
    (repo / PATH).write_text(edit(text))
    return git("diff", cwd=repo)


def test_the_trivial_policies_score_nothing_on_the_fix_measures(task: Task, make_repo):
    text = _base_text(task)
    assert text.count(BUGGY) == 1
    policies = _policies(task)
    rows = []
    for name, (answer, edit) in policies.items():
        patch = _patch(make_repo, text, edit, name)
        trace = [{"request": {}, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]
        outcome = RolloutOutcome(name, TASK, "ok" if patch else "no_patch", "", patch, 1, 0, 10, "", trace=trace)
        rows.append(reward_row(task.as_row(), task, outcome))
    assert rows[-1]["agent_patch"] == task.patch, "the oracle's edit is the fix, as git writes it"
    scores = score({term: REWARDS[term] for term in TERMS}, rows)
    got = {term: dict(zip(policies, values, strict=True)) for term, values in scores.items()}
    print(f"\n{'term':<34}" + "".join(f"{name:>16}" for name in policies))
    for term in TERMS:
        print(f"{term:<34}" + "".join(f"{value:>16.3f}" for value in got[term].values()))

    only_the_fix = {name: float(name == "oracle") for name in policies}
    for term in ("tests_pass", "localised", "changed_lines_overlap", "unbroken_changed_lines_overlap"):
        assert got[term] == only_the_fix, term  # no trivial policy earns a fix measure
    no_code = {name: v for name, v in only_the_fix.items() if name != "pass at end"}
    for term in ("changed_lines_similarity", "anchored_change", "well_formed_change", "code_edit"):
        # a comment or a blank line changes no code
        assert {name: got[term][name] for name in no_code} == no_code, term
    assert 0 < got["changed_lines_similarity"]["pass at end"] < 0.1, "characters of the fix's lines: paid a little"
    assert got["code_edit"]["pass at end"] == 1.0, "a `pass` is code"
    assert got["keeps_pass_to_pass"] == {name: float(name != "no edit") for name in policies}
    assert got["edit_tests_pass_fraction"]["comment at end"] > 0.9, "an edit that fixes nothing, paid in full"
    assert got["unbroken_changed_lines_similarity"] == got["changed_lines_similarity"]
    assert got["patch_similarity"]["comment on bug"] > 0.3, "SWE-RL's form pays a comment the hunk's context"

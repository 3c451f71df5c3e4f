"""The built-in reward terms as pure functions, each in [0, 1] (or NaN: unscorable), over what was already gathered
of one rollout: its grade, the model's last answer, its finish reasons, whether its patch applies, the task's files
at the start. No I/O: testable on strings. ``aitlrt.rewards.builtin`` gathers these inputs (``aitlrt.rewards.runtime``)
and turns each term into trl's reward-function signature; a rollout whose agent failed
(``aitlrt.rollout.status.AGENT_FAILURES``) scores 0 there, before any term is asked. The patch similarities are
``aitlrt.tasks.patches``' (``similarity``, ``changed_lines_similarity``, ``shares_changed_line``).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence

from aitlrt.rollout.agents.edit_format import edit_blocks
from aitlrt.rollout.status import grader_failed
from aitlrt.tasks import patches
from aitlrt.tasks.grading import Grade, protected
from aitlrt.tasks.patches import code_lines


def scored(grade: Grade, value: float) -> float:
    """``value``, or NaN (unscorable) where grading failed on the grader's side (``GRADER_FAILURES``): such a grade
    says nothing of the patch."""
    return math.nan if grader_failed(grade.status) else value


def tests_pass(grade: Grade) -> float:
    """1 when every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks with the patch applied."""
    return scored(grade, float(grade.resolved))


def tests_pass_fraction(grade: Grade) -> float:
    """The share of FAIL_TO_PASS + PASS_TO_PASS tests that pass."""
    return scored(grade, grade.fraction)


def breaks_no_test(grade: Grade) -> bool:
    """The patch was graded and every PASS_TO_PASS test still passes (true of a task that has none)."""
    return grade.status in ("resolved", "unresolved") and grade.p2p_passed == grade.p2p_total


def unbroken(similarity: float, grade: Grade) -> float:
    """``similarity`` (of the patch to the oracle's), paid only when no PASS_TO_PASS test broke (0 otherwise): an
    edit in the right place that breaks other code earns nothing for being in the right place."""
    return scored(grade, similarity if breaks_no_test(grade) else 0.0)


def non_empty_patch(patch: str, applies: bool) -> float:
    """1 when ``patch`` is not empty and ``applies`` to the task's starting commit."""
    return float(bool(patch.strip()) and applies)


def code_paths(patch: str, tests: Sequence[str]) -> list[str]:
    """The Python modules whose code ``patch`` changes: files it has an effective change in
    (``patches.changed_runs``: not a comment, not whitespace), ending in ``.py``, that the repository has at the
    start (the patch does not create them) and that are no test infrastructure (``grading.protected``, which the
    grader puts back; ``tests``: the task's test files)."""
    created, targets = patches.created_paths(patch), list(tests)
    return [
        path
        for path in patches.changed_runs(patch)
        if path.endswith(".py") and path not in created and not protected(path, targets)
    ]


def code_edit(patch: str, applies: bool, tests: Sequence[str]) -> float:
    """1 when ``patch`` applies and changes the code of a module the repository has (``code_paths``), 0 for a
    patch that changes no code: a comment, whitespace, a test, a new file (the ``FILE.rej`` that ``patch`` leaves
    where a hunk failed: a shell agent's cheapest "edit", docs/decisions/0024-reward-fix-and-closeness.md)."""
    return float(bool(code_paths(patch, tests)) and applies)


def keeps_pass_to_pass(patch: str, grade: Grade) -> float:
    """1 when ``patch`` is not empty, applied, was graded and every PASS_TO_PASS test still passes
    (``breaks_no_test``), 0 otherwise (no edit: 0 whatever its grade): over the rollouts that edited, the share of
    edits that keep the working code working."""
    return scored(grade, float(breaks_no_test(grade))) if patch.strip() else 0.0


def edit_tests_pass_fraction(edited: bool, grade: Grade) -> float:
    """``tests_pass_fraction`` of an edit (``edited``: ``non_empty_patch`` or ``code_edit`` paid 1), 0 without one:
    keeping the tests green pays only an agent that changed the code, so no edit scores below any edit and an edit
    that breaks tests below one that does not (plain ``tests_pass_fraction`` pays a no-op for the tests it leaves
    passing)."""
    return scored(grade, grade.fraction) if edited else 0.0


def well_formed_edit(answer: str) -> float:
    """1 when ``answer`` (the agent's last) holds a whole SEARCH/REPLACE block (Aider's ``diff`` edit format),
    whether its SEARCH part matched the file or not: a format term, so that answers Aider cannot parse (one that
    stops after ``<<<<<<< SEARCH``) score below well-formed ones and a policy drifting into them is pushed back."""
    return float(bool(edit_blocks(answer)))


def changing_searches(answer: str) -> list[str]:
    """The SEARCH texts of ``answer``'s blocks that change something: REPLACE's code differs from SEARCH's in more
    than whitespace or comments (``aitlrt.tasks.patches.code_lines``: a comment on the buggy line changes
    nothing)."""
    return [search for search, replace in edit_blocks(answer) if code_lines(search) != code_lines(replace)]


def well_formed_change(answer: str) -> float:
    """``well_formed_edit`` for a block that changes something: 1 when ``answer`` holds a whole SEARCH/REPLACE
    block whose REPLACE code differs from its SEARCH code in more than whitespace or comments, matched or not. An
    identity edit (REPLACE == SEARCH, which changes nothing) or a comment scores with a cut or missing block, below
    an attempted change."""
    return float(bool(changing_searches(answer)))


def found_share(search: str, text: str) -> float:
    """The share of ``search``'s non-blank lines found in ``text`` in order, indentation aside (difflib's matching
    blocks): 1 for a SEARCH text the file holds, 0 for one made up, and 0 for an empty one (Aider's way to append to
    a file or write a new one: it anchors nothing)."""
    wanted = [line.strip() for line in search.splitlines() if line.strip()]
    held = [line.strip() for line in text.splitlines() if line.strip()]
    if not wanted:
        return 0.0
    blocks = difflib.SequenceMatcher(None, wanted, held, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks) / len(wanted)


def anchored_change(answer: str, files: Sequence[str]) -> float:
    """``well_formed_change`` paid by how much of the block the file holds: per block of ``answer`` that changes
    something, the share of its SEARCH lines found, in order, in one of ``files`` (the task's files at its start,
    indentation aside); the best block counts. A matched change scores 1, a SEARCH that missed by a line or two
    nearly as much, and one made up 0, with an identity edit and an empty SEARCH (appending text is no targeted
    change: paid 1, it paid a comment appended to the file): paying every attempted change alike paid made-up
    SEARCH texts over identity edits, and GRPO learnt to write them (docs/decisions/0012-anchored-change.md)."""
    return max((found_share(s, t) for s in changing_searches(answer) for t in files), default=0.0)


def finished_answers(finish_reasons: Sequence[str | None]) -> float:
    """1 when the rollout answered and no answer was cut at the per-call token cap (``max_completion_length``:
    finish reason ``length``), 0 otherwise (no answer): DAPO's overlong penalty as a term in [0, 1]. An answer cut
    at the cap (in practice a line repeated until it) scores below every answer that ends, so a group of them and
    of chat replies is informative and pushes the policy out of the loop (trl's ``mask_truncated_completions``
    only takes them out of the loss)."""
    return float(bool(finish_reasons) and "length" not in finish_reasons)

"""Built-in reward functions, each in [0, 1], with trl's reward-function signature: the pure terms of
``aitlrt.rewards.terms`` over inputs gathered by ``aitlrt.rewards.runtime``.

trl calls ``f(prompts=..., completions=..., completion_ids=..., **columns)`` where every dataset column arrives as
a list, one entry per rollout, with the rollout's results added by ``aitlrt.rewards.inputs.reward_row``
(``task``, ``agent_patch``, ``rollout_status``, ``rollout_calls``, ``rollout_completion_tokens``,
``rollout_answers``, ``rollout_finish_reasons``). So any trl reward function composes with these, and these work on
any task dataset with the SWE-bench columns; the YAML's ``reward_funcs`` and ``reward_weights`` name them
(``REWARDS``). Grading and similarity run concurrently, each bounded by a timeout (``aitlrt.rewards.runtime``): a
reward never blocks a step indefinitely. A rollout whose agent failed (``aitlrt.rollout.status.AGENT_FAILURES``)
scores 0 everywhere, without grading. In training, a rollout that failed outside the policy
(``aitlrt.rollout.status.infrastructure_failure``) is unscorable instead: the trainer makes all its rewards NaN,
whatever the functions returned, so it leaves its group's baseline; here (evaluation, ``aitlrt rollout --rewards``)
it stays a 0. A grade that failed on the grader's side (``aitlrt.rollout.status.GRADER_FAILURES``) says nothing of
the patch: the functions that grade return NaN for it, which makes the rollout unscorable in training (the trainer
treats any NaN reward so); tests that time out stay the patch's fault (0).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aitlrt.rewards import runtime, terms
from aitlrt.rewards.inputs import rows_of
from aitlrt.rollout.status import agent_failed
from aitlrt.tasks import grading, patches
from aitlrt.tasks.grading import Grade

Row = Mapping[str, Any]


def _failed(row: Row) -> bool:
    return agent_failed(row.get("rollout_status"))


def _patch(row: Row) -> str:
    return row["agent_patch"] or ""


def _last_answer(row: Row) -> str:
    """The agent's last answer ("" when it has none)."""
    answers = row.get("rollout_answers") or [""]
    return answers[-1] or ""


def _each(kwargs: dict[str, Any], term: Callable[[Row], float]) -> list[float]:
    """``term`` of each rollout's row; 0 for a rollout whose agent failed, which is not looked at."""
    return [0.0 if _failed(row) else term(row) for row in rows_of(kwargs)]


def _graded(
    kwargs: dict[str, Any], term: Callable[[Row, Grade, float], float], given: list[float] | None = None
) -> list[float]:
    """``term(row, grade, given)`` of each rollout (every rollout graded concurrently, once: ``runtime.grade_cached``;
    ``given``: another reward's value of it, else 0); 0 for a rollout whose agent failed."""
    rows = rows_of(kwargs)
    grades = runtime.grade_rollouts(rows)
    given = given or [0.0] * len(rows)
    return [0.0 if _failed(r) else term(r, g, v) for r, g, v in zip(rows, grades, given, strict=True)]


def _against_oracle(func: Callable[[str, str], float], kwargs: dict[str, Any]) -> list[float]:
    """``func(agent_patch, patch)`` of each rollout (``runtime.similarities``: bounded by its timeout); 0 for a
    failed rollout."""
    rows = rows_of(kwargs)
    values = runtime.similarities(func, [(_patch(row), row.get("patch") or "") for row in rows])
    return [0.0 if _failed(row) else v for row, v in zip(rows, values, strict=True)]


def patch_similarity(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """SWE-RL similarity of ``agent_patch`` to the oracle ``patch`` (tasks.patches.similarity)."""
    return _against_oracle(patches.similarity, kwargs)


def changed_lines_similarity(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """Similarity of ``agent_patch``'s effective changed lines to the oracle ``patch``'s
    (tasks.patches.changed_lines_similarity): 0 for no edit, a comment or whitespace, 1 for the exact fix."""
    return _against_oracle(patches.changed_lines_similarity, kwargs)


def changed_lines_overlap(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """The share of the oracle ``patch``'s effective changed lines that ``agent_patch`` has, line for line
    (tasks.patches.changed_lines_overlap): 0 for no edit, a comment, whitespace or a line that is not the fix's, 1
    for the exact fix."""
    return _against_oracle(patches.changed_lines_overlap, kwargs)


def localised(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """1 when ``agent_patch``'s effective changes touch a base line that the oracle ``patch``'s touch, in the same
    file (tasks.patches.shares_changed_line): the agent edited where the bug is."""
    return _against_oracle(patches.shares_changed_line, kwargs)


def _applies(row: Row) -> bool:
    """The row's patch is not empty and applies to its task's starting commit (False for a row that is no task)."""
    patch = _patch(row)
    task = runtime.task_of(row) if patch.strip() else None
    return task is not None and runtime.applies(task, patch)


def non_empty_patch(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.non_empty_patch``: a non-empty patch that applies to the task's starting commit."""
    return _each(kwargs, lambda row: terms.non_empty_patch(_patch(row), _applies(row)))


def _code_edit(row: Row) -> float:
    """``terms.code_edit`` of the row's patch; whether it applies (a git call) is asked only where it changes
    code."""
    patch = _patch(row)
    task = runtime.task_of(row) if patch.strip() else None
    if task is None:
        return 0.0
    tests = grading.test_targets(task)
    return terms.code_edit(patch, bool(terms.code_paths(patch, tests)) and runtime.applies(task, patch), tests)


def code_edit(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.code_edit``: a patch that applies and changes the code of a module the repository has, outside its
    tests (not a comment, whitespace, a test or a new file such as a ``.rej``)."""
    return _each(kwargs, _code_edit)


def tests_pass(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.tests_pass``: every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks (NaN: a grader
    failure)."""
    return _graded(kwargs, lambda row, g, _: terms.tests_pass(g))


def tests_pass_fraction(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.tests_pass_fraction``: the share of the tests that pass (a metric: give it weight 0 to only log it;
    NaN: a grader failure)."""
    return _graded(kwargs, lambda row, g, _: terms.tests_pass_fraction(g))


def unbroken_patch_similarity(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``patch_similarity``, paid only when no PASS_TO_PASS test broke (``terms.unbroken``; NaN: a grader
    failure)."""
    return _graded(kwargs, lambda row, g, similar: terms.unbroken(similar, g), patch_similarity(**kwargs))


def unbroken_changed_lines_similarity(
    prompts=None, completions=None, completion_ids=None, **kwargs: Any
) -> list[float]:
    """``changed_lines_similarity``, paid only when no PASS_TO_PASS test broke (``terms.unbroken``; NaN: a grader
    failure)."""
    return _graded(kwargs, lambda row, g, similar: terms.unbroken(similar, g), changed_lines_similarity(**kwargs))


def keeps_pass_to_pass(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.keeps_pass_to_pass``: an edit that keeps every PASS_TO_PASS test passing (no edit: 0; NaN for an
    edit: a grader failure)."""
    return _graded(kwargs, lambda row, g, _: terms.keeps_pass_to_pass(_patch(row), g))


def edit_tests_pass_fraction(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.edit_tests_pass_fraction``: ``tests_pass_fraction`` of an edit (``non_empty_patch``), 0 without
    one (NaN for an edit: a grader failure)."""
    edited = non_empty_patch(**kwargs)
    return _graded(kwargs, lambda row, g, edit: terms.edit_tests_pass_fraction(bool(edit), g), edited)


def code_edit_tests_pass_fraction(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.edit_tests_pass_fraction`` of a code edit (``code_edit``), 0 without one (NaN for a code edit: a
    grader failure): green tests pay only a change of the code the tests run."""
    edited = code_edit(**kwargs)
    return _graded(kwargs, lambda row, g, edit: terms.edit_tests_pass_fraction(bool(edit), g), edited)


def well_formed_edit(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.well_formed_edit`` of the agent's last answer: it holds a whole SEARCH/REPLACE block."""
    return _each(kwargs, lambda row: terms.well_formed_edit(_last_answer(row)))


def well_formed_change(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.well_formed_change`` of the agent's last answer: a whole block that changes code."""
    return _each(kwargs, lambda row: terms.well_formed_change(_last_answer(row)))


def _anchored(row: Row) -> float:
    """``terms.anchored_change`` of the row's last answer against its task's files at the start (read only when a
    block changes something)."""
    answer = _last_answer(row)
    task = runtime.task_of(row) if terms.changing_searches(answer) else None
    return terms.anchored_change(answer, runtime.start_texts(task) if task is not None else [])


def anchored_change(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.anchored_change``: a change paid by how much of its SEARCH text the task's files hold."""
    return _each(kwargs, _anchored)


def unbroken_changed_lines_overlap(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``changed_lines_overlap``, paid only when no PASS_TO_PASS test broke (``terms.unbroken``; NaN: a grader
    failure)."""
    return _graded(kwargs, lambda row, g, overlap: terms.unbroken(overlap, g), changed_lines_overlap(**kwargs))


def finished_answers(prompts=None, completions=None, completion_ids=None, **kwargs: Any) -> list[float]:
    """``terms.finished_answers``: the rollout answered and no answer was cut at the per-call token cap."""
    return _each(kwargs, lambda row: terms.finished_answers(row.get("rollout_finish_reasons") or []))


GRADED: tuple[Callable[..., list[float]], ...] = (
    tests_pass,
    tests_pass_fraction,
    unbroken_patch_similarity,
    edit_tests_pass_fraction,
    code_edit_tests_pass_fraction,
    unbroken_changed_lines_similarity,
    unbroken_changed_lines_overlap,
    keeps_pass_to_pass,
)
"""The reward functions that run the tests (the trainer grades each rollout as soon as it ends when one is used)."""
REWARDS: dict[str, Callable[..., list[float]]] = {
    f.__name__: f
    for f in (
        patch_similarity,
        tests_pass,
        tests_pass_fraction,
        non_empty_patch,
        unbroken_patch_similarity,
        edit_tests_pass_fraction,
        well_formed_edit,
        well_formed_change,
        anchored_change,
        finished_answers,
        changed_lines_similarity,
        localised,
        keeps_pass_to_pass,
        unbroken_changed_lines_similarity,
        code_edit,
        code_edit_tests_pass_fraction,
        changed_lines_overlap,
        unbroken_changed_lines_overlap,
    )
}

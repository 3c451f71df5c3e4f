"""A rollout's status and a grade's failures: the names, and whose failure each is.

A rollout's status (``aitlrt.rollout.runner.judge``) says whose failure it was. Failures of the policy:
``timeout``, ``call_limit``, ``no_patch`` (an empty diff, or a patch refused because the agent changed its ``.git``:
``aitlrt.common.workspace``), and ``crashed`` after answered calls (the agent died on what the policy wrote); the
rewards score them (0 for the built-ins). Failures outside the policy (``infrastructure_failure``), which say
nothing about it: ``agent_error`` (an exception around the agent: proxy unreachable, no workspace; no call answered:
every call errored or none reached the proxy; the agent's last call failed with a server error, 5xx, so the server
ended the rollout: a hung vLLM shows so once the proxy's request timeout passes) and ``crashed`` before any answered
call (the agent could not start). The trainer makes every reward of such a rollout NaN: it leaves its group's
baseline and trains nothing.

A grade (``aitlrt.tasks.grading.Grade``) can fail on the grader's side (``GRADER_FAILURES``): that says nothing of
the patch, so the rewards that grade are NaN for it (unscorable); tests that time out stay the patch's fault.
"""

from __future__ import annotations

from typing import Literal, get_args

Status = Literal["ok", "no_patch", "timeout", "call_limit", "agent_error", "crashed"]
STATUSES: tuple[Status, ...] = get_args(Status)
"""Every rollout status, in the order the step metrics list them (``rollouts/<status>``)."""
AGENT_FAILURES: tuple[Status, ...] = ("timeout", "agent_error", "crashed")
"""The statuses of a rollout whose agent did not end on its own: every built-in reward scores it 0, ungraded."""

AGENT_FAILED = "agent_failed"
"""The grade of a rollout whose agent failed (``AGENT_FAILURES``): not graded."""
BAD_TASK = "bad_task"
"""The grade of a row that is not a valid task."""
GRADER_FAILURES = ("env_failed", "test_patch_failed", "grader_error", BAD_TASK)
"""Grade statuses that are the grader's failure, not the patch's (the test environment, the task's test patch, the
sandbox, the task row): the rewards that grade are NaN (unscorable)."""


def agent_failed(status: str | None) -> bool:
    """Whether a rollout with ``status`` failed before its agent ended (``AGENT_FAILURES``)."""
    return status in AGENT_FAILURES


def infrastructure_failure(status: str, answered_calls: int) -> bool:
    """Whether a rollout with ``status`` and ``answered_calls`` failed for reasons outside the policy (see the
    module docstring): ``agent_error``, or ``crashed`` before any call was answered."""
    return status == "agent_error" or (status == "crashed" and answered_calls == 0)


def grader_failed(grade_status: str) -> bool:
    """Whether a grade with ``grade_status`` failed on the grader's side (``GRADER_FAILURES``)."""
    return grade_status in GRADER_FAILURES

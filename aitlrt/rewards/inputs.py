"""The rollout → reward contract: the one place where a rollout's results become a reward function's inputs.

trl calls a reward function as ``f(prompts=..., completions=..., completion_ids=..., **columns)``, one list entry
per rollout for every column. A rollout's columns are its task's dataset row plus what the rollout produced
(``reward_row``). The trainer hands such rows to trl's ``_calculate_rewards``; ``score`` makes the same call for
everything that scores rollouts outside training (``aitlrt rollout --rewards``, ``aitlrt eval``). A reward
function that raises costs the rollouts of that call their scores (NaN: unscorable), not the run (``guarded``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aitlrt.rollout.runner import RolloutOutcome
from aitlrt.tasks.task import Task

RewardFunc = Callable[..., Sequence[float | None]]

log = logging.getLogger(__name__)


def reward_row(row: Mapping[str, Any], task: Task, outcome: RolloutOutcome) -> dict[str, Any]:
    """``row`` (the task's columns) plus the rollout's results: ``task`` (the ``Task``, built once per instance and
    reused), ``agent_patch`` (the final diff), ``rollout_status``, ``rollout_calls``, ``rollout_completion_tokens``,
    ``rollout_answers`` (the model's answers, one text per answered call, in order) and ``rollout_finish_reasons``
    (each answer's finish reason as vLLM gave it: ``length`` when it was cut at the per-call token cap)."""
    answered = [call for call in outcome.trace if call.get("message")]
    return {
        **row,
        "task": task,
        "agent_patch": outcome.patch,
        "rollout_status": outcome.status,
        "rollout_calls": outcome.calls,
        "rollout_completion_tokens": outcome.completion_tokens,
        "rollout_answers": [call["message"].get("content") or "" for call in answered],
        "rollout_finish_reasons": [call.get("finish_reason") for call in answered],
    }


def rows_of(columns: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each rollout's row rebuilt from trl's per-column keyword arguments (``score``'s inverse): every column that is
    a list with one entry per rollout (``agent_patch``'s length)."""
    n = len(columns["agent_patch"])
    lists = {k: v for k, v in columns.items() if isinstance(v, list | tuple) and len(v) == n}
    return [{k: v[i] for k, v in lists.items()} for i in range(n)]


def guarded(func: Callable[..., Any], name: str, errors: dict[str, str]) -> Callable[..., Any]:
    """``func`` (called as trl calls it), except that an exception is logged, kept as ``errors[name]`` and makes
    every rollout of the call unscorable (NaN) instead of propagating."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            count = len(kwargs["completions"])
            log.warning("reward %s raised on %d rollouts, now unscorable: %s", name, count, errors[name], exc_info=exc)
            return [float("nan")] * count

    return call


def score(funcs: Mapping[str, RewardFunc], rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Each reward function's values on ``rows`` (from ``reward_row``), called as trl calls it; ``None`` becomes
    NaN (trl's convention for "not applicable"), as do the values of a call that raised (``guarded``)."""
    if not rows:
        return {name: [] for name in funcs}
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
    prompts = [row.get("prompt", row.get("problem_statement", "")) for row in rows]
    completions = [row["agent_patch"] for row in rows]
    out: dict[str, list[float]] = {}
    errors: dict[str, str] = {}  # logged by guarded
    for name, func in funcs.items():
        call = guarded(func, name, errors)
        values = call(prompts=prompts, completions=completions, completion_ids=[[] for _ in rows], **columns)
        out[name] = [float("nan") if v is None else float(v) for v in values]
    return out

"""Held-out evaluation of a training run: the policy the server serves now, on tasks it does not train on, scored
and summarised the same way before and after training."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aitlrt.evaluation.checkpoints import SERVED, TRIVIAL_POLICIES, CheckpointResult, evaluate, paired_gain
from aitlrt.evaluation.scoring import paired_difference, summarise
from aitlrt.report import metric_names as names
from aitlrt.rewards.inputs import RewardFunc
from aitlrt.rollout.batch import PreparedTask, RolloutSettings, prepare_tasks
from aitlrt.rollout.runner import Progress
from aitlrt.tasks.task import task_from_row

SUMMARY_ROWS = (
    ("resolve rate", names.SUMMARY_RESOLVE_RATE),
    ("  its std error", names.SUMMARY_RESOLVE_SE),  # clustered by task: a before/after difference under ~2x is noise
    ("pass@1", names.SUMMARY_PASS_AT_1),
    ("pass@k", names.SUMMARY_PASS_AT_K),
    ("edit rate", names.SUMMARY_EDIT_RATE),
    ("P2P-kept edits", names.SUMMARY_P2P_KEPT_EDITS),
    ("localisation", names.SUMMARY_LOCALISATION),
    ("changed lines", "changed_lines_similarity"),  # a reward's mean, under its own name
    ("  line overlap", "changed_lines_overlap"),  # the fix's lines found whole
    ("weighted reward", names.SUMMARY_REWARD),
    ("  its std error", names.SUMMARY_REWARD_SE),
    ("training reward", names.SUMMARY_TRAINING_REWARD),  # the recipe's reward_weights: what GRPO pays each
    ("calls / rollout", names.SUMMARY_CALLS),
)
"""The held-out table's rows, resolve rate first (``aitlrt.evaluation.scoring.summarise``)."""


def prepare_rows(rows: Sequence[dict[str, Any]]) -> list[PreparedTask]:
    """The tasks of dataset rows (``Task.as_row``) with their cached repositories."""
    return prepare_tasks(task_from_row(row) for row in rows)


def evaluate_served(
    label: str,
    prepared: Sequence[PreparedTask],
    proxy: str,
    settings: RolloutSettings,
    funcs: Mapping[str, RewardFunc],
    weights: Mapping[str, float],
    training_weights: Mapping[str, float] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> CheckpointResult:
    """Roll out the weights ``proxy`` serves now on ``prepared`` and score them; the summary has the edit rate, the
    mean weighted reward and, with ``training_weights``, the training reward
    (``aitlrt.evaluation.scoring.summarise``)."""
    result = evaluate([SERVED], prepared, settings, funcs, proxy=proxy, on_progress=on_progress)[0]
    result.label = label
    result.summary = summarise(result.batch, result.rewards, weights, training_weights)
    return result


def evaluate_trivial(
    prepared: Sequence[PreparedTask],
    proxy: str,
    settings: RolloutSettings,
    funcs: Mapping[str, RewardFunc],
    weights: Mapping[str, float],
    training_weights: Mapping[str, float] | None = None,
) -> list[CheckpointResult]:
    """The trivial policies (``TRIVIAL_POLICIES``: no edit, a comment appended, a whitespace edit, a reject file,
    the oracle) on ``prepared`` through ``proxy``, scored and summarised as the policy is: what an agent that does
    not fix gets, and the ceiling."""
    results = evaluate(list(TRIVIAL_POLICIES), prepared, settings, funcs, proxy=proxy)
    for label, result in zip(TRIVIAL_POLICIES, results, strict=True):
        result.label = label
        result.summary = summarise(result.batch, result.rewards, weights, training_weights)
    return results


def summary_table(results: Sequence[CheckpointResult], weights: Mapping[str, float] | None = None) -> str:
    """The held-out numbers side by side, one column per evaluation (the trivial policies', one rollout per task,
    beside the policy's: what an agent that does not fix scores); with ``weights`` and a first two evaluations whose
    rollouts pair up (seeded alike: ``aitlrt.evaluation.scoring.paired``), the paired difference of the resolve
    rate and of the weighted reward (standard errors clustered by task) and the share of rollouts that left the same
    patch."""
    width = max(14, *(len(r.label) for r in results))
    lines = [f"{'held-out':<16}" + "".join(f" {r.label:>{width}}" for r in results)]
    for name, key in SUMMARY_ROWS:
        if any(key in r.summary for r in results):
            lines.append(f"{name:<16}" + "".join(f" {r.summary.get(key, math.nan):>{width}.3f}" for r in results))
    tasks = len({t.instance_id for t in results[0].batch.tasks}) if results else 0
    formula = " + ".join(f"{w:g} {name}" for name, w in (weights or {}).items() if w)
    lines.append(
        f"({tasks} tasks x {len(results[0].batch.outcomes) // max(1, tasks)} rollouts each"
        + (f"; weighted reward = {formula})" if formula else ")")
    )
    if weights and len(results) >= 2 and (pair := paired_gain(results[0], results[1], weights)):
        clusters = [t.instance_id for t in results[0].batch.tasks]
        before, after = results[0].rewards.get("tests_pass"), results[1].rewards.get("tests_pass")
        if before is not None and after is not None:
            solved, se = paired_difference(before, after, clusters=clusters)
            lines.append(f"paired by seed: {results[1].label} - {results[0].label} resolve rate {solved:+.3f} "
                         f"(std error {se:.3f})")  # fmt: skip
        lines.append(
            f"paired by seed: {results[1].label} - {results[0].label} weighted reward {pair.gain:+.3f} (std error "
            f"{pair.se:.3f}); {pair.same_patch:.0%} of the rollouts left the same patch"
        )
    return "\n".join(lines)

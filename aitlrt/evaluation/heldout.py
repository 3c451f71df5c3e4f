"""Held-out evaluation of a training run: the policy the server serves now, on tasks it does not train on, scored
and summarised the same way before and after training."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aitlrt.evaluation.checkpoints import SERVED, CheckpointResult, evaluate, paired_gain
from aitlrt.evaluation.scoring import summarise
from aitlrt.rewards.inputs import RewardFunc
from aitlrt.rollout.batch import PreparedTask, RolloutSettings, prepare_tasks
from aitlrt.rollout.runner import Progress
from aitlrt.tasks.task import task_from_row

SUMMARY_ROWS = (
    ("edit rate", "edit_rate"),
    ("resolve rate", "tests_pass"),
    ("similarity", "patch_similarity"),
    ("weighted reward", "reward"),
    ("  its std error", "reward_se"),  # a before/after difference under ~2x the errors combined is noise
    ("calls / rollout", "calls"),
)


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
    on_progress: Callable[[Progress], None] | None = None,
) -> CheckpointResult:
    """Roll out the weights ``proxy`` serves now on ``prepared`` and score them; the summary has the edit rate and
    the mean weighted reward (``aitlrt.evaluation.scoring.summarise``)."""
    result = evaluate([SERVED], prepared, settings, funcs, proxy=proxy, on_progress=on_progress)[0]
    result.label = label
    result.summary = summarise(result.batch, result.rewards, weights)
    return result


def summary_table(results: Sequence[CheckpointResult], weights: Mapping[str, float] | None = None) -> str:
    """The held-out numbers side by side, one column per evaluation; with ``weights`` and two evaluations whose
    rollouts pair up (seeded alike: ``aitlrt.evaluation.scoring.paired``), the paired difference of the weighted
    reward and the share of rollouts that left the same patch."""
    width = max(14, *(len(r.label) for r in results))
    lines = [f"{'held-out':<16}" + "".join(f" {r.label:>{width}}" for r in results)]
    for name, key in SUMMARY_ROWS:
        if all(key in r.summary for r in results):
            lines.append(f"{name:<16}" + "".join(f" {r.summary[key]:>{width}.3f}" for r in results))
    tasks = len({t.instance_id for t in results[0].batch.tasks}) if results else 0
    formula = " + ".join(f"{w:g} {name}" for name, w in (weights or {}).items() if w)
    lines.append(
        f"({tasks} tasks x {len(results[0].batch.outcomes) // max(1, tasks)} rollouts each"
        + (f"; weighted reward = {formula})" if formula else ")")
    )
    if weights and len(results) == 2 and (pair := paired_gain(results[0], results[1], weights)):
        lines.append(
            f"paired by seed: {results[1].label} - {results[0].label} weighted reward {pair.gain:+.3f} (std error "
            f"{pair.se:.3f}); {pair.same_patch:.0%} of the rollouts left the same patch"
        )
    return "\n".join(lines)

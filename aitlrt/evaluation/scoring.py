"""Score a batch of rollouts with the built-in rewards, through the same rollout → reward contract as training
(``aitlrt.rewards.inputs``), and summarise it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from aitlrt.rewards.builtin import REWARDS
from aitlrt.rewards.inputs import RewardFunc, reward_row, score
from aitlrt.rollout.batch import Batch


def reward_funcs(names: Sequence[str]) -> dict[str, RewardFunc]:
    """The built-in rewards called ``names``; ValueError naming the unknown ones."""
    unknown = [name for name in names if name not in REWARDS]
    if unknown:
        raise ValueError(f"unknown rewards {unknown} (known: {', '.join(REWARDS)})")
    return {name: REWARDS[name] for name in names}


def score_batch(funcs: Mapping[str, RewardFunc], batch: Batch) -> dict[str, list[float]]:
    """Each reward's value for every rollout of ``batch``, in order."""
    rows = [reward_row(task.as_row(), task, o) for task, o in zip(batch.tasks, batch.outcomes, strict=True)]
    return score(funcs, rows)


def summarise(
    batch: Batch, rewards: Mapping[str, Sequence[float]], weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Mean of each reward, the edit rate (share of rollouts whose edit left a non-empty patch), with ``weights``
    the mean weighted reward (``reward``) and its standard error (``reward_se``: two checkpoints whose rewards
    differ by less than ~2x their errors combined cannot be told apart), the mean calls and completion tokens per
    rollout, and the share of ``ok`` rollouts. The resolve rate is ``tests_pass``'s mean. NaN values (a grade that
    failed on the grader's side, a reward function that raised) are left out of the means (NaN when all are)."""
    out = {name: _mean(values) for name, values in rewards.items()}
    out["edit_rate"] = statistics.fmean(bool(o.patch.strip()) for o in batch.outcomes)
    if weights:
        per_rollout = [v for v in weighted_rewards(rewards, weights) if not math.isnan(v)]
        out["reward"] = _mean(per_rollout)
        out["reward_se"] = statistics.stdev(per_rollout) / math.sqrt(len(per_rollout)) if len(per_rollout) > 1 else 0.0
    out["calls"] = statistics.fmean(o.calls for o in batch.outcomes)
    out["completion_tokens"] = statistics.fmean(o.completion_tokens for o in batch.outcomes)
    out["status_ok"] = statistics.fmean(o.status == "ok" for o in batch.outcomes)
    return out


def _mean(values: Sequence[float]) -> float:
    """The mean of the values that are not NaN; NaN if none is."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


def weighted_rewards(rewards: Mapping[str, Sequence[float]], weights: Mapping[str, float]) -> list[float]:
    """Each rollout's weighted reward (a reward without a weight counts 0)."""
    n = len(next(iter(rewards.values()), ()))
    return [sum(weights.get(name, 0.0) * values[i] for name, values in rewards.items()) for i in range(n)]


def paired(before: Batch, after: Batch) -> bool:
    """Whether the rollouts of two batches pair up one to one: the same tasks in the same order, every rollout
    sampled with the same seed (``RolloutSettings.seed``), so that a difference between them is the weights'."""
    return (
        bool(before.seeds)
        and None not in before.seeds
        and before.seeds == after.seeds
        and [t.instance_id for t in before.tasks] == [t.instance_id for t in after.tasks]
    )


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """Mean of ``after[i] - before[i]`` and its standard error: with paired rollouts (``paired``) the sampling noise
    the two share cancels, so this error is smaller than the unpaired one of two independent means. A pair with a
    NaN side (unscorable) is left out."""
    diffs = [a - b for a, b in zip(after, before, strict=True) if not math.isnan(a - b)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return _mean(diffs), se


def same_patch_share(before: Batch, after: Batch) -> float:
    """Share of paired rollouts that left the very same patch: how much of the sampling the new weights changed."""
    return statistics.fmean(a.patch == b.patch for a, b in zip(before.outcomes, after.outcomes, strict=True))

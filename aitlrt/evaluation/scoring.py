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
    rollout, and the share of ``ok`` rollouts. The resolve rate is ``tests_pass``'s mean."""
    out = {name: statistics.fmean(values) for name, values in rewards.items()}
    out["edit_rate"] = statistics.fmean(bool(o.patch.strip()) for o in batch.outcomes)
    if weights:
        per_rollout = [sum(weights.get(n, 0.0) * v[i] for n, v in rewards.items()) for i in range(len(batch.outcomes))]
        out["reward"] = statistics.fmean(per_rollout)
        out["reward_se"] = statistics.stdev(per_rollout) / math.sqrt(len(per_rollout)) if len(per_rollout) > 1 else 0.0
    out["calls"] = statistics.fmean(o.calls for o in batch.outcomes)
    out["completion_tokens"] = statistics.fmean(o.completion_tokens for o in batch.outcomes)
    out["status_ok"] = statistics.fmean(o.status == "ok" for o in batch.outcomes)
    return out

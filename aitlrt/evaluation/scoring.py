"""Score a batch of rollouts with the built-in rewards, through the same rollout → reward contract as training
(``aitlrt.rewards.inputs``), and summarise it."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping, Sequence

from aitlrt.report import metric_names as names
from aitlrt.rewards.builtin import REWARDS
from aitlrt.rewards.inputs import RewardFunc, reward_row, score
from aitlrt.rollout.batch import Batch

MEASURES = ("tests_pass", "changed_lines_similarity", "changed_lines_overlap", "localised", "keeps_pass_to_pass")
"""The rewards every evaluation scores, whatever the run's weights: what ``summarise`` reads the resolve rate, the
share of edits that keep the PASS_TO_PASS tests, the localisation, the changed-lines similarity and overlap from."""


def measure_funcs() -> dict[str, RewardFunc]:
    """The functions of ``MEASURES``, by name."""
    return reward_funcs(MEASURES)


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
    batch: Batch,
    rewards: Mapping[str, Sequence[float]],
    weights: Mapping[str, float] | None = None,
    training_weights: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """What an evaluation table reads of a scored batch: the mean of each reward; from the ``MEASURES`` scored, the
    resolve rate (``resolve_rate``: ``tests_pass``'s mean; ``resolve_se``), ``pass@1`` and ``pass@k`` (``k``: the
    rollouts per task, ``pass_at_k``), the share of edits that keep every PASS_TO_PASS test (``p2p_kept_edits``, of the
    rollouts with a non-empty patch; NaN without one), the ``localisation`` (``localised``'s mean),
    ``changed_lines_similarity`` and ``changed_lines_overlap``; the edit rate (share of rollouts whose edit left a
    non-empty patch); with ``weights`` the mean weighted reward (``reward``, ``reward_se``); with ``training_weights``
    (the recipe's ``reward_weights``) the mean reward GRPO would have paid (``training_reward``: what shaping pays a
    trivial policy); the mean calls and completion tokens per rollout, and the share of ``ok`` rollouts. Standard errors
    are clustered by task (``clustered_se``: the rollouts of a task are not independent draws): two checkpoints whose
    values differ by less than ~2x their errors combined cannot be told apart. NaN values (a grade that failed on the
    grader's side, a reward function that raised) are left out of the means (NaN when all are); a measure not scored is
    not reported."""
    tasks = [o.task_id for o in batch.outcomes]
    out = {name: _mean(values) for name, values in rewards.items()}
    out[names.SUMMARY_EDIT_RATE] = statistics.fmean(bool(o.patch.strip()) for o in batch.outcomes)
    if "tests_pass" in rewards:
        resolved = rewards["tests_pass"]
        out |= {names.SUMMARY_RESOLVE_RATE: _mean(resolved), names.SUMMARY_RESOLVE_SE: clustered_se(resolved, tasks)}
        out |= _pass_rates(resolved, tasks)
    if "keeps_pass_to_pass" in rewards:
        kept = rewards["keeps_pass_to_pass"]
        out[names.SUMMARY_P2P_KEPT_EDITS] = _mean(
            [v for v, o in zip(kept, batch.outcomes, strict=True) if o.patch.strip()]
        )
    if "localised" in rewards:
        out[names.SUMMARY_LOCALISATION] = out["localised"]
    if weights:
        per_rollout = weighted_rewards(rewards, weights)
        out |= {names.SUMMARY_REWARD: _mean(per_rollout), names.SUMMARY_REWARD_SE: clustered_se(per_rollout, tasks)}
    if training_weights:
        out[names.SUMMARY_TRAINING_REWARD] = _mean(weighted_rewards(rewards, training_weights))
    out[names.SUMMARY_CALLS] = statistics.fmean(o.calls for o in batch.outcomes)
    out[names.SUMMARY_COMPLETION_TOKENS] = statistics.fmean(o.completion_tokens for o in batch.outcomes)
    out[names.SUMMARY_STATUS_OK] = statistics.fmean(o.status == "ok" for o in batch.outcomes)
    return out


def _by_cluster(values: Sequence[float], clusters: Sequence[Hashable]) -> list[list[float]]:
    """The values that are not NaN, grouped by cluster (in order of first appearance); clusters left empty dropped."""
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for value, cluster in zip(values, clusters, strict=True):
        if not math.isnan(value):
            groups[cluster].append(value)
    return list(groups.values())


def clustered_se(values: Sequence[float], clusters: Sequence[Hashable]) -> float:
    """The standard error of the mean of ``values`` clustered by ``clusters`` (one key per value, a task id): the
    standard error of the mean of the per-cluster means, ``stdev(means) / sqrt(clusters)`` (0 with one cluster); NaN
    values are left out (NaN when all are)."""
    means = [statistics.fmean(group) for group in _by_cluster(values, clusters)]
    if not means:
        return math.nan
    return statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` passed (Chen et al. 2021):
    ``1 - C(n - c, k) / C(n, k)``, the chance that ``k`` of the ``n`` drawn without replacement hold a pass; with
    ``k > n``, whether any passed."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1 (n={n}, c={c}, k={k})")
    if c == 0:
        return 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _pass_rates(resolved: Sequence[float], tasks: Sequence[str]) -> dict[str, float]:
    """``pass@1`` and ``pass@k`` averaged over the tasks, ``k`` the fewest rollouts a task has (NaN grades left out:
    a task's ``n`` counts its graded rollouts)."""
    k = min(Counter(tasks).values(), default=0)
    groups = _by_cluster(resolved, tasks)
    if not groups:
        return {names.SUMMARY_PASS_AT_1: math.nan, names.SUMMARY_PASS_AT_K: math.nan, names.SUMMARY_K: float(k)}
    counts = [(len(group), round(sum(group))) for group in groups]
    return {
        names.SUMMARY_PASS_AT_1: statistics.fmean(pass_at_k(n, c, 1) for n, c in counts),
        names.SUMMARY_PASS_AT_K: statistics.fmean(pass_at_k(n, c, k) for n, c in counts),
        names.SUMMARY_K: float(k),
    }


def _mean(values: Sequence[float]) -> float:
    """The mean of the values that are not NaN; NaN if none is."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


def weighted_rewards(rewards: Mapping[str, Sequence[float]], weights: Mapping[str, float]) -> list[float]:
    """Each rollout's weighted reward: the weighted sum of the rewards that have a weight (one without a weight, as
    a measure, counts 0, also where it is NaN)."""
    n = len(next(iter(rewards.values()), ()))
    weighted = [(w, rewards[name]) for name, w in weights.items() if w and name in rewards]
    return [sum(w * values[i] for w, values in weighted) for i in range(n)]


def paired(before: Batch, after: Batch) -> bool:
    """Whether the rollouts of two batches pair up one to one: the same tasks in the same order, every rollout
    sampled with the same seed (``RolloutSettings.seed``), so that a difference between them is the weights'."""
    return (
        bool(before.seeds)
        and None not in before.seeds
        and before.seeds == after.seeds
        and [t.instance_id for t in before.tasks] == [t.instance_id for t in after.tasks]
    )


def paired_difference(
    before: Sequence[float], after: Sequence[float], clusters: Sequence[Hashable] | None = None
) -> tuple[float, float]:
    """Mean of ``after[i] - before[i]`` and its standard error: with paired rollouts (``paired``) the sampling noise
    the two share cancels, so this error is smaller than the unpaired one of two independent means. With
    ``clusters`` (one key per rollout, its task id) the error is clustered by task (``clustered_se``: the SE of the
    per-task mean differences), else each pair counts as independent. A pair with a NaN side (unscorable) is left
    out."""
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    kept = [d for d in diffs if not math.isnan(d)]
    if clusters is not None:
        return _mean(kept), clustered_se(diffs, clusters)
    return _mean(kept), statistics.stdev(kept) / math.sqrt(len(kept)) if len(kept) > 1 else 0.0


def same_patch_share(before: Batch, after: Batch) -> float:
    """Share of paired rollouts that left the very same patch: how much of the sampling the new weights changed."""
    return statistics.fmean(a.patch == b.patch for a, b in zip(before.outcomes, after.outcomes, strict=True))

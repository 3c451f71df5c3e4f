"""``aitlrt.evaluation.scoring.summarise``: what an evaluation table reads."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from aitlrt.evaluation.scoring import summarise
from aitlrt.rollout.batch import Batch
from aitlrt.rollout.runner import RolloutOutcome


def test_summary_has_the_weighted_reward_and_its_standard_error():
    outcomes = [
        RolloutOutcome(f"r{i}", "t", "ok" if patch else "no_patch", "", patch, 1, 0, 10, "")
        for i, patch in enumerate(["diff a", "", "diff b", ""])
    ]
    rewards = {"patch_similarity": [1.0, 0.0, 0.5, 0.0], "non_empty_patch": [1.0, 0.0, 1.0, 0.0]}
    summary = summarise(Batch([], outcomes), rewards, {"patch_similarity": 0.5, "non_empty_patch": 0.1})
    per_rollout = [0.6, 0.0, 0.35, 0.0]
    mean = sum(per_rollout) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in per_rollout) / 3)
    assert summary["reward"] == pytest.approx(mean)
    assert summary["reward_se"] == pytest.approx(sd / 2)
    assert summary["edit_rate"] == summary["status_ok"] == 0.5
    assert "reward_se" not in summarise(Batch([], outcomes), rewards), "no weights: no weighted reward"


def test_the_heldout_table_shows_each_checkpoints_reward_with_its_standard_error():
    from aitlrt.evaluation.checkpoints import CheckpointResult
    from aitlrt.evaluation.heldout import summary_table

    outcomes = [RolloutOutcome(f"r{i}", "t", "ok", "", "diff", 1, 0, 10, "") for i in range(2)]
    weights = {"patch_similarity": 1.0}
    results = [
        CheckpointResult(label, Batch([], outcomes), {}, summarise(Batch([], outcomes), scores, weights))
        for label, scores in (("before", {"patch_similarity": [0.0, 0.2]}), ("after", {"patch_similarity": [0.3, 0.3]}))
    ]
    lines = {line[:16].strip(): line[16:].split() for line in summary_table(results).splitlines()}
    assert lines["weighted reward"] == ["0.100", "0.300"]
    assert lines["its std error"] == ["0.100", "0.000"]


def _task(instance_id: str) -> SimpleNamespace:
    """A stand-in for a ``Task``: pairing reads its id only."""
    return SimpleNamespace(instance_id=instance_id)


def test_rollouts_pair_up_only_when_seeded_alike_on_the_same_tasks():
    from aitlrt.evaluation.scoring import paired, paired_difference, same_patch_share
    from aitlrt.rollout.batch import rollout_seed

    tasks = [_task("a"), _task("a"), _task("b")]
    seeds = [rollout_seed(0, t.instance_id, k) for t, k in zip(tasks, (0, 1, 0), strict=True)]
    assert len(set(seeds)) == 3 and seeds[0] == rollout_seed(0, "a", 0) != rollout_seed(1, "a", 0)

    def batch(patches, batch_seeds=seeds, batch_tasks=tasks):
        outcomes = [RolloutOutcome(f"r{i}", "t", "ok", "", p, 1, 0, 10, "") for i, p in enumerate(patches)]
        return Batch(batch_tasks, outcomes, list(batch_seeds))

    before, after = batch(["x", "", "y"]), batch(["x", "z", "w"])
    assert paired(before, after) and same_patch_share(before, after) == pytest.approx(1 / 3)
    assert not paired(before, batch(["x", "", "y"], batch_seeds=[1, 2, 3]))
    assert not paired(before, batch(["x", "", "y"], batch_tasks=[tasks[2], tasks[1], tasks[0]]))
    assert not paired(batch([""] * 3, batch_seeds=[None] * 3), batch([""] * 3, batch_seeds=[None] * 3))
    assert not paired(Batch(tasks, before.outcomes), Batch(tasks, after.outcomes)), "unseeded batches"

    gain, se = paired_difference([0.0, 0.1, 0.3], [0.1, 0.1, 0.6])  # differences 0.1, 0, 0.3
    assert gain == pytest.approx(0.4 / 3)
    assert se == pytest.approx(math.sqrt(((0.1 - gain) ** 2 + gain**2 + (0.3 - gain) ** 2) / 2) / math.sqrt(3))


def test_the_heldout_table_shows_the_paired_gain_of_seeded_evaluations():
    from aitlrt.evaluation.checkpoints import CheckpointResult
    from aitlrt.evaluation.heldout import summary_table

    tasks = [_task("a"), _task("b")]
    weights = {"patch_similarity": 1.0}

    def result(label, patches, scores, seeds):
        outcomes = [RolloutOutcome(f"r{i}", "t", "ok", "", p, 1, 0, 10, "") for i, p in enumerate(patches)]
        batch = Batch(tasks, outcomes, seeds)
        return CheckpointResult(label, batch, scores, summarise(batch, scores, weights))

    before = result("before", ["x", "y"], {"patch_similarity": [0.0, 0.2]}, [5, 6])
    after = result("after", ["x", "z"], {"patch_similarity": [0.3, 0.3]}, [5, 6])
    table = summary_table([before, after], {**weights, "non_empty_patch": 0.0}).splitlines()
    assert table[-2] == "(2 tasks x 1 rollouts each; weighted reward = 1 patch_similarity)", "the weights it reports"
    line = table[-1]
    assert line.startswith("paired by seed: after - before weighted reward +0.200 (std error 0.100)"), line
    assert "50% of the rollouts left the same patch" in line
    unpaired = result("after", ["x", "z"], {"patch_similarity": [0.3, 0.3]}, [None, None])
    assert "paired" not in summary_table([before, unpaired], weights)

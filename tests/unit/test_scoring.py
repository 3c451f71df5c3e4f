"""``aitlrt.evaluation.scoring.summarise``: what an evaluation table reads."""

from __future__ import annotations

import math

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

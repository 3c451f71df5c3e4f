"""``aitlrt.evaluation.scoring.summarise``: what an evaluation table reads."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest

from aitlrt.evaluation.scoring import summarise
from aitlrt.rollout.batch import Batch
from aitlrt.rollout.runner import RolloutOutcome


def test_summary_has_the_weighted_reward_and_its_standard_error():
    outcomes = [  # one rollout per task: the clustered error is the plain one
        RolloutOutcome(f"r{i}", f"t{i}", "ok" if patch else "no_patch", "", patch, 1, 0, 10, "")
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

    outcomes = [RolloutOutcome(f"r{i}", f"t{i}", "ok", "", "diff", 1, 0, 10, "") for i in range(2)]
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


def test_pass_at_k_is_the_unbiased_estimator():
    from aitlrt.evaluation.scoring import pass_at_k

    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 3, 2) == 1.0, "every pair of draws holds a pass"
    assert pass_at_k(2, 1, 4) == 1.0 and pass_at_k(2, 0, 4) == 0.0, "k > n: whether any passed"
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)


def test_standard_errors_are_clustered_by_task():
    from aitlrt.evaluation.scoring import clustered_se, paired_difference

    values = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, math.nan]
    tasks = ["a", "a", "b", "b", "c", "c", "c"]
    means = [1.0, 0.0, 0.5]  # c's NaN left out
    assert clustered_se(values, tasks) == pytest.approx(0.5 / math.sqrt(3))  # stdev(means) = 0.5
    assert statistics.stdev(means) == pytest.approx(0.5)
    assert clustered_se([0.0, 1.0], ["a", "a"]) == 0.0, "one task: no spread to read"
    assert math.isnan(clustered_se([math.nan], ["a"]))
    # paired: per-task mean differences a 0.5, b 0 → mean of all pairs 0.25, error stdev([0.5, 0]) / sqrt 2
    before, after = [0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]
    gain, se = paired_difference(before, after, clusters=["a", "a", "b", "b"])
    assert gain == pytest.approx(0.25) and se == pytest.approx(math.sqrt(0.125) / math.sqrt(2))
    assert paired_difference(before, after)[1] == pytest.approx(0.25), "unclustered: four independent pairs"
    assert paired_difference([math.nan, 0.0], [1.0, 1.0], clusters=["a", "b"]) == (1.0, 0.0)


def test_summary_leads_with_the_resolve_rate_and_reads_the_measures():
    from aitlrt.evaluation.scoring import MEASURES, measure_funcs

    assert list(measure_funcs()) == list(MEASURES)
    # two tasks x 3 rollouts: a resolves 2 of 3 (one grade failed: NaN), b none; b's rollouts edit nothing once
    tasks = ["a", "a", "a", "b", "b", "b"]
    patches = ["fix", "fix", "bad", "x", "", "y"]
    outcomes = [
        RolloutOutcome(f"r{i}", t, "ok", "", p, 2, 0, 10, "")
        for i, (t, p) in enumerate(zip(tasks, patches, strict=True))
    ]
    rewards = {
        "tests_pass": [1.0, math.nan, 0.0, 0.0, 0.0, 0.0],
        "keeps_pass_to_pass": [1.0, math.nan, 0.0, 1.0, 0.0, 0.0],  # the no-edit rollout's 0 is no edit's
        "localised": [1.0, 1.0, 1.0, 0.0, 0.0, 0.0],
        "changed_lines_similarity": [1.0, 1.0, 0.5, 0.0, 0.0, 0.25],
        "format": [math.nan, 1.0, 1.0, 1.0, 1.0, 1.0],  # a NaN without a weight does not spoil the reward
    }
    summary = summarise(Batch([], outcomes), rewards, {"tests_pass": 1.0, "localised": 0.5})
    assert summary["resolve_rate"] == pytest.approx(1 / 5)
    assert summary["resolve_se"] == pytest.approx(statistics.stdev([0.5, 0.0]) / math.sqrt(2))
    assert summary["pass@1"] == pytest.approx((1 / 2 + 0) / 2)
    assert summary["k"] == 3 and summary["pass@k"] == pytest.approx((1.0 + 0) / 2), "a: 1 of 2 graded, k > n"
    assert summary["p2p_kept_edits"] == pytest.approx(2 / 4), "of the 5 edits, 4 graded, 2 keep the tests"
    assert summary["edit_rate"] == pytest.approx(5 / 6)
    assert summary["localisation"] == summary["localised"] == pytest.approx(0.5)
    assert summary["changed_lines_similarity"] == pytest.approx(2.75 / 6)
    # weighted: 1.5, NaN, 0.5, 0, 0, 0 (per task a 1.0, b 0)
    assert summary["reward"] == pytest.approx(2 / 5)
    assert summary["reward_se"] == pytest.approx(statistics.stdev([1.0, 0.0]) / math.sqrt(2))
    bare = summarise(Batch([], outcomes), {"format": rewards["format"]})
    assert not {"resolve_rate", "resolve_se", "pass@1", "pass@k", "p2p_kept_edits", "localisation", "reward"} & set(
        bare
    )
    no_edits = [RolloutOutcome("r", "a", "no_patch", "", "", 1, 0, 10, "")]
    assert math.isnan(summarise(Batch([], no_edits), {"keeps_pass_to_pass": [0.0]})["p2p_kept_edits"])


def test_the_heldout_table_leads_with_the_resolve_rate_and_shows_the_trivial_policies_beside():
    from aitlrt.evaluation.checkpoints import CheckpointResult
    from aitlrt.evaluation.heldout import summary_table

    tasks = [_task(f"t{i // 2}") for i in range(4)]  # 2 tasks x 2 rollouts, seeded: before and after pair up
    outcomes = [RolloutOutcome(f"r{i}", t.instance_id, "ok", "", "diff", 1, 0, 10, "") for i, t in enumerate(tasks)]
    weights = {"tests_pass": 1.0, "changed_lines_similarity": 0.5}

    def result(label: str, solved: list[float], similar: list[float], n: int = 4) -> CheckpointResult:
        batch = Batch(tasks[:n], outcomes[:n], list(range(n)) if n == 4 else [None] * n)
        scores = {"tests_pass": solved, "changed_lines_similarity": similar}
        return CheckpointResult(label, batch, scores, summarise(batch, scores, weights))

    results = [
        result("before", [0.0, 0.0, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]),
        result("after", [1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.4, 1.0]),
        result("trivial:comment", [0.0, 0.0], [0.0, 0.0], n=2),
    ]
    table = summary_table(results, weights)
    lines = {line[:16].strip(): line[16:].split() for line in table.splitlines()}
    assert table.splitlines()[1].startswith("resolve rate"), "the resolve rate leads"
    assert lines["resolve rate"] == ["0.000", "0.500", "0.000"]
    assert lines["pass@k"] == ["0.000", "1.000", "0.000"]
    assert lines["weighted reward"] == ["0.025", "0.800", "0.000"]
    assert "training reward" not in lines, "shown where the recipe's training weights were given"
    training = {"tests_pass": 1.0, "non_empty_patch": 0.5}
    scores = {"tests_pass": [0.0], "non_empty_patch": [1.0], "changed_lines_similarity": [0.0]}
    junk = summarise(Batch(tasks[:1], outcomes[:1], [None]), scores, weights, training)
    assert junk["reward"] == 0.0 and junk["training_reward"] == 0.5, "what GRPO pays an edit that fixes nothing"
    junk_table = summary_table([CheckpointResult("trivial:junk", Batch(tasks[:1], outcomes[:1], [None]), scores, junk)])
    assert "training reward           0.500" in junk_table
    assert "resolve rate +0.500 (std error 0.000)" in table, "paired by task, clustered: each task gained 0.5"

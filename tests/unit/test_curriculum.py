"""The task curriculum (``aitlrt.training.curriculum``) and the difficulty sidecar (``aitlrt.tasks.difficulty``)."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
from trl.trainer.utils import RepeatSampler

from aitlrt.cli.rollout import reward_weights
from aitlrt.tasks.difficulty import (
    TaskDifficulty,
    difficulty_from_rollouts,
    read_difficulty,
    sidecar_path,
    write_difficulty,
)
from aitlrt.training.curriculum import CurriculumSampler, Estimate, task_weights

SURE = 40  # probe rollouts that all solved a task: enough to retire it (4 are not: see below)


def record(instance_id: str, solved_rate: float, k: int = 4, **rewards: float) -> TaskDifficulty:
    return TaskDifficulty(instance_id, k, solved_rate, solved_rate, 1.0, "m", "2026-11-24T00:00:00Z", rewards)


def solved(instance_id: str) -> TaskDifficulty:
    return record(instance_id, 1.0, SURE)


def chunks(sequence: list[int], mini: int, batch: int, repeat: int) -> list[list[int]]:
    """The chunks of a RepeatSampler-shaped sequence, asserting its structure: each index ``mini`` times in a row,
    each chunk of ``batch`` indices ``repeat`` times in a row."""
    block = mini * batch * repeat
    assert len(sequence) % block == 0
    out = []
    for start in range(0, len(sequence), block):
        part = sequence[start : start + block]
        first = part[: mini * batch]
        assert part == first * repeat
        assert all(first[i : i + mini] == [first[i]] * mini for i in range(0, len(first), mini))
        out.append(first[::mini])
    return out


# ---- weights ------------------------------------------------------------------------------------------------------
def test_weights_by_class():
    ids = ["solved", "half", "quarter", "failed1", "failed2", "new"]
    records = {r.instance_id: r for r in (solved("solved"), record("half", 0.5), record("quarter", 0.25))}
    records |= {"failed1": record("failed1", 0.0), "failed2": record("failed2", 0.0)}
    w = dict(zip(ids, task_weights(ids, records, 0.2), strict=True))
    assert w["solved"] == 0.0
    assert math.isclose(sum(w.values()), 1.0)
    assert math.isclose(w["failed1"] + w["failed2"], 0.2) and w["failed1"] == w["failed2"]
    # mixed share 0.8 by p(1-p), p the posterior mean: half 0.5 (0.25), quarter 2/6 after one solve in 4 (2/9),
    # unprobed counts as p = 0.5
    assert math.isclose(w["half"], 0.8 * 0.25 / (0.5 + 2 / 9)) and math.isclose(w["new"], w["half"])
    assert math.isclose(w["quarter"], 0.8 * (2 / 9) / (0.5 + 2 / 9))


def test_an_empty_class_gives_its_share_to_the_other():
    only_failed = task_weights(["a", "b", "c"], {"a": record("a", 0.0), "b": record("b", 0.0), "c": solved("c")}, 0)
    assert only_failed == [0.5, 0.5, 0.0]
    only_mixed = task_weights(["a", "b"], {"a": record("a", 0.5), "b": solved("b")}, 1.0)
    assert only_mixed == [1.0, 0.0]


def test_every_task_solved_is_a_clear_error():
    with pytest.raises(ValueError, match="always solved"):
        task_weights(["a", "b"], {"a": solved("a"), "b": solved("b")}, 0.2)
    with pytest.raises(ValueError, match="always solved"):
        CurriculumSampler(["a"], 2, records={"a": solved("a")})


# ---- the sampler --------------------------------------------------------------------------------------------------
def test_an_always_solved_task_is_never_drawn():
    ids = [f"t{i}" for i in range(6)]
    records = {"t0": solved("t0"), "t1": record("t1", 0.0), "t2": record("t2", 0.5)}
    sampler = CurriculumSampler(ids, mini_repeat_count=2, batch_size=3, repeat_count=2, seed=1, records=records)
    drawn = Counter(i for _ in range(300) for i in sampler)
    assert drawn[0] == 0
    assert set(drawn) == {1, 2, 3, 4, 5}
    assert 0 not in sampler.draw_groups(50)


def test_mixed_and_failed_tasks_share_the_draws_as_configured():
    ids = [f"m{i}" for i in range(4)] + [f"f{i}" for i in range(4)]
    records = {i: record(i, 0.5 if i.startswith("m") else 0.0) for i in ids}
    sampler = CurriculumSampler(ids, mini_repeat_count=1, batch_size=1, seed=0, records=records, failed_share=0.25)
    draws = [ids[i] for _ in range(1000) for i in sampler]  # 8 000 draws
    failed = sum(i.startswith("f") for i in draws) / len(draws)
    assert abs(failed - 0.25) < 0.03, failed  # 6 standard deviations
    per_task = Counter(draws)
    assert all(abs(per_task[i] / len(draws) - 0.75 / 4) < 0.02 for i in ids[:4])


def test_structured_like_trls_repeat_sampler():
    ids = [f"t{i}" for i in range(7)]
    mini, batch, repeat = 2, 3, 4
    ours = list(CurriculumSampler(ids, mini, batch, repeat, seed=42))
    theirs = list(RepeatSampler(ids, mini, batch, repeat, seed=42))
    assert len(ours) == len(theirs) == len(CurriculumSampler(ids, mini, batch, repeat))
    assert [len(c) for c in chunks(ours, mini, batch, repeat)] == [len(c) for c in chunks(theirs, mini, batch, repeat)]
    for chunk in chunks(ours, mini, batch, repeat):  # without replacement inside a chunk
        assert len(set(chunk)) == batch


def test_more_groups_than_tasks_with_weight_repeat_across_rounds():
    ids = ["a", "b", "c", "d"]
    records = {"a": solved("a"), "b": solved("b")}
    sampler = CurriculumSampler(ids, mini_repeat_count=1, batch_size=3, seed=0, records=records)
    [chunk] = chunks(list(sampler), 1, 3, 1)  # 4 tasks // 3 = one chunk, as RepeatSampler
    assert set(chunk) == {2, 3} and len(chunk) == 3
    assert len(list(CurriculumSampler(ids, 2, batch_size=8))) == 16  # fewer tasks than a chunk: one chunk still


def test_reproducible_per_seed_and_in_step_across_ranks():
    ids = [f"t{i}" for i in range(10)]
    records = {f"t{i}": record(f"t{i}", i / 10) for i in range(10)}

    def run(seed: int) -> list[int]:
        sampler = CurriculumSampler(ids, 2, batch_size=4, repeat_count=2, seed=seed, records=records)
        out = []
        for epoch in range(3):
            out += list(sampler)
            sampler.update(f"t{epoch + 1}", [1.0, 1.0])  # the same gathered values on every rank
            out += sampler.draw_groups(3, exclude=["t5"])
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_one_all_solved_group_does_not_retire_a_task_and_a_run_of_them_does():
    ids = ["a", "b", "c"]
    sampler = CurriculumSampler(ids, 1, batch_size=1, seed=0, records={"a": record("a", 0.5)})
    sampler.update("a", [1.0, math.nan, 1.0, 1.0, 1.0])  # an unscorable rollout is left out
    assert sampler.weights[0] > 0  # solved 70 % of the time, a task does this with p = 0.24
    for _ in range(7):  # a run of all-solved groups outweighs the probe's half-failed rollouts
        sampler.update("a", [1.0] * 4)
    assert sampler.weights[0] == 0.0
    assert 0 not in [i for _ in range(200) for i in sampler]
    sampler.update("b", [1.0, 0.0])  # mixed: stays, at p = 0.5
    sampler.update("c", [0.0, 0.0])  # no reward at all: the whole failed share
    assert sampler.weights == pytest.approx([0.0, 0.8, 0.2])
    sampler.update("c", [math.nan, math.nan])  # nothing scored: unchanged
    assert sampler.weights == pytest.approx([0.0, 0.8, 0.2])
    with pytest.raises(KeyError):
        sampler.update("unknown", [1.0])
    for _ in range(8):
        sampler.update("b", [1.0] * 4)
        sampler.update("c", [1.0] * 4)
    with pytest.raises(ValueError, match="always solved"):
        sampler.draw_groups(1)


def test_a_task_solved_70_percent_of_the_time_is_almost_never_retired():
    """Over 30 groups of 4, as many runs of 15 steps see: retired in 24 % of runs after the first group before."""
    rng = random.Random(0)
    retired = 0
    for _ in range(2000):
        estimate = Estimate()
        for _ in range(30):
            estimate.add([float(rng.random() < 0.7) for _ in range(4)], 0.8)
            if estimate.retired:
                retired += 1
                break
    assert retired / 2000 < 0.02, retired


def test_difficulty_is_the_runs_weighted_reward_not_tests_pass_alone():
    weights = {"tests_pass": 1.0, "patch_similarity": 0.5, "format": 0.0}
    near = record("near", 0.0, k=8, tests_pass=0.0, patch_similarity=0.9, format=1.0)  # close fixes, none passing
    nothing = record("nothing", 0.0, k=8, tests_pass=0.0, patch_similarity=0.0, format=1.0)
    w = task_weights(["near", "nothing"], {"near": near, "nothing": nothing}, 0.2, weights)
    assert w[0] == pytest.approx(0.8) and w[1] == pytest.approx(0.2)  # mixed, not failed: its reward can teach
    assert task_weights(["near", "nothing"], {"near": near, "nothing": nothing}, 0.2) == [0.5, 0.5]  # both failed

    sampler = CurriculumSampler(["a", "b"], 1, batch_size=1, records={}, reward_weights=weights)
    sampler.update("a", [1.5, 1.5, 0.0, 0.0])  # weighted rewards, scaled by 1.5: half a success on average
    sampler.update("b", [0.3, 0.3, 0.3, 0.3])  # 0.2 each
    a, b = sampler.weights
    assert a / b == pytest.approx((0.5 * 0.5) / ((1 + 0.8) / 6 * (1 - (1 + 0.8) / 6)))


def test_a_resumed_sampler_goes_on_from_its_checkpoint_state():
    ids = [f"t{i}" for i in range(8)]
    records = {i: record(i, 0.5) for i in ids}

    def fresh() -> CurriculumSampler:
        return CurriculumSampler(ids, 2, batch_size=2, seed=1, records=records)

    sampler = fresh()
    list(sampler)
    for _ in range(8):
        sampler.update("t0", [1.0] * 4)  # learned online: solved, never drawn again
    sampler.update("t1", [0.0, 0.0])
    state = json.loads(json.dumps(sampler.state_dict()))  # as the checkpoint's curriculum.json
    expected = list(sampler) + sampler.draw_groups(3)

    resumed = fresh()
    resumed.load_state_dict(state)
    assert resumed.weights == sampler.weights and resumed.weights[0] == 0.0
    assert list(resumed) + resumed.draw_groups(3) == expected, "the same draws as the run that was not cut"
    assert fresh().weights[0] > 0, "without the state, the solved task would be drawn again"
    other = CurriculumSampler(ids[1:], 2, batch_size=2, seed=1, records=records)
    other.load_state_dict(state)  # a task no longer in the dataset is dropped, not an error
    assert other.weights[0] > 0  # t1: failed, now the first


def test_draw_groups_prefers_tasks_not_yet_rolled_out():
    ids = [f"t{i}" for i in range(6)]
    sampler = CurriculumSampler(ids, 2, batch_size=2, seed=0)
    for _ in range(20):
        picked = sampler.draw_groups(3, exclude=["t0", "t1", "t2"])
        assert sorted(picked) == [3, 4, 5]
    assert len(set(sampler.draw_groups(6))) == 6
    assert sorted(Counter(sampler.draw_groups(8)).values()) == [1, 1, 1, 1, 2, 2]


# ---- the sidecar --------------------------------------------------------------------------------------------------
def test_record_from_rollouts_leaves_unscorable_ones_out():
    rewards = {"tests_pass": [1.0, 0.0, math.nan, 0.0], "patch_similarity": [1.0, 0.5, 0.0, 0.0]}
    weights = {"tests_pass": 1.0, "patch_similarity": 0.5}
    r = difficulty_from_rollouts("t", rewards, weights, ["p", "p", "", ""], model="m", probed_at="now")
    assert r is not None
    assert (r.k, r.solved_rate, r.edit_rate, r.level) == (3, 1 / 3, 2 / 3, "mixed")
    assert r.rewards == pytest.approx({"tests_pass": 1 / 3, "patch_similarity": 0.5})
    assert r.reward_mean == pytest.approx(1 / 3 + 0.25)
    none = {"tests_pass": [math.nan], "patch_similarity": [0.0]}
    assert difficulty_from_rollouts("t", none, weights, [""], model="m", probed_at="now") is None


def test_sidecar_round_trips_and_merges(tmp_path: Path):
    path = sidecar_path(tmp_path / "tasks.jsonl")
    assert path.name == "tasks.jsonl.difficulty.jsonl"
    first = [record("a", 0.5), record("b", 0.0)]
    write_difficulty(path, first)
    assert read_difficulty(path) == {"a": first[0], "b": first[1]}
    line = json.loads(path.read_text().splitlines()[0])
    assert {"instance_id", "k", "reward_mean", "rewards", "solved_rate", "edit_rate", "model", "probed_at"} <= set(line)
    merged = write_difficulty(path, [record("b", 1.0), record("c", 0.25)], merge=True)
    assert list(merged) == ["a", "b", "c"] and merged["b"].level == "solved"
    assert read_difficulty(path) == merged
    assert list(write_difficulty(path, [record("c", 0.25)])) == ["c"]  # without merge: replaced


def test_a_bad_sidecar_line_names_its_place(tmp_path: Path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"instance_id": "a", "k": 2}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1"):
        read_difficulty(path)


def test_reward_weights_of_probe_and_eval():
    assert reward_weights("patch_similarity=0.5, non_empty_patch") == {"patch_similarity": 0.5, "non_empty_patch": 1.0}
    assert reward_weights("tests_pass=2") == {"tests_pass": 2.0}
    with pytest.raises(ValueError, match="bad reward weight"):
        reward_weights("tests_pass=x")

"""Failures outside the policy are unscorable (NaN rewards, out of the baseline, nothing trained); the policy's
own failures score 0. On crafted traces and outcomes: no servers, no agents."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest
import torch

from aitlrt.rollout.agents import AgentExit
from aitlrt.rollout.runner import RolloutOutcome, judge
from aitlrt.rollout.status import infrastructure_failure
from aitlrt.training.advantages import group_advantages
from aitlrt.training.failures import UnscorableSteps, UnscorableStepsError
from tests.helpers.multirank_run import tiny_trainer

EXIT_0 = AgentExit(0, False, "", 1.0)


def call(i, status=200, prompt=(3, 4), completion=(5, 6), error=None, code=None):
    answered = status == 200
    return {
        "call_index": i,
        "prompt_token_ids": list(prompt),
        "completion_token_ids": list(completion) if answered else [],
        "logprobs": [-0.5] * len(completion) if answered else [],
        "status": status,
        "tag": None,
        "weight_version": 0,
        "error": error,
        "error_code": code,
    }


def judged(exit, patch, trace, error=None):
    status, reason = judge(exit, patch, trace, error)
    calls = sum(c["status"] == 200 for c in trace)
    return status, reason, infrastructure_failure(status, calls)


def test_failures_outside_the_policy_are_told_from_the_policys():
    ok, gone = [call(0)], [call(0), call(1, 503, error="vLLM down", code="upstream_unavailable")]
    # Outside the policy: nothing answered, an exception around the agent, a crash before any answer, and a
    # server error that ended the rollout (Aider exits 0 after its retries fail).
    assert judged(EXIT_0, "", [call(0, 502, error="bad gateway")])[::2] == ("agent_error", True)
    assert judged(EXIT_0, "", [])[::2] == ("agent_error", True)
    assert judged(None, "", [], "ConnectError: refused")[::2] == ("agent_error", True)
    assert judged(AgentExit(1, False, "", 1.0), "", [])[::2] == ("crashed", True)
    status, reason, infra = judged(EXIT_0, "diff", gone)
    assert (status, infra) == ("agent_error", True) and "503" in reason and "1 answered" in reason
    assert judged(AgentExit(1, False, "", 1.0), "", gone)[::2] == ("agent_error", True)
    # The policy's: a timeout, the call limit, an empty patch, a crash after answered calls; a 5xx it recovered from.
    assert judged(AgentExit(None, True, "", 9.0), "", ok)[::2] == ("timeout", False)
    limited = [call(0), call(1, 400, error="limit", code="call_limit")]
    assert judged(EXIT_0, "", limited)[::2] == ("call_limit", False)
    assert judged(EXIT_0, "", ok)[::2] == ("no_patch", False)
    assert judged(AgentExit(1, False, "", 1.0), "diff", ok)[::2] == ("crashed", False)
    assert judged(EXIT_0, "diff", [call(0, 500), call(1)])[::2] == ("ok", False)


def outcome(i, status, patch, trace):
    calls = sum(c["status"] == 200 for c in trace)
    return RolloutOutcome(f"r{i}", "task-0", status, "", patch, calls, len(trace) - calls, 2 * calls, "", trace=trace)


def by_patch(prompts, completions, completion_ids=None, **kwargs):
    """Rewards by patch: good 1, half 0.5, else 0."""
    return [{"good": 1.0, "half": 0.5}.get(c, 0.0) for c in completions]


def crafted_trainer(tmp_path, *reward_funcs, **config):
    """The tiny trainer on crafted outcomes (set ``_rollouts``), one group of 4 per step, one round per step."""
    settings = dict(
        per_device_train_batch_size=4,
        vllm_importance_sampling_correction=False,
        save_rollouts=False,
        max_sampling_rounds=1,  # one round of rollouts per step: dynamic sampling has its own tests
    )
    out = str(tmp_path / "run")
    t = tiny_trainer("http://127.0.0.1:1", str(tmp_path), out, reward_funcs=list(reward_funcs), **settings, **config)
    t.weight_version = 0
    t.server.connect = lambda: None
    return t


@pytest.fixture
def trainer(tmp_path):
    return crafted_trainer(tmp_path, by_patch)


def test_an_infrastructure_failure_leaves_the_baseline_and_a_timeout_scores_0(trainer):
    server_died = [call(0, prompt=(7, 8), completion=(9,)), call(1, 503, error="vLLM down")]
    outcomes = [
        outcome(0, "ok", "good", [call(0)]),
        outcome(1, "timeout", "", [call(0)]),  # the policy's failure: its 0 stays in the baseline
        outcome(2, "agent_error", "", server_died),  # scored 0 by the function, made NaN by the trainer
        outcome(3, "ok", "half", [call(0)]),
    ]
    trainer.collector.rollouts = lambda inputs: outcomes
    inputs = [dict(trainer.train_dataset[0]) for _ in outcomes]
    batch = trainer._generate_and_score_completions(inputs)

    expected, _ = group_advantages(torch.tensor([1.0, 0.0, 0.5]), 3)  # the group without the failed rollout
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    trained = [batch["advantages"][r][mask[r]].unique().tolist() for r in range(len(mask)) if mask[r].any()]
    assert trained == [[pytest.approx(a)] for a in expected.tolist()]  # rollouts 0, 1, 3: one row each
    assert 9 not in batch["completion_ids"][mask].tolist(), "the failed rollout's sampled token is not trained"
    metrics = trainer._metrics["train"]
    assert metrics["rollouts/unscorable"] == [1] and metrics["rows/skipped_unscorable_calls"] == [2]
    assert metrics["reward"] == [pytest.approx(0.5)]
    assert metrics["reward_std"] == [pytest.approx(0.5)]  # std of 1, 0, 0.5: the NaN is not a 0
    assert metrics["rows/count"] == [3] and metrics["rows/split"] == [0]


def test_reward_std_ignores_unscorable_rollouts_and_is_nan_without_two_scorable(trainer):
    outcomes = [outcome(0, "ok", "good", [call(0)])] + [outcome(i, "agent_error", "", []) for i in range(1, 4)]
    trainer.collector.rollouts = lambda inputs: outcomes
    trainer._generate_and_score_completions([dict(trainer.train_dataset[0]) for _ in outcomes])
    metrics = trainer._metrics["train"]
    assert metrics["rollouts/unscorable"] == [3] and metrics["reward"] == [1.0]
    assert math.isnan(metrics["reward_std"][0])


def test_a_timeout_is_the_policys_unless_the_server_failed():
    """A rollout killed at its timeout scores 0 even with no call answered: its first answer may still have been
    generating (the proxy records a call when it ends), and a policy must not opt out of its group's baseline by
    answering slowly. A hung server shows as 504s (the managed server's request timeout is half the rollout's)."""
    for trace in ([], [call(0, 400, error="bad request")]):
        status, _, infra = judged(AgentExit(None, True, "", 600.0), "", trace)
        assert (status, infra) == ("timeout", False)
    status, reason, infra = judged(AgentExit(None, True, "", 600.0), "", [call(0, 504, error="upstream timed out")])
    assert (status, infra) == ("agent_error", True) and "504" in reason


def raising(prompts, completions, completion_ids=None, **kwargs):
    raise RuntimeError("the reward's service is down")


def test_a_raising_reward_makes_its_rollouts_unscorable_not_a_crash(tmp_path):
    trainer = crafted_trainer(tmp_path, by_patch, raising)
    trainer.args.save_rollouts = True
    outcomes = [outcome(i, "ok", patch, [call(0)]) for i, patch in enumerate(("good", "", "half", ""))]
    trainer.collector.rollouts = lambda inputs: outcomes
    batch = trainer._generate_and_score_completions([dict(trainer.train_dataset[0]) for _ in outcomes])
    metrics = trainer._metrics["train"]
    assert metrics["rollouts/unscorable"] == [4] and trainer.ctx.skip_update  # the run goes on, nothing trained
    assert not (batch["completion_mask"] * batch["tool_mask"]).any()
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_0000.jsonl").open()]
    assert all("raising (RuntimeError: the reward's service is down)" in r["unscorable"] for r in records)


def graded(prompts, completions, completion_ids=None, **kwargs):
    return [math.nan if c == "env broke" else 0.0 for c in completions]


def test_any_nan_reward_makes_the_rollout_unscorable(tmp_path):
    """A reward function's NaN (a grade that failed on the grader's side) leaves the baseline like an infrastructure
    failure, whatever the other functions scored it."""
    trainer = crafted_trainer(tmp_path, by_patch, graded)
    patches = ("good", "", "env broke", "half")
    outcomes = [outcome(i, "ok", patch, [call(0)]) for i, patch in enumerate(patches)]
    trainer.collector.rollouts = lambda inputs: outcomes
    batch = trainer._generate_and_score_completions([dict(trainer.train_dataset[0]) for _ in outcomes])
    expected, _ = group_advantages(torch.tensor([1.0, 0.0, 0.5]), 3)
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    trained = [batch["advantages"][r][mask[r]].unique().tolist() for r in range(len(mask)) if mask[r].any()]
    assert trained == [[pytest.approx(a)] for a in expected.tolist()]
    metrics = trainer._metrics["train"]
    assert metrics["rollouts/unscorable"] == [1] and metrics["rewards/by_patch/mean"] == [0.5]


def test_grader_side_failures_are_unscorable_and_a_test_timeout_scores_0(monkeypatch):
    from aitlrt.rewards import builtin, runtime
    from aitlrt.tasks.grading import Grade
    from aitlrt.tasks.sources import Source
    from aitlrt.tasks.task import Task

    grades = {
        "env": Grade("env_failed", reason="pip failed"),
        "test_patch": Grade("test_patch_failed", reason="test patch does not apply"),
        "sandbox": Grade("grader_error", reason="bwrap: no permission"),
        "slow": Grade("timeout", 0, 1, 1, 1, reason="tests ran past 600 s"),
        "fixed": Grade("resolved", 1, 1, 1, 1),
    }

    def grade(task, patch, timeout=600):
        if patch == "boom":
            raise OSError("sandbox vanished")
        return grades[patch]

    monkeypatch.setattr(runtime, "grade", grade)
    patches = [*grades, "boom"]
    tasks = [Task(f"grader-{uuid.uuid4().hex}", "fix it", Source("local", "/nowhere")) for _ in patches]
    rows = [
        {"task": t, "agent_patch": p, "rollout_status": "ok", "patch": p} for t, p in zip(tasks, patches, strict=True)
    ]
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    nan = math.nan
    expected = {
        builtin.tests_pass: [nan, nan, nan, 0.0, 1.0, nan],
        builtin.tests_pass_fraction: [nan, nan, nan, 0.5, 1.0, nan],
    }
    for func, values in expected.items():
        assert str(func(**columns)) == str(values), func.__name__  # NaN compares by its text
    one = {key: values[:1] for key, values in columns.items()}  # one row: similarity without the process pool
    assert math.isnan(builtin.unbroken_patch_similarity(**one)[0])
    assert runtime.grader_failure(rows[0]) == "grade env_failed: pip failed"
    assert runtime.grader_failure(rows[5]) == "grade grader_error: OSError: sandbox vanished"
    assert runtime.grader_failure(rows[3]) == ""  # the patch's own timeout


def test_unscorable_steps_stop_the_run_naming_the_cause():
    watch = UnscorableSteps(3, "http://127.0.0.1:9")  # nothing listens there: the health check says so
    watch.observe(1, True, ["agent_error: no call answered"] * 4)
    watch.observe(2, False, [])  # a scorable step resets the count
    watch.observe(3, True, ["agent_error: no call answered"] * 4)
    watch.observe(4, True, ["agent_error: no call answered"] * 4)
    with pytest.raises(UnscorableStepsError) as err:
        watch.observe(5, True, ["agent_error: no call answered"] * 3 + ["NaN reward: tests_pass"])
    text = str(err.value)
    assert "3 consecutive steps" in text and "3x agent_error: no call answered" in text and "1x NaN reward" in text
    assert "/health: no answer (ConnectError" in text
    never = UnscorableSteps(0, "http://127.0.0.1:9")
    for step in range(10):
        never.observe(step, True, ["agent_error: x"])


def test_the_curriculum_state_is_in_a_checkpoint_before_older_ones_are_rotated(tmp_path, monkeypatch):
    """With ``save_total_limit`` 1 the Trainer removes the older checkpoint at the end of each save: by then the new
    one must already hold the curriculum's state, or a crash in between leaves no checkpoint with it."""
    import transformers.trainer

    difficulty = tmp_path / "difficulty.jsonl"
    difficulty.write_text("")  # every task unprobed
    saves = dict(save_strategy="steps", save_steps=1, save_total_limit=1, save_only_model=True)
    trainer = crafted_trainer(tmp_path, by_patch, task_difficulty_file=str(difficulty), max_staleness=0, **saves)
    outcomes = [outcome(i, "ok", patch, [call(0)]) for i, patch in enumerate(("good", "", "half", ""))]
    trainer.collector.rollouts = lambda inputs: outcomes
    seen, rotate = [], transformers.trainer.rotate_checkpoints

    def rotating(output_dir, **kwargs):
        newest = max(Path(output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        seen.append((newest.name, (newest / "curriculum.json").is_file()))
        rotate(output_dir=output_dir, **kwargs)

    monkeypatch.setattr(transformers.trainer, "rotate_checkpoints", rotating)
    trainer.train()
    assert seen == [("checkpoint-1", True), ("checkpoint-2", True)]
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-2"]

"""Failures outside the policy are unscorable (NaN rewards, out of the baseline, nothing trained); the policy's
own failures score 0. On crafted traces and outcomes: no servers, no agents."""

from __future__ import annotations

import math

import pytest
import torch

from aitlrt.rollout.agents import AgentExit
from aitlrt.rollout.runner import RolloutOutcome, infrastructure_failure, judge
from aitlrt.training.advantages import group_advantages
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


@pytest.fixture
def trainer(tmp_path):
    """The tiny trainer, one group of 4 per step; rewards by patch: good 1, half 0.5, else 0."""

    def by_patch(prompts, completions, completion_ids=None, **kwargs):
        return [{"good": 1.0, "half": 0.5}.get(c, 0.0) for c in completions]

    config = dict(
        per_device_train_batch_size=4,
        vllm_importance_sampling_correction=False,
        save_rollouts=False,
        max_sampling_rounds=1,  # one round of rollouts per step: dynamic sampling has its own tests
    )
    t = tiny_trainer("http://127.0.0.1:1", str(tmp_path), str(tmp_path / "run"), **config)
    t.reward_funcs, t.reward_func_names = [by_patch], ["by_patch"]
    t.weight_version = 0
    t._connect = lambda: None
    return t


def test_an_infrastructure_failure_leaves_the_baseline_and_a_timeout_scores_0(trainer):
    server_died = [call(0, prompt=(7, 8), completion=(9,)), call(1, 503, error="vLLM down")]
    outcomes = [
        outcome(0, "ok", "good", [call(0)]),
        outcome(1, "timeout", "", [call(0)]),  # the policy's failure: its 0 stays in the baseline
        outcome(2, "agent_error", "", server_died),  # scored 0 by the function, made NaN by the trainer
        outcome(3, "ok", "half", [call(0)]),
    ]
    trainer._rollouts = lambda inputs: outcomes
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
    trainer._rollouts = lambda inputs: outcomes
    trainer._generate_and_score_completions([dict(trainer.train_dataset[0]) for _ in outcomes])
    metrics = trainer._metrics["train"]
    assert metrics["rollouts/unscorable"] == [3] and metrics["reward"] == [1.0]
    assert math.isnan(metrics["reward_std"][0])

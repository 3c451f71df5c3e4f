"""The rollout record: training and evaluation write it through one writer with the fields they wrote before it
was typed, and one reader reads both, an earlier run's files included, naming the line and field of a bad one."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from aitlrt.report.html import render
from aitlrt.rollout.record import (
    STEP_FILE,
    RolloutRecord,
    RolloutRecordError,
    read_rollouts,
    read_run_rollouts,
    write_rollouts,
)
from aitlrt.rollout.runner import RolloutOutcome

TRAINING_FIELDS = {  # trainer._save_rollouts's record before it was typed
    *("step", "round", "rollout_id", "instance_id", "status", "reason", "unscorable", "patch", "oracle_patch"),
    *("rewards", "advantage", "informative", "calls", "completion_tokens", "rows", "trained_tokens", "conversation"),
}


def outcome(patch: str = "+b\n") -> RolloutOutcome:
    """A two-call rollout whose last call asked one question and got one answer."""
    question = {"role": "user", "content": "fix f.py"}
    answer = {"role": "assistant", "content": "done"}
    trace = [
        {"call_index": 0, "status": 200, "started_at": 1.0, "ended_at": 2.0},
        {"call_index": 1, "status": 200, "started_at": 3.0, "ended_at": 5.0, "request": {"messages": [question]},
         "message": answer},
    ]  # fmt: skip
    return RolloutOutcome("t-1.0.0", "t-1", "ok", "", patch, 2, 0, 40, "", {"agent_s": 6.0}, trace)


def test_a_training_record_has_the_fields_the_trainer_wrote_and_reads_back_equal(tmp_path):
    record = RolloutRecord.from_outcome(
        outcome(),
        oracle_patch="+b\n",
        rewards={"tests_pass": 1.0, "format": math.nan},
        step=7,
        round=0,
        unscorable=None,
        advantage=0.5,
        informative=True,
        rows=2,
        trained_tokens=40,
    )
    path = write_rollouts(tmp_path / "rollouts" / STEP_FILE.format(7), [record])
    assert path.name == "step_0007.jsonl"
    line = path.read_text()
    written = json.loads(line)
    assert set(written) == TRAINING_FIELDS and written["unscorable"] is None and '"format": NaN' in line
    assert written["conversation"] == [
        {"role": "user", "content": "fix f.py"},
        {"role": "assistant", "content": "done"},
    ]
    (back,) = read_run_rollouts(tmp_path)
    assert back.model_dump(exclude={"rewards"}) == record.model_dump(exclude={"rewards"}) and back.edited
    assert back.rewards["tests_pass"] == 1.0 and math.isnan(back.rewards["format"])


def test_the_conversation_is_the_last_policy_calls_not_a_tagged_summarys():
    plain = outcome()
    summary = {"call_index": 2, "status": 200, "tag": "weak", "request": {"messages": [{"role": "user",
               "content": "summarise"}]}, "message": {"role": "assistant", "content": "a summary"}}  # fmt: skip
    record = RolloutRecord.from_outcome(replace(plain, trace=[*plain.trace, summary]), oracle_patch=None, rewards={},
                                        step=0)  # fmt: skip
    assert [m["content"] for m in record.conversation] == ["fix f.py", "done"]
    record = RolloutRecord.from_outcome(replace(plain, trace=[summary]), oracle_patch=None, rewards={}, step=0)
    assert [m["content"] for m in record.conversation] == ["summarise", "a summary"]


def test_an_evaluation_record_adds_the_runners_details():
    record = RolloutRecord.from_outcome(
        outcome(""), oracle_patch="+b\n", rewards={}, step=1, details=True, checkpoint="after", reward=0.0
    )
    assert set(record.as_json()) - TRAINING_FIELDS == {
        *("task_id", "failed_calls", "log_tail", "timings", "call_times", "checkpoint", "reward")
    }
    assert record.call_times == [(1.0, 2.0), (3.0, 5.0)] and not record.edited
    assert json.loads(json.dumps(record.as_json()))["call_times"] == [[1.0, 2.0], [3.0, 5.0]]


def test_a_file_written_before_the_record_was_typed_still_reads(tmp_path):
    """A training step's file as ``json.dumps`` wrote it (NaN rewards as ``NaN``, ``unscorable`` null), with a field
    a later version might add, and a blank line."""
    old = {
        "step": 3, "round": 1, "rollout_id": "t-1.3.0", "instance_id": "t-1", "status": "agent_error",
        "reason": "server down", "unscorable": "agent_error", "patch": "", "oracle_patch": "+b\n",
        "rewards": {"tests_pass": float("nan")}, "advantage": 0.0, "informative": False, "calls": 0,
        "completion_tokens": 0, "rows": 0, "trained_tokens": 0, "conversation": [], "added_later": 1,
    }  # fmt: skip
    scorable = {**old, "rollout_id": "t-1.3.1", "status": "ok", "unscorable": None, "rewards": {"tests_pass": 1.0}}
    folder = tmp_path / "rollouts"
    folder.mkdir()
    (folder / "step_0003.jsonl").write_text(json.dumps(old) + "\n\n" + json.dumps(scorable) + "\n")
    a, b = read_run_rollouts(tmp_path)
    assert (a.step, a.round, a.unscorable, a.informative, a.advantage) == (3, 1, "agent_error", False, 0.0)
    assert math.isnan(a.rewards["tests_pass"]) and b.unscorable is None and not b.edited
    again = write_rollouts(tmp_path / "again.jsonl", [a, b])
    expected = {k: v for k, v in scorable.items() if k != "added_later"}
    assert json.loads(again.read_text().splitlines()[1]) == expected  # the fields it was written with, no more
    assert "advantage 0.000" in render([a, b], "an earlier run")
    assert read_rollouts(tmp_path / "missing.jsonl") == []


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"step": 1, "rewards": {"x": "high"}}', r"step_0004.jsonl line 2: rewards.x: Input should be a valid number"),
        ('{"step": "one"}', r"line 2: step: Input should be a valid integer"),
        ("[1]", r"line 2: the line: Input should be a valid dictionary"),
        ('{"step": 1', r"line 2: not JSON"),
    ],
)
def test_a_bad_line_is_refused_naming_the_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "step_0004.jsonl"
    path.write_text('{"step": 4}\n' + line + "\n")
    with pytest.raises(RolloutRecordError, match=message):
        read_rollouts(path)

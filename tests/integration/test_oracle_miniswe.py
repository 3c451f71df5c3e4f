"""The oracle teacher with the real mini-swe-agent (text mode, its commands in the sandbox) through a real ``aitlrt-
serve``: ``aitlrt trajectories --agent mini-swe-agent --teacher oracle`` on two generated cachetools tasks, three
more that share one problem statement (told apart by the lines the inspection shows), and two SWE-smith webargs tasks
(multi-hunk fixes). Every rollout lists the source files, inspects, patches and submits, leaves exactly the oracle
fix and resolves its task (real grading: kept at weighted reward 1.5); every call is one row, as the proxy recorded
it, and ``aitlrt sft`` trains on the rows. The tool-calling mode is refused with the oracle."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from aitlrt.rollout.agents.mini_swe import TEST_ALIAS, miniswe_venv
from aitlrt.tasks.loader import load_tasks
from aitlrt.training.dataset import generated_tasks
from aitlrt.warmstart.oracle_shell import APPLY, SUBMIT, commands
from aitlrt.warmstart.sft import run_sft
from tests.conftest import cachetools_tasks

pytestmark = pytest.mark.skipif(not (miniswe_venv() / "bin" / "mini").exists(), reason="run jobs/setup.sh first")

SAME_STATEMENT = [  # three mutations whose failing tests, so problem statements, are the same
    "cachetools-8.0.1.invert_if__e0f47317",
    "cachetools-8.0.1.shuffle_statements__32de8d39",
    "cachetools-8.0.1.remove_assignment__5069170b",
]
WEBARGS = [  # core.py: two hunks; falconparser.py: three, re-adding methods
    "marshmallow-code__webargs.dbde72fe.pr_974",
    "marshmallow-code__webargs.dbde72fe.func_pm_class_rm_funcs__kw4zto9r",
]
ROW_KEYS = {"prompt", "completion", "instance_id", "rollout_id", "call_index", "reward", "teacher", "edit_format"}


def trajectories(*args: str | Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "aitlrt.cli", "trajectories", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


@pytest.fixture(scope="module")
def task_file(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tasks = load_tasks(cachetools_tasks(4), limit=2).tasks
    tasks += load_tasks(generated_tasks("pypi:cachetools==8.0.1", 31, 110), ids=set(SAME_STATEMENT)).tasks
    tasks += load_tasks(data_dir / "swesmith_webargs" / "tasks.jsonl", ids=set(WEBARGS)).tasks
    assert len(tasks) == 7 and len({t.problem_statement for t in tasks if t.instance_id in SAME_STATEMENT}) == 1
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text("".join(json.dumps(t.as_row()) + "\n" for t in tasks))
    return path


@pytest.mark.timeout(1500)
def test_mini_swe_agent_with_the_oracle_resolves_every_task_and_its_calls_train(task_file, tmp_path):
    out = tmp_path / "mini.jsonl"
    args = ["--tasks", task_file, "--agent", "mini-swe-agent", "--concurrency", "2", "--timeout", "300"]
    done = trajectories(*args, "--teacher", "oracle", "--out", out, "--serve-dir", tmp_path / "serve")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "7 rollouts, 7 kept (weighted reward >= 1.5)" in done.stdout, done.stdout[-4000:]  # resolved, oracle patch

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    records = [json.loads(line) for line in (tmp_path / "serve" / "calls.jsonl").read_text().splitlines()]
    answered = {(r["rollout_id"], r["call_index"]): r for r in records if r.get("status") == 200}
    assert len(rows) == len(answered) and all(set(row) == ROW_KEYS for row in rows)  # every call is a row
    by_task: dict[str, list[str]] = {}
    for row in sorted(rows, key=lambda r: (r["rollout_id"], r["call_index"])):
        record = answered[(row["rollout_id"], row["call_index"])]
        assert (row["teacher"], row["edit_format"], row["reward"]) == ("oracle", "shell", 1.5)
        assert row["prompt"] == record["request"]["messages"] and row["prompt"][0]["role"] == "system"
        assert row["completion"] == [{"role": "assistant", "content": record["text"]}]
        assert record["prompt_token_ids"] and record["logprobs"] == [0.0] * len(record["completion_token_ids"])
        (command,) = commands(record["text"])
        step = "submit" if command == SUBMIT else "apply" if command.startswith(APPLY) else command.split()[0]
        by_task.setdefault(row["instance_id"], []).append(step)
    assert len(by_task) == 7
    for instance_id, steps in by_task.items():
        inspections = len(steps) - 3  # one per file looked at: a task of its own, one; three alike, up to three
        assert steps == ["find", *["nl"] * inspections, "apply", "submit"], (instance_id, steps)
        assert 1 <= inspections <= (3 if instance_id in SAME_STATEMENT else 1), (instance_id, steps)
    assert [len(by_task[task_id]) - 3 for task_id in SAME_STATEMENT] == [1, 1, 1]  # one file: its listing tells
    # the three apart

    # webargs' files are read whole (up to 8,000 characters): their last rows pass the default 4,096 tokens
    result = run_sft(out, "bundled", tmp_path / "sft", max_steps=1, gradient_accumulation_steps=1, max_length=8192)
    assert (result.rows, result.dropped_too_long, result.steps) == (len(rows), 0, 1)
    assert all(math.isfinite(loss) for loss in result.losses)

    refused = trajectories(*args, "--agent", "mini-swe-agent-tools", "--teacher", "oracle", "--out", tmp_path / "t")
    assert refused.returncode != 0 and "not in tool calls" in refused.stderr


@pytest.mark.timeout(900)
def test_with_test_feedback_the_oracle_runs_the_tests_in_minis_shell_and_reads_them_pass(task_file, tmp_path):
    """``--test-feedback-rounds 1``: the task offers ``run-tests``; the oracle sends it after its fix, and the
    observation mini-swe-agent appends is the feedback program's grade of the work tree (no deciding test fails)."""
    two = tmp_path / "two.jsonl"
    two.write_text("".join(task_file.read_text().splitlines(keepends=True)[:2]))
    out, serve = tmp_path / "mini.jsonl", tmp_path / "serve"
    args = ["--tasks", two, "--agent", "mini-swe-agent", "--concurrency", "2", "--timeout", "300"]
    done = trajectories(*args, "--test-feedback-rounds", "1", "--teacher", "oracle", "--out", out, "--serve-dir", serve)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "2 rollouts, 2 kept (weighted reward >= 1.5)" in done.stdout, done.stdout[-4000:]
    records = [json.loads(line) for line in (serve / "calls.jsonl").read_text().splitlines()]
    by_rollout: dict[str, list[dict]] = {}
    for record in sorted((r for r in records if "call_index" in r), key=lambda r: r["call_index"]):
        by_rollout.setdefault(record["rollout_id"], []).append(record)
    assert len(by_rollout) == 2
    for calls in by_rollout.values():
        steps = [commands(c["text"])[0] for c in calls]
        assert steps[-2:] == [TEST_ALIAS, SUBMIT] and steps[-3].startswith(APPLY), steps
        assert f"`{TEST_ALIAS}`" in calls[0]["request"]["messages"][1]["content"], "the task offers the tests"
        observation = calls[-1]["request"]["messages"][-1]["content"]
        assert "<returncode>0</returncode>" in observation and "AITLRT test feedback: all " in observation, observation

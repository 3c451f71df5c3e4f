"""Multi-turn oracle trajectories with the real Aider agent (warm workers), a real ``aitlrt-serve`` and Aider's test
feedback on (the tests run in the grader's sandbox): on two generated cachetools tasks (their file given up front)
and a SWE-smith webargs task (none given: the oracle first asks for it), in the ``diff`` and ``whole`` formats,
``collect`` records each task's single-turn trajectory and a multi-turn one. In the multi-turn one the oracle
answers decoy first (a comment line that applies and fixes nothing), the real test output comes back in Aider's own
feedback turn, and the oracle's second answer, written against the file that now holds the decoy, leaves exactly
the oracle fix (real grading: resolved). Of it, only the fix's call becomes an SFT row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aitlrt.rollout.agents.aider import aider_venv
from aitlrt.rollout.batch import RolloutSettings
from aitlrt.tasks.feedback import HEADER
from aitlrt.tasks.loader import load_tasks
from aitlrt.warmstart.oracle import DECOY_COMMENT, decoy, feedback_turn, listed, render
from aitlrt.warmstart.oracle_server import fix_patch, oracle_task
from aitlrt.warmstart.trajectories import DEFAULT_REWARDS, Teacher, collect, policy_calls, reward_funcs
from tests.conftest import cachetools_tasks

pytestmark = pytest.mark.skipif(not (aider_venv() / "bin" / "aider").exists(), reason="run jobs/setup.sh first")

WEBARGS = "marshmallow-code__webargs.dbde72fe.func_pm_remove_cond__vz9appx6"
TASKS = 3


def journal(serve_dir: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The proxy's records by (rollout id, call index)."""
    records = [json.loads(line) for line in (serve_dir / "calls.jsonl").read_text().splitlines()]
    return {(r["rollout_id"], r["call_index"]): r for r in records if "call_index" in r}


@pytest.fixture(scope="module", params=["diff", "whole"])
def collected(request, tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp(f"multiturn-{request.param}")
    tasks = load_tasks(cachetools_tasks(4), limit=2).tasks
    tasks += load_tasks(data_dir / "swesmith_webargs" / "tasks.jsonl", ids={WEBARGS}).tasks
    assert [bool(t.files) for t in tasks] == [True, True, False]
    settings = RolloutSettings(edit_format=request.param, concurrency=2, timeout_s=300, test_feedback_rounds=1)
    funcs = reward_funcs(list(DEFAULT_REWARDS))
    report = collect(
        tasks, Teacher(), settings, funcs, list(DEFAULT_REWARDS.values()), 1.5, out / "t.jsonl", serve_dir=out
    )
    return request.param, report, out


def test_the_oracle_answers_decoy_first_then_the_fix_from_the_tests_output(collected):
    edit_format, report, serve_dir = collected
    assert report.multi_turn == [False] * TASKS + [True] * TASKS
    assert report.kept == [True] * 2 * TASKS
    assert report.kept_per_task() == {t.instance_id: (2, 2) for t in report.tasks[:TASKS]}
    records = {**journal(serve_dir), **journal(serve_dir / "multi-turn")}
    trained = set()  # the calls that must be SFT rows: (rollout id, call index)
    for i, (task, outcome, multi) in enumerate(zip(report.tasks, report.outcomes, report.multi_turn, strict=True)):
        why = f"{task.instance_id} ({'multi' if multi else 'single'}): {outcome.reason}\n{outcome.log_tail[-3000:]}"
        assert outcome.status == "ok", why
        oracle = oracle_task(task)
        assert outcome.patch == fix_patch(oracle), why + outcome.patch  # the oracle fix exactly
        assert report.rewards["tests_pass"][i] == report.rewards["patch_similarity"][i] == 1.0, why
        calls = list(policy_calls(outcome))
        asked = [] if task.files else calls[:1]  # "Please add <file>": Aider adds it and asks again
        assert all(call["text"].startswith("Please add ") for call in asked)
        if not multi:  # the fix at once: the tests pass, no feedback turn
            (call,) = calls[len(asked) :]
            assert call["text"] == render(oracle.files, edit_format) and not feedback_turn(call["request"]["messages"])
            trained.update((outcome.rollout_id, c["call_index"]) for c in calls)
            continue
        first, second = calls[len(asked) :]  # the decoy, then (the tests' output back) the fix
        (decoyed,) = decoy(oracle)
        assert DECOY_COMMENT in decoyed.after
        assert first["text"] == render([decoyed], edit_format) and not feedback_turn(first["request"]["messages"])
        messages = second["request"]["messages"]
        assert feedback_turn(messages) and messages[-1]["role"] == "user"
        output = messages[-1]["content"]
        assert f"\n{HEADER} " in output and "tests fail; sandbox:" in output, output  # the real tests' failures
        # the decoy stays in the conversation (Aider strips its last newline)
        assert {"role": "assistant", "content": first["text"].rstrip()} in messages
        shown = [listed(m["content"], decoyed.path, decoyed.after) for m in messages if m["role"] == "user"]
        assert next(s for s in shown if s)[1] == decoyed.after  # the file as it now is, holding the decoy
        trained.add((outcome.rollout_id, second["call_index"]))

    rows = [json.loads(line) for line in report.out.read_text().splitlines()]
    # single-turn: every call; multi-turn: the fix's only
    assert len(rows) == report.calls_written == (2 + 1 + 1) + 3 * 1
    assert {(row["rollout_id"], row["call_index"]) for row in rows} == trained
    for row in rows:
        record = records[(row["rollout_id"], row["call_index"])]
        assert row["prompt"] == record["request"]["messages"]
        assert row["completion"] == [{"role": "assistant", "content": record["text"]}]


def test_the_trajectories_command_adds_multi_turn_rollouts_with_test_feedback(tmp_path):
    tasks = cachetools_tasks(4)
    out = tmp_path / "t.jsonl"
    cmd = [sys.executable, "-m", "aitlrt.cli", "trajectories", "--tasks", str(tasks), "--limit", "1"]
    cmd += ["--edit-format", "diff", "--test-feedback-rounds", "1", "--teacher", "oracle"]
    cmd += ["--out", str(out), "--serve-dir", str(tmp_path / "serve"), "--timeout", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 rollouts, 2 kept (weighted reward >= 1.5), 2 calls written" in done.stdout
    assert "multi (decoy first)" in done.stdout and ": 2/2" in done.stdout
    single, multi = (json.loads(line) for line in out.read_text().splitlines())
    assert (single["call_index"], feedback_turn(single["prompt"])) == (0, False)
    assert (multi["call_index"], feedback_turn(multi["prompt"])) == (1, True)
    assert (tmp_path / "serve" / "multi-turn" / "calls.jsonl").is_file()

"""The test feedback (``aitlrt.tasks.feedback``) with the real Aider on a real generated cachetools task, through a
real ``aitlrt-serve``: a scripted teacher answers the task's prompt with an edit that applies and fixes nothing,
and, once the chat holds the tests' output, with the oracle fix; the tests run in the grader's sandbox, their real
failures reach the second prompt, the rollout ends resolved, its two calls make token-exact training rows, and the
run report shows the whole exchange: the first answer, the tests' output, the fix."""

from __future__ import annotations

import html
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from aitlrt.common.git import git
from aitlrt.common.procs import free_port
from aitlrt.common.workspace import WorkspacePool
from aitlrt.report.html import write_report
from aitlrt.rollout.agents.aider import aider_venv
from aitlrt.rollout.batch import RolloutSettings, agent_task, prepare_tasks, run_batch
from aitlrt.rollout.record import RolloutRecord
from aitlrt.serving.process import ServeProcess
from aitlrt.tasks import patches
from aitlrt.tasks.feedback import HEADER, failure_report
from aitlrt.tasks.grading import grade
from aitlrt.tasks.loader import load_tasks
from aitlrt.tasks.task import Task
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.rows import build_rows
from aitlrt.warmstart import oracle_server
from aitlrt.warmstart.oracle import render
from aitlrt.warmstart.oracle_server import oracle_task
from tests.conftest import cachetools_tasks

pytestmark = pytest.mark.skipif(not (aider_venv() / "bin" / "aider").exists(), reason="run jobs/setup.sh first")

ROUNDS = 2
COMMENT = "# looked at this file first"


@pytest.fixture(scope="module")
def task() -> Task:
    """A generated cachetools task whose files are given up front (one call per answer, no "please add")."""
    tasks = load_tasks(cachetools_tasks(4), limit=4).tasks
    return next(t for t in tasks if len(t.files) == 1 and patches.changed_paths(t.patch) == list(t.files))


def _wrong_edit(task: Task) -> str:
    """A SEARCH/REPLACE edit that applies and fixes nothing: a comment above the file's first line."""
    (path,) = task.files
    repo, base = task.checkout()
    first = git("show", f"{base}:{path}", cwd=repo).splitlines()[0]
    return f"{path}\n```python\n<<<<<<< SEARCH\n{first}\n=======\n{COMMENT}\n{first}\n>>>>>>> REPLACE\n```\n"


def _text(messages: list[dict[str, Any]]) -> str:
    return json.dumps(messages)


def _feedback(messages: list[dict[str, Any]]) -> str:
    """The last test feedback in ``messages``, from its header on."""
    content = next(m["content"] for m in reversed(messages) if HEADER in str(m.get("content")))
    return content[content.index(HEADER) :]


@pytest.fixture(scope="module")
def teacher(task: Task):
    """The oracle server answering the wrong edit until the chat holds the tests' output, then the oracle fix."""
    wrong, fix = _wrong_edit(task), render(oracle_task(task).files, "diff")
    patcher = pytest.MonkeyPatch()
    patcher.setattr(
        oracle_server, "answer", lambda tasks, messages, *_, **__: fix if HEADER in _text(messages) else wrong
    )
    try:
        with oracle_server.oracle_server([task], "diff") as url:
            yield url
    finally:
        patcher.undo()


@pytest.fixture(scope="module", params=["aider-warm", "aider"])
def rollout(request, task, teacher, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp(f"serve-{request.param}")
    proxy = ServeProcess(["--upstream", teacher, "--run-dir", str(run_dir)], free_port(), run_dir / "serve.log")
    proxy.start()
    try:
        proxy.wait_ready(timeout_s=60)
        settings = RolloutSettings(
            agent=request.param, edit_format="diff", concurrency=1, timeout_s=300, max_calls=4,
            test_feedback_rounds=ROUNDS,
        )  # fmt: skip
        batch = run_batch(prepare_tasks([task]), proxy.url, settings, model=oracle_server.ORACLE_MODEL)
    finally:
        proxy.stop()
    (outcome,) = batch.outcomes
    return request.param, settings, outcome


def _policy_calls(outcome) -> list[dict[str, Any]]:
    return [c for c in sorted(outcome.trace, key=lambda c: c["call_index"]) if not c.get("tag")]


def test_the_tests_failures_reach_the_second_call_and_the_fix_resolves(rollout, task):
    agent, _, outcome = rollout
    why = f"{agent}: {outcome.status} {outcome.reason}\n{outcome.log_tail[-3000:]}"
    assert outcome.status == "ok", why
    calls = _policy_calls(outcome)
    assert len(calls) == 2, why
    first = _text(calls[0]["request"]["messages"])
    assert HEADER not in first and "aitlrt.tasks.feedback" in first  # Aider's system prompt names the command
    # the real failure output of the task's tests, from the wrong edit: the header, then a failing test by id
    feedback = _feedback(calls[1]["request"]["messages"])
    headline = feedback.splitlines()[0]
    failing = task.fail_to_pass
    assert f"{len(failing)} of {len(failing) + len(task.pass_to_pass)} tests fail" in headline, headline
    assert any(f"FAILED {t}" in feedback for t in failing), feedback[:3000]
    # in the grader's sandbox, as the final grade: the same isolation, which is one
    final = grade(task, outcome.patch)
    assert final.resolved, final.reason
    assert final.isolation and not final.isolation.startswith("none")
    assert headline.endswith(f"; sandbox: {final.isolation}"), headline
    # the final patch: the comment of the first answer, then the fix
    assert COMMENT in outcome.patch
    print(f"\n{agent}: {len(outcome.trace)} calls ({len(calls)} policy), {outcome.timings}\n{headline}")


def test_the_feedback_file_holds_nothing_of_the_fix(rollout, task):
    _, settings, _ = rollout
    command = agent_task(task, settings).test_command
    text = Path(command[-1]).read_text()
    spec = json.loads(text)
    assert set(spec["inputs"]) == {
        "instance_id", "repo", "base", "env", "test_patch", "fail_to_pass", "pass_to_pass", "targets",
    }  # fmt: skip
    fixed = [line[1:] for line in task.patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert task.patch not in text and task.setup_patch not in text
    assert not [line for line in fixed if len(line.strip()) > 8 and json.dumps(line)[1:-1] in text]
    assert os.stat(command[-1]).st_mode & 0o022 == 0  # nobody else writes it


def test_the_rows_of_a_feedback_rollout_are_token_exact(rollout):
    agent, _, outcome = rollout
    calls = _policy_calls(outcome)
    rows, stats = build_rows(outcome.trace)
    assert stats.used_calls == len(calls) == sum(row.calls for row in rows)
    taken = iter(calls)
    for row in rows:
        mine = [next(taken) for _ in range(row.calls)]
        sampled = [t for t, m in zip(row.completion_ids, row.mask, strict=True) if m]
        assert sampled == [t for c in mine for t in c["completion_token_ids"]]
        assert row.prompt_ids == mine[0]["prompt_token_ids"]
    sizes = [(len(r.prompt_ids), r.sampled, len(r.completion_ids) - r.sampled) for r in rows]
    print(f"\n{agent}: {len(rows)} rows for {len(calls)} calls; (prompt, sampled, context) tokens per row: {sizes}")
    # Aider moves the first exchange into the history, before the files, once the edit is applied: the second
    # prompt does not extend the first call's tokens, so each call starts its own row
    assert len(rows) == 2


def test_the_report_shows_the_multi_turn_rollout_with_its_test_output(rollout, task, tmp_path):
    agent, _, outcome = rollout
    record = RolloutRecord.from_outcome(outcome, oracle_patch=task.patch, rewards={"tests_pass": 1.0}, step=1)
    roles = [m["role"] for m in record.conversation]
    assert roles.count("assistant") >= 2, roles  # the first answer in the history, the fix as the answer
    page = write_report([record], tmp_path / "report.html", f"feedback {agent}").read_text()
    calls = _policy_calls(outcome)
    feedback = _feedback(calls[1]["request"]["messages"])
    failed = next(line for line in feedback.splitlines() if line.startswith("FAILED "))
    shown = [html.escape(text) for text in (COMMENT, feedback.splitlines()[0], failed, calls[1]["message"]["content"])]
    conversation = page[page.index('<details class="conv">') :]  # after the diffs, which hold the comment too
    missing = [text for text in shown if text not in conversation]
    assert not missing, missing
    # in that order: the wrong edit, the tests' output, the fix
    at = [conversation.index(text) for text in shown[:3]] + [conversation.rindex(shown[3])]
    assert at == sorted(at), at


def test_the_command_counts_its_rounds_and_ignores_the_repository_on_its_path(task, tmp_path):
    settings = RolloutSettings(test_feedback_rounds=1)
    command = list(agent_task(task, settings).test_command)
    pool = WorkspacePool(tmp_path / "ws", max_idle=0)
    repo, base = task.checkout()
    try:
        with pool.workspace(repo, base) as ws:
            # a module of the agent's that would shadow ours if the repository were on Python's path
            (ws.repo / "aitlrt").mkdir()
            (ws.repo / "aitlrt" / "__init__.py").write_text("print('HIJACKED'); raise SystemExit(0)\n")
            env = {"PATH": os.environ["PATH"], "HOME": str(ws.scratch)}  # as Aider's: none of ours
            runs = [subprocess.run(command, cwd=ws.repo, env=env, capture_output=True, text=True) for _ in range(2)]
            elsewhere = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    finally:
        pool.close()
    first, second = runs
    assert first.returncode == 1 and "HIJACKED" not in first.stdout, first.stdout + first.stderr
    assert first.stdout.startswith(f"{HEADER} {len(task.fail_to_pass)} of "), first.stdout
    assert len(first.stdout) < 3000 + 300 and not first.stderr
    assert second.returncode == 0 and second.stdout.startswith(f"{HEADER} no test round left (1 used)"), second.stdout
    assert elsewhere.returncode == 1 and elsewhere.stdout.startswith(f"{HEADER} no test result: "), elsewhere.stdout


def test_failure_report_keeps_the_first_tracebacks_and_the_failing_tests():
    failures = [f"{'_' * 50} test_{i} {'_' * 50}\n" + "\n".join(f"line {i}.{j}" for j in range(30)) for i in range(20)]
    summary = [f"FAILED tests/test_x.py::test_{i} - AssertionError: {i}" for i in range(20)]
    output = "\n".join(
        ["collected 25 items", "tests/test_x.py FFFF.....", f"{'=' * 40} FAILURES {'=' * 40}", *failures,
         f"{'=' * 30} short test summary info {'=' * 30}", "PASSED tests/test_x.py::test_ok", *summary,
         f"{'=' * 30} 20 failed, 5 passed in 0.52s {'=' * 30}"]
    )  # fmt: skip
    report = failure_report(output, 3000)
    assert len(report) <= 3000
    assert report.startswith("=== FAILURES ===\n___ test_0 ___\nline 0.0\n")
    assert "more lines of tracebacks cut]" in report and "PASSED" not in report
    assert summary[0] in report and report.endswith("\n=== 20 failed, 5 passed in 0.52s ===")
    assert failure_report(output, 100_000).count("FAILED ") == 20
    assert failure_report("ImportError: no module named x\n", 3000) == "ImportError: no module named x"


def test_too_few_calls_for_the_rounds_are_refused():
    with pytest.raises(ValueError, match="test_feedback_rounds 3 needs at least 4"):
        RolloutSettings(max_calls=3, test_feedback_rounds=3)
    with pytest.raises(ValueError, match="test_feedback_rounds must be >= 0"):
        RolloutSettings(test_feedback_rounds=-1)
    with pytest.raises(ValueError, match="rollout_max_calls"):
        AgentGRPOConfig(output_dir="/tmp/unused", rollout_max_calls=2, test_feedback_rounds=2)
    settings = AgentGRPOConfig(output_dir="/tmp/unused", test_feedback_rounds=2).rollout_settings()
    assert (settings.test_feedback_rounds, settings.test_feedback_max_chars) == (2, 3000)

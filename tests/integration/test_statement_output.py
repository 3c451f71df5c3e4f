"""The failing tests' output in the problem statement (``RolloutSettings.statement_test_output``, SWE-smith's
failing assertion): the real Aider on a real generated cachetools task through a real ``aitlrt-serve``, answered by
the oracle teacher; the tests ran once at the task's start, in the grader's sandbox, and their failures reach the
first prompt."""

from __future__ import annotations

import re

import pytest

from aitlrt.common.procs import free_port
from aitlrt.rollout.agents.aider import aider_venv
from aitlrt.rollout.batch import RolloutSettings, agent_task, prepare_tasks, run_batch
from aitlrt.serving.process import ServeProcess
from aitlrt.tasks import feedback
from aitlrt.tasks.feedback import HEADER, STATEMENT_HEADER, starting_failures
from aitlrt.tasks.grading import grade
from aitlrt.tasks.loader import load_tasks
from aitlrt.tasks.task import Task
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.warmstart import oracle_server
from tests.conftest import cachetools_tasks

pytestmark = pytest.mark.skipif(not (aider_venv() / "bin" / "aider").exists(), reason="run jobs/setup.sh first")

CHARS = 1500


@pytest.fixture(scope="module")
def task() -> Task:
    return load_tasks(cachetools_tasks(2), limit=1).tasks[0]


def test_the_statement_holds_the_start_s_failures_and_is_the_same_every_time(task, tmp_path, monkeypatch):
    monkeypatch.setattr(feedback, "aitlrt_home", lambda: tmp_path)  # no statement cached yet
    text = starting_failures(task, CHARS)
    assert 0 < len(text) <= CHARS
    failed = {line.split(" - ")[0].removeprefix("FAILED ") for line in text.splitlines() if line.startswith("FAILED")}
    assert failed and failed <= set(task.fail_to_pass), text  # the broken tests, none of those still passing
    assert HEADER not in text  # the oracle teacher tells a test-feedback turn by its header: the statement has none
    assert not re.search(r"\b0x[0-9a-f]{6,}\b", text) and not re.search(r" in [\d.]+s =", text)
    (cached,) = (tmp_path / "statements").iterdir()
    cached.unlink()  # run again: the same text (addresses and durations blanked)
    assert starting_failures(task, CHARS) == text
    statement = agent_task(task, RolloutSettings(statement_test_output=CHARS)).instruction
    assert statement == f"{task.problem_statement}\n\n{STATEMENT_HEADER}\n```\n{text}\n```"
    assert agent_task(task, RolloutSettings()).instruction == task.problem_statement


def test_aider_s_first_prompt_holds_the_failures_and_the_oracle_fix_resolves(task, tmp_path):
    settings = RolloutSettings(
        agent="aider-warm", edit_format="diff", concurrency=1, timeout_s=300, max_calls=1,
        statement_test_output=CHARS,
    )  # fmt: skip
    with oracle_server.oracle_server([task], "diff") as teacher:
        proxy = ServeProcess(["--upstream", teacher, "--run-dir", str(tmp_path)], free_port(), tmp_path / "serve.log")
        proxy.start()
        try:
            proxy.wait_ready(timeout_s=60)
            batch = run_batch(prepare_tasks([task]), proxy.url, settings, model=oracle_server.ORACLE_MODEL)
        finally:
            proxy.stop()
    (outcome,) = batch.outcomes
    assert outcome.status == "ok", f"{outcome.status} {outcome.reason}\n{outcome.log_tail[-3000:]}"
    (call,) = [c for c in outcome.trace if not c.get("tag")]
    prompt = "\n".join(str(m["content"]) for m in call["request"]["messages"])
    assert STATEMENT_HEADER in prompt and starting_failures(task, CHARS) in prompt
    final = grade(task, outcome.patch)
    assert final.resolved, final.reason


def test_a_negative_size_is_refused_and_the_config_passes_it_on():
    with pytest.raises(ValueError, match="statement_test_output must be >= 0"):
        RolloutSettings(statement_test_output=-1)
    config = AgentGRPOConfig(output_dir="/tmp/unused", statement_test_output=CHARS)
    assert config.rollout_settings().statement_test_output == CHARS

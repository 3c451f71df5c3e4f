"""Per-step metrics reach trl's ``report_to`` (wandb, offline here) under the names the step table shows, and
``OUTPUT/metrics.jsonl`` (``MetricsLog``); the run report renders whatever parts of a run exist."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from aitlrt.evaluation.checkpoints import CheckpointResult, write_results
from aitlrt.report import metric_names as names
from aitlrt.report.html import diff_lines, render, write_run_report
from aitlrt.report.metrics_file import read_metrics
from aitlrt.report.metrics_log import MetricsLog
from aitlrt.rollout.batch import Batch
from aitlrt.rollout.record import RolloutRecord, read_rollouts, write_rollouts
from aitlrt.rollout.runner import RolloutOutcome
from aitlrt.tasks.task import task_from_row
from tests.helpers.multirank_run import tiny_trainer


def test_step_metrics_reach_wandb_offline(scripted_upstream, start_proxy, make_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    repo = make_repo({"README": "tiny\n"})
    trainer = tiny_trainer(
        start_proxy(scripted_upstream).url,
        str(repo),
        str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=4,
        report_to=["wandb"],
        run_name="aitlrt-test",
    )
    trainer.train()
    import wandb

    wandb.finish()
    (record,) = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    expected = [
        names.reward_stat("calls_reward", "median"),
        names.CALLS_MEAN,
        names.ZERO_VARIANCE_GROUPS,
        names.TIME_ROLLOUTS,
        names.ROWS,
        names.WEIGHT_VERSION,
    ]
    deadline = time.monotonic() + 60  # wandb's service process writes the run file after finish() returns
    while not all(n.encode() in record.read_bytes() for n in expected) and time.monotonic() < deadline:
        time.sleep(0.5)
    missing = [n for n in expected if n.encode() not in record.read_bytes()]
    assert not missing, missing
    logged = trainer.state.log_history[0]
    assert logged[names.CALLS_MEAN] == 1.5 and logged[names.ROWS] == 6  # 1- and 2-call rollouts, alternately


# ---- metrics.jsonl and the run report (no browser: tests/integration/test_report_browser.py loads it in one) ----
def _state(step: int, main: bool = True) -> SimpleNamespace:
    return SimpleNamespace(is_world_process_zero=main, global_step=step)


def test_metrics_log_appends_each_log_and_restarts_with_the_run(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    log = MetricsLog(path)
    log.on_train_begin(None, _state(0), None)
    for step in (1, 2, 3):
        log.on_log(None, _state(step), None, logs={"reward": step / 10, "loss": float("nan")})
        MetricsLog(path).on_log(None, _state(step, main=False), None, logs={"reward": 9.0})  # other ranks: nothing
    log.on_log(None, _state(3), None, logs={"train_runtime": 12.5})
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    assert first == {"reward": 0.1, "loss": None, "step": 1, "elapsed_s": first["elapsed_s"]}  # NaN: null
    assert [e["step"] for e in map(json.loads, lines)] == [1, 2, 3, 3]
    assert 0 <= first["elapsed_s"] <= json.loads(lines[-1])["elapsed_s"] < 60
    with open(path, "a") as fh:
        fh.write('{"reward": 0.5, "st')  # a run killed mid-write
    last = read_metrics(path)[-1]
    assert last == {"reward": 0.3, "loss": None, "step": 3, "train_runtime": 12.5, "elapsed_s": last["elapsed_s"]}

    log.on_train_begin(None, _state(2), None)  # resumed at step 2: steps 3+ will be logged again
    assert [e["step"] for e in read_metrics(path)] == [1, 2]
    log.on_train_begin(None, _state(0), None)  # a new run in the same folder
    assert path.read_text() == "" and read_metrics(tmp_path / "missing.jsonl") == []


def test_diff_lines_are_classed_by_their_hunk_headers():
    patch = (
        "--- a/one.sql\n+++ b/one.sql\n@@ -1,2 +1,2 @@\n--- a comment\n+-- a new comment\n select 1;\n"
        "--- a/two.py\n+++ b/two.py\n@@ -0,0 +1 @@\n+x = 1\n\\ No newline at end of file\n"
    )
    kinds = [kind for kind, _ in diff_lines(patch)]
    assert kinds == ["meta", "meta", "hunk", "del", "add", "ctx", "meta", "meta", "hunk", "add", "meta"]


def _rollout(step: int, patch: str, tests: float, **extra) -> RolloutRecord:
    return RolloutRecord(step=step, rollout_id=f"r{step}", instance_id="t-1", status="ok", patch=patch,
                         rewards={"tests_pass": tests, "patch_similarity": 0.5}, **extra)  # fmt: skip


def test_the_report_renders_whatever_part_of_a_run_there_is(tmp_path):
    records = [_rollout(s, "+x\n" if s % 2 else "", float(s % 2)) for s in range(30)]
    only_rollouts = render(records, "r")
    assert 'id="curves"' in only_rollouts and "no metrics.jsonl" in only_rollouts
    assert 'class="smooth" data-series="rollouts/non_empty_patch_rate"' in only_rollouts  # 30 points: averaged
    assert "none (heldout/rollouts.jsonl)" in only_rollouts and "(not recorded)" in only_rollouts  # no oracle
    assert "the rollouts of 12 of 30 steps" in only_rollouts and only_rollouts.count("<details>") == 12
    assert "step 0:" in only_rollouts and "step 29:" in only_rollouts

    only_metrics = render([], "m", metrics=[{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}])
    assert (
        'data-chart="loss"' in only_metrics and "none saved" in only_metrics and "held-out evaluation" in only_metrics
    )
    assert "data-headline" not in only_metrics  # no reward, resolve or edit rate to compare

    heldout = [_rollout(0, "", 0.0, checkpoint="before"), _rollout(1, "+y\n", 1.0, checkpoint="after")]
    evaluation = render([], "e", heldout=heldout)  # aitlrt eval's page
    assert 'id="curves"' not in evaluation and 'id="rollouts"' not in evaluation
    assert 'class="note"' not in evaluation and evaluation.count("<details>") == 2
    assert 'data-headline="held-out resolve rate"' in evaluation

    with pytest.raises(FileNotFoundError, match="not a training run"):
        write_run_report(tmp_path)
    (tmp_path / "heldout").mkdir()
    write_rollouts(tmp_path / "heldout" / "rollouts.jsonl", heldout)
    assert write_run_report(tmp_path).read_text().count('class="checkpoints"') == 1


def test_eval_results_carry_the_oracle_and_render_as_a_before_after_table(tmp_path):
    oracle = "--- a/f.py\n+++ b/f.py\n@@ -1 +1 @@\n-a\n+b\n"
    task = task_from_row(
        {"instance_id": "t-1", "problem_statement": "fix", "repo_path": str(tmp_path), "patch": oracle}
    )
    results = [
        CheckpointResult(
            label,
            Batch([task], [RolloutOutcome(f"{label}-0", "t-1", "ok", "", patch, 1, 0, 5, "")]),
            {"tests_pass": [tests], "non_empty_patch": [float(bool(patch))]},
            {},
        )
        for label, patch, tests in (("before", "", 0.0), ("after", oracle, 1.0))
    ]
    rollouts, report = write_results(results, tmp_path / "eval", {"tests_pass": 2.0, "non_empty_patch": 0.5})
    records = [json.loads(line) for line in rollouts.read_text().splitlines()]
    assert [(r["checkpoint"], r["oracle_patch"], r["reward"]) for r in records] == [
        ("before", oracle, 0.0),
        ("after", oracle, 2.5),
    ]
    assert set(records[0]) == {  # as before the record was typed: the runner's summary and the report's fields
        *("rollout_id", "task_id", "status", "reason", "patch", "calls", "failed_calls", "completion_tokens"),
        *("log_tail", "timings", "call_times", "checkpoint", "instance_id", "oracle_patch", "step", "conversation"),
        *("rewards", "reward"),
    }
    assert read_rollouts(rollouts)[1].reward == 2.5
    page = report.read_text()
    assert page.count("<details>") == 2 and '<tr data-checkpoint="after">' in page
    assert '<td data-metric="resolve rate">1.000</td>' in page and '<div class="dl add">+b</div>' in page
    assert '<td data-metric="weighted reward">2.500</td>' in page

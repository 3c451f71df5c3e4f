"""Per-step metrics reach trl's ``report_to`` (wandb, offline here) under the names the step table shows."""

from __future__ import annotations

import time

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
    names = [
        "rewards/calls_reward/median",
        "rollouts/calls_mean",
        "zero_variance_groups",
        "time/rollouts_s",
        "rows/count",
        "weight_version",
    ]
    deadline = time.monotonic() + 60  # wandb's service process writes the run file after finish() returns
    while not all(n.encode() in record.read_bytes() for n in names) and time.monotonic() < deadline:
        time.sleep(0.5)
    missing = [n for n in names if n.encode() not in record.read_bytes()]
    assert not missing, missing
    logged = trainer.state.log_history[0]
    assert logged["rollouts/calls_mean"] == 1.5 and logged["rows/count"] == 6  # 1- and 2-call rollouts, alternately

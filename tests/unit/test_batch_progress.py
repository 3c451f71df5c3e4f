"""A batch of rollouts run from library code (the held-out evaluations of a training run, the warm start's teacher
rollouts, the benchmarks) reports its progress in the log: never silent for minutes, never a line per event."""

from __future__ import annotations

import logging

from aitlrt.rollout import batch
from aitlrt.rollout.runner import Progress


def test_progress_is_logged_at_most_every_interval_and_when_the_last_rollout_is_done(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(batch.time, "monotonic", lambda: clock[0])
    show = batch.log_progress(every_s=30)
    progress = Progress(total=3, started=100.0)
    caplog.set_level(logging.INFO, logger=batch.__name__)
    for seconds, done in ((1, 0), (10, 1), (31, 1), (40, 2), (45, 3)):
        clock[0] = 100.0 + seconds
        progress.done = done
        show(progress)
    lines = [r.getMessage() for r in caplog.records if r.name == batch.__name__]
    assert lines == [
        "rollouts 1/3 done, 0 running | 0 with a patch, 0 failed outside the policy | 0 calls, 0.0 tok/s | 31s",
        "rollouts 3/3 done, 0 running | 0 with a patch, 0 failed outside the policy | 0 calls, 0.0 tok/s | 45s",
    ]

"""Where a batch of rollouts spent its time (``aitlrt.rollout.timing``), on crafted summaries."""

from __future__ import annotations

import pytest

from aitlrt.rollout.timing import busy_seconds, time_split


def test_busy_seconds_is_the_union_of_the_intervals():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7), (10, 10)]) == pytest.approx(4.0)
    assert busy_seconds([(5, 6), (0, 10)]) == pytest.approx(10.0)


def test_time_split_of_two_overlapping_rollouts():
    summaries = [
        {"timings": {"queue_s": 0, "workspace_s": 0.2, "agent_s": 10, "diff_s": 0.1}, "call_times": [(0, 4), (6, 8)]},
        {"timings": {"queue_s": 1, "workspace_s": 0.4, "agent_s": 5, "diff_s": 0.3}, "call_times": [(3, 7)]},
    ]
    split = time_split(summaries)
    assert split["model_busy_s"] == pytest.approx(8.0)  # 0-8 covered
    assert split["agent_outside_calls_s"] == pytest.approx((10 - 6 + 5 - 4) / 2)
    assert (split["workspace_s"], split["diff_s"], split["queue_s"]) == pytest.approx((0.3, 0.2, 0.5))
    assert time_split([]) == {}

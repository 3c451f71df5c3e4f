"""Where a batch of rollouts spent its wall time (pure functions over ``RolloutOutcome.summary()`` dicts).

- model busy: the time at least one model call of the batch was in flight at the proxy (the union of the calls'
  recorded ``started_at``/``ended_at``): what the server had to do, with its own queueing and batching inside;
- agent outside calls: each agent's run minus its own calls (the agent's start-up, prompt building, edits, shell);
- workspace (copy or reset of the repository), diff (``git diff`` of the result), queue (waiting for a free agent
  slot): per rollout, from the runner's timings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import fmean
from typing import Any


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def call_intervals(summary: dict[str, Any]) -> list[tuple[float, float]]:
    """The recorded ``(started_at, ended_at)`` of a rollout's calls (``summary["call_times"]``)."""
    return [(float(a), float(b)) for a, b in summary.get("call_times", []) if b >= a]


def time_split(summaries: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The batch's model-busy seconds and the per-rollout means of the rest (module docstring); {} for none."""
    if not summaries:
        return {}
    intervals = [iv for s in summaries for iv in call_intervals(s)]
    outside = [max(0.0, s["timings"].get("agent_s", 0.0) - sum(b - a for a, b in call_intervals(s))) for s in summaries]
    return {
        "model_busy_s": busy_seconds(intervals),
        "agent_outside_calls_s": fmean(outside),
        "workspace_s": fmean(s["timings"].get("workspace_s", 0.0) for s in summaries),
        "diff_s": fmean(s["timings"].get("diff_s", 0.0) for s in summaries),
        "queue_s": fmean(s["timings"].get("queue_s", 0.0) for s in summaries),
    }

"""Pipelined steps (``max_staleness`` 1): the next step's first round of rollouts runs in the background while the
trainer updates on this step's rows.

Only the rank's own rollouts (agents, their model calls, grading as each ends) run in the background: everything
with a collective (gathered rewards, advantages, rows, the weight sync) stays on the training thread, in the same
order on every rank. The trainer joins the background rollouts before it syncs weights, so a sync never cuts an
in-flight call, and before a step uses them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from aitlrt.rollout.runner import RolloutOutcome

log = logging.getLogger(__name__)


class BackgroundRolloutError(RuntimeError):
    """The rollouts that ran ahead in the background failed (outside any single rollout: those become failed
    rollouts with their reason)."""


@dataclass
class Ahead:
    inputs: list[dict[str, Any]]
    """The generation batch it rolls out (this rank's rows)."""
    step: int
    """The training step it is for (1-based)."""
    version: int
    """The weight version the server had when it started."""
    future: Future[list[RolloutOutcome]]


@dataclass
class Taken:
    outcomes: list[RolloutOutcome]
    version: int
    waited_s: float
    """How long the training thread waited for them (0 when they had ended)."""


class RolloutsAhead:
    """At most one batch of rollouts running ahead of the training thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts-ahead")
        self._ahead: Ahead | None = None

    def start(self, inputs: list[dict[str, Any]], step: int, version: int, rollouts: Callable[[], Any]) -> None:
        """Run ``rollouts()`` (the outcomes of ``inputs``) in the background."""
        if self._ahead is not None:
            raise RuntimeError(f"rollouts for step {self._ahead.step} are already running ahead")
        self._ahead = Ahead(inputs, step, version, self._pool.submit(rollouts))
        log.debug("step %d: %d rollouts started ahead with weight version %d", step, len(inputs), version)

    def wait(self) -> float:
        """Wait until the background rollouts end (keeping their outcomes); the seconds waited."""
        if self._ahead is None:
            return 0.0
        started = time.monotonic()
        wait([self._ahead.future])
        return time.monotonic() - started

    def take(self, inputs: list[dict[str, Any]], step: int) -> Taken | None:
        """The outcomes of the rollouts that ran ahead for ``step`` on ``inputs`` (waiting for them), or None when
        none did; rollouts that ran ahead for other inputs are dropped (logged). Their failure is raised here,
        as ``BackgroundRolloutError`` with its reason."""
        if self._ahead is None:
            return None
        waited = self.wait()
        ahead, self._ahead = self._ahead, None
        try:
            outcomes = ahead.future.result()
        except Exception as exc:
            raise BackgroundRolloutError(f"the rollouts run ahead for step {ahead.step} failed: {exc!r}") from exc
        if ahead.step != step or ahead.inputs != inputs:
            log.warning("rollouts run ahead for step %d were not for this batch (step %d): dropped", ahead.step, step)
            return None
        return Taken(outcomes, ahead.version, waited)

    def close(self) -> None:
        """Wait for rollouts still running (bounded by the rollout timeout) and stop the background thread."""
        self.wait()
        self._ahead = None
        self._pool.shutdown(wait=True)

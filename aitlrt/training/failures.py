"""Failures outside the policy that stop a run: after ``max_unscorable_steps`` consecutive training steps in which
every rollout was unscorable (a dead or hung server, a grader or a reward function failing on every rollout), the
run ends with ``UnscorableStepsError``, naming the rollouts' reasons and what the server's ``/health`` says, rather
than skipping every update until ``max_steps``."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import httpx

from aitlrt.rollout.runner import RolloutOutcome

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0


class UnscorableStepsError(RuntimeError):
    """Every rollout of ``max_unscorable_steps`` consecutive training steps was unscorable."""


def unscorable_reason(outcome: RolloutOutcome, nan_rewards: Sequence[str], errors: dict[str, str]) -> str:
    """Why a rollout is unscorable, "" when it is not: its status and reason when it failed outside the policy, else
    the rewards that came out NaN (``name (error)`` for one that raised, ``errors``)."""
    if outcome.unscorable:
        return f"{outcome.status}: {outcome.reason}"
    if nan_rewards:
        return "NaN reward: " + ", ".join(f"{n} ({errors[n]})" if n in errors else n for n in nan_rewards)
    return ""


def server_health(proxy_url: str) -> str:
    """What ``aitlrt-serve``'s ``/health`` answers (status code and body), or why it could not be asked."""
    try:
        response = httpx.get(f"{proxy_url}/health", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"no answer ({type(exc).__name__}: {exc})"
    return f"{response.status_code} {response.text.strip()[:300]}"


class UnscorableSteps:
    """Counts consecutive training steps whose every rollout was unscorable; ``limit`` 0 never stops."""

    def __init__(self, limit: int, proxy_url: str) -> None:
        self.limit = limit
        self.proxy_url = proxy_url
        self.count = 0

    def observe(self, step: int, all_unscorable: bool, reasons: Sequence[str]) -> None:
        """After training step ``step``: ``all_unscorable`` (every rank agrees), ``reasons`` (every rollout's, all
        ranks; only needed when ``all_unscorable``). Raises ``UnscorableStepsError`` at the limit."""
        if not all_unscorable:
            self.count = 0
            return
        self.count += 1
        common = "; ".join(f"{n}x {reason}" for reason, n in Counter(reasons).most_common(3))
        if not self.limit or self.count < self.limit:
            log.warning("step %d: all %d rollouts unscorable (%d in a row, stop at %d): %s",
                        step, len(reasons), self.count, self.limit, common)  # fmt: skip
            return
        raise UnscorableStepsError(
            f"{self.count} consecutive steps (to step {step}) in which every rollout was unscorable, failing outside "
            f"the policy (max_unscorable_steps={self.limit}): a dead or hung server, grader or reward function? "
            f"aitlrt-serve {self.proxy_url}/health: {server_health(self.proxy_url)}. The last step's {len(reasons)} "
            f"rollouts: {common}"
        )

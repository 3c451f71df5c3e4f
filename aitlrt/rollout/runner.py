"""Run many agents at once, each in a private workspace, and judge each rollout from its patch and trace.

A rollout's status (``judge``) says whose failure it was: the names and the predicates are
``aitlrt.rollout.status``'s. A rollout that failed outside the policy (``infrastructure_failure``) is unscorable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from aitlrt.common.keys import admin_key, bearer, rollout_token
from aitlrt.common.procs import kill_sessions
from aitlrt.common.workspace import RefusedPatch, WorkspacePool, patch_of, reclaim_stale
from aitlrt.rollout.agents.base import Agent, AgentExit, AgentTask, ModelEndpoint
from aitlrt.rollout.status import Status, infrastructure_failure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutRequest:
    rollout_id: str
    task: AgentTask
    repo: Path
    """A cached git repository (see ``aitlrt.common.workspace``)."""
    base_commit: str
    seed: int | None = None
    """Every model call sampled with a seed derived from this one and the call's index (None: unseeded)."""


@dataclass
class RolloutOutcome:
    rollout_id: str
    task_id: str
    status: Status
    reason: str
    patch: str
    calls: int
    """Calls the model answered."""
    failed_calls: int
    completion_tokens: int
    log_tail: str
    timings: dict[str, float] = field(default_factory=dict)
    """queue_s, workspace_s, agent_s, diff_s, total_s."""
    trace: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def unscorable(self) -> bool:
        """Failed for reasons outside the policy (``infrastructure_failure``)."""
        return infrastructure_failure(self.status, self.calls)

    def summary(self) -> dict[str, Any]:
        """The outcome without its trace; ``call_times``: each recorded call's (started_at, ended_at) at the proxy."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        row["call_times"] = [
            (c["started_at"], c["ended_at"]) for c in self.trace if c.get("started_at") and c.get("ended_at")
        ]
        return row


def judge(
    exit: AgentExit | None,
    patch: str,
    trace: list[dict[str, Any]],
    error: str | None = None,
    refused: str | None = None,
) -> tuple[Status, str]:
    """The outcome from facts, not from the agent's exit code alone (Aider exits 0 on failure; the statuses:
    ``aitlrt.rollout.status``). ``refused``: why the workspace's patch was not taken (``RefusedPatch``): the
    policy's failure, ``no_patch``."""
    answered = [c for c in trace if c.get("status") == 200]
    failed = [c for c in trace if c.get("status") != 200]
    last = max(trace, key=lambda c: c.get("call_index", 0)) if trace else {}
    if error is not None:
        return "agent_error", error
    if (last.get("status") or 0) >= 500:
        return "agent_error", (
            f"the server failed the last call after {len(answered)} answered calls "
            f"({last['status']}: {last.get('error')})"
        )
    assert exit is not None
    if exit.timed_out:  # the policy's, even with no call answered: its first answer may still be generating
        return "timeout", f"killed after {exit.seconds:.0f}s with {len(answered)} answered calls"
    limited = [c for c in failed if c.get("error_code") == "call_limit"]
    if limited:
        return "call_limit", limited[0].get("error") or "call limit reached"
    if exit.returncode != 0:
        return "crashed", f"agent exited with code {exit.returncode}"
    if not answered:
        why = failed[-1].get("error") if failed else "no model call reached the proxy"
        return "agent_error", f"no call answered: {why}"
    if refused is not None:
        return "no_patch", f"{len(answered)} calls, patch refused: {refused}"
    if not patch.strip():
        return "no_patch", f"{len(answered)} calls, empty diff"
    return "ok", f"{len(answered)} calls, {patch.count(chr(10))} diff lines"


@dataclass
class Progress:
    total: int
    done: int = 0
    running: int = 0
    patched: int = 0
    """Rollouts done whose workspace has a non-empty patch (whatever their status)."""
    failed: int = 0
    """Rollouts done that failed outside the policy (``infrastructure_failure``); the policy's own failures
    (``no_patch``, ``call_limit``, ``timeout``, a crash after answered calls) are not counted here."""
    calls: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        return (
            f"rollouts {self.done}/{self.total} done, {self.running} running | {self.patched} with a patch, "
            f"{self.failed} failed outside the policy | "
            f"{self.calls} calls, {self.tokens / max(elapsed, 1e-9):.1f} tok/s | {elapsed:.0f}s"
        )


class RolloutRunner:
    """Runs rollouts ``concurrency`` at a time against ``aitlrt-serve`` at ``proxy_url``.

    Workspaces are recycled between rollouts (``WorkspacePool``, up to ``concurrency`` idle copies) unless
    ``recycle_workspaces`` is False; ``close()`` removes them (a crashed owner's are reclaimed on the next start).
    ``api_key``: the server's admin key (default: ``aitlrt.common.keys.admin_key``); each agent gets only its
    rollout's token.
    """

    def __init__(
        self,
        agent: Agent,
        proxy_url: str,
        model: str,
        *,
        concurrency: int = 4,
        timeout_s: float = 600.0,
        max_calls: int | None = None,
        context_window: int = 8192,
        api_key: str | None = None,
        workspaces: Path | None = None,
        recycle_workspaces: bool = True,
    ) -> None:
        self.agent = agent
        self.proxy_url = proxy_url.rstrip("/")
        self.model = model
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_calls = max_calls
        self.context_window = context_window
        self.api_key = api_key or admin_key(self.proxy_url)
        reclaim_stale(workspaces)
        self.pool = WorkspacePool(workspaces, max_idle=max(1, concurrency) if recycle_workspaces else 0)
        self._http = httpx.Client(base_url=self.proxy_url, headers=bearer(self.api_key), timeout=60)
        self._lock = threading.Lock()

    def run(
        self,
        requests: Sequence[RolloutRequest],
        on_progress: Callable[[Progress], None] | None = None,
        on_outcome: Callable[[RolloutOutcome], None] | None = None,
    ) -> list[RolloutOutcome]:
        """All rollouts, in the order asked; one failing never stops the others. ``on_outcome`` is called with each
        rollout's outcome as soon as it ends (in the rollout's thread; what it raises is logged and ignored)."""
        progress = Progress(len(requests))
        queued = time.monotonic()
        with ThreadPoolExecutor(max(1, self.concurrency), thread_name_prefix="rollout") as pool:
            futures = [pool.submit(self._one, r, queued, progress, on_progress, on_outcome) for r in requests]
            try:
                return [f.result() for f in futures]
            except BaseException:  # SIGTERM (exit_on_sigterm) or Ctrl-C: stop the agents, do not wait them out
                for f in futures:
                    f.cancel()
                if stopped := kill_sessions():
                    log.warning("interrupted: stopped %d agent process(es)", stopped)
                raise

    def close(self) -> None:
        """Remove the idle workspaces and close the connection to the proxy."""
        self.pool.close()
        self._http.close()

    def __enter__(self) -> RolloutRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _proxy(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self._http.request(method, path, **kw)

    def _one(
        self,
        req: RolloutRequest,
        queued: float,
        progress: Progress,
        on_progress: Callable[[Progress], None] | None,
        on_outcome: Callable[[RolloutOutcome], None] | None,
    ) -> RolloutOutcome:
        t0 = time.monotonic()
        timings = {"queue_s": t0 - queued}
        self._update(progress, on_progress, running=1)
        exit, patch, error, refused = None, "", None, None
        try:
            # Opens the rollout on the proxy: forgets earlier calls under this id, sets the call limit and seed.
            opening = {"max_calls": self.max_calls, "seed": req.seed}
            self._proxy("PUT", f"/rollouts/{req.rollout_id}", json=opening).raise_for_status()
            endpoint = ModelEndpoint(
                f"{self.proxy_url}/rollouts/{req.rollout_id}/v1",
                self.model,
                api_key=rollout_token(self.api_key, req.rollout_id) if self.api_key else "aitlrt",  # its own only
                context_window=self.context_window,
            )
            with self.pool.workspace(req.repo, req.base_commit) as ws:
                t1 = time.monotonic()
                timings["workspace_s"] = t1 - t0
                exit = self.agent.run(req.task, ws, endpoint, self.timeout_s)
                t2 = time.monotonic()
                timings["agent_s"] = t2 - t1
                try:
                    patch = patch_of(ws)
                except RefusedPatch as exc:
                    refused = str(exc)
                timings["diff_s"] = time.monotonic() - t2
        except (OSError, RuntimeError, httpx.HTTPError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        trace = self._trace(req.rollout_id)
        status, reason = judge(exit, patch, trace, error, refused)
        answered = [c for c in trace if c.get("status") == 200]
        outcome = RolloutOutcome(
            rollout_id=req.rollout_id,
            task_id=req.task.task_id,
            status=status,
            reason=reason,
            patch=patch,
            calls=len(answered),
            failed_calls=len(trace) - len(answered),
            completion_tokens=sum(len(c["completion_token_ids"]) for c in answered),
            log_tail=exit.log_tail if exit else "",
            timings={**timings, "total_s": time.monotonic() - t0},
            trace=trace,
        )
        self._update(
            progress,
            on_progress,
            running=-1,
            done=1,
            patched=int(bool(patch.strip())),
            failed=int(infrastructure_failure(status, outcome.calls)),
            calls=outcome.calls,
            tokens=outcome.completion_tokens,
        )
        if on_outcome is not None:
            try:
                on_outcome(outcome)
            except Exception:
                log.exception("rollout %s: on_outcome failed", req.rollout_id)
        return outcome

    def _trace(self, rollout_id: str) -> list[dict[str, Any]]:
        """The rollout's recorded calls, then released on the proxy (which would otherwise hold every call of a run
        in memory; its journal keeps them on disk)."""
        try:
            resp = self._proxy("GET", f"/rollouts/{rollout_id}")
        except httpx.HTTPError:
            return []
        try:
            self._proxy("DELETE", f"/rollouts/{rollout_id}")
        except httpx.HTTPError as exc:
            log.warning("rollout %s: not released on the proxy: %s", rollout_id, exc)
        return resp.json()["calls"] if resp.status_code == 200 else []

    def _update(self, progress: Progress, on_progress: Callable[[Progress], None] | None, **delta: int) -> None:
        with self._lock:
            for key, value in delta.items():
                setattr(progress, key, getattr(progress, key) + value)
            if on_progress is not None:
                on_progress(progress)

"""Run agents on a batch of tasks through a running ``aitlrt-serve``, without training (``aitlrt rollout``,
``aitlrt eval``): prepare the tasks' repositories, run ``n`` rollouts of each, keep each rollout's task."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from aitlrt.common.keys import admin_headers
from aitlrt.common.resources import agent_slots
from aitlrt.common.seeds import derived_seed
from aitlrt.rollout.agents import Agent, AgentTask, make_agent
from aitlrt.rollout.arguments import RolloutSettings
from aitlrt.rollout.runner import Progress, RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.tasks.envs import EnvBuildError
from aitlrt.tasks.feedback import feedback_command, with_starting_failures
from aitlrt.tasks.loader import TaskLoadError
from aitlrt.tasks.task import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedTask:
    task: Task
    repo: Path
    """The cached repository (``Task.checkout``)."""
    base_commit: str


def prepare_tasks(tasks: Iterable[Task]) -> list[PreparedTask]:
    """Each task with its cached repository and starting commit, fetched now; a task that cannot be checked out is
    logged and skipped. Raises ``TaskLoadError`` when none is left."""
    out = []
    for task in tasks:
        try:
            out.append(PreparedTask(task, *task.checkout()))
        except (OSError, RuntimeError, ValueError) as exc:
            log.warning("skipping task %s: %s", task.instance_id, exc)
    if not out:
        raise TaskLoadError("no task could be prepared")
    return out


def agent_task(task: Task, settings: RolloutSettings) -> AgentTask:
    """``task`` as its agents get it: problem statement (with ``settings.statement_test_output``, the failing tests'
    output at the start after it) and files, and with ``settings.test_feedback_rounds`` its test feedback command (a
    task whose test environment cannot be built goes without both: its grade will say why)."""
    statement = task.problem_statement
    if settings.statement_test_output:
        try:
            statement = with_starting_failures(task, settings.statement_test_output)
        except EnvBuildError as exc:
            log.warning("task %s gets no test output in its statement: %s", task.instance_id, exc)
    plain = AgentTask(task.instance_id, statement, task.files)
    if not settings.test_feedback_rounds:
        return plain
    try:
        command = feedback_command(
            task, settings.test_feedback_max_chars, settings.test_feedback_timeout_s, settings.test_feedback_rounds
        )
    except EnvBuildError as exc:
        log.warning("task %s gets no test feedback: %s", task.instance_id, exc)
        return plain
    return replace(plain, test_command=command, test_rounds=settings.test_feedback_rounds)


@dataclass
class Batch:
    tasks: list[Task]
    """Each rollout's task (the same ``Task`` object for the ``n`` rollouts of a task)."""
    outcomes: list[RolloutOutcome]
    seeds: list[int | None] = field(default_factory=list)
    """Each rollout's sampling seed (``RolloutSettings.seed``); empty or None: unseeded."""


def rollout_seed(seed: int, instance_id: str, k: int) -> int:
    """The sampling seed of the ``k``-th rollout of task ``instance_id`` in a batch seeded with ``seed``: a 31-bit
    hash, the same whatever the batch's other tasks."""
    return derived_seed(seed, instance_id, k)


def served_model(proxy: str) -> str:
    """The first model the proxy serves."""
    url = proxy.rstrip("/")
    models = httpx.get(f"{url}/v1/models", headers=admin_headers(url), timeout=30).raise_for_status().json()["data"]
    return models[0]["id"]


PROGRESS_LOG_EVERY_S = 30.0
"""How often ``run_batch`` logs its progress line when its caller passes no ``on_progress``."""


def log_progress(every_s: float = PROGRESS_LOG_EVERY_S) -> Callable[[Progress], None]:
    """An ``on_progress`` callback for library callers (the held-out evaluations of a training run, the warm start's
    teacher rollouts, benchmarks): the progress line in the log at most every ``every_s`` seconds, and at the end."""
    last = [time.monotonic()]

    def show(progress: Progress) -> None:
        now = time.monotonic()
        if progress.done == progress.total or now - last[0] >= every_s:
            log.info("%s", progress.line())
            last[0] = now

    return show


def run_batch(
    prepared: Sequence[PreparedTask],
    proxy: str,
    settings: RolloutSettings,
    *,
    model: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    agent: Agent | None = None,
) -> Batch:
    """``settings.n`` rollouts of every task through ``proxy`` (model: the proxy's first), in task order; progress
    goes to ``on_progress``, by default to the log every ``PROGRESS_LOG_EVERY_S`` (``log_progress``). ``agent``
    (kept open) runs them instead of ``settings.agent``."""
    proxy = proxy.rstrip("/")
    model = model or served_model(proxy)
    stamp = time.strftime("%H%M%S")
    requests = [
        RolloutRequest(
            f"{p.task.instance_id[:80]}.{stamp}.{g}".replace("/", "_"),
            task,
            p.repo,
            p.base_commit,
            None if settings.seed is None else rollout_seed(settings.seed, p.task.instance_id, g),
        )
        for p, task in zip(prepared, [agent_task(p.task, settings) for p in prepared], strict=True)
        for g in range(settings.n)
    ]
    concurrency = settings.concurrency or agent_slots()
    owned = agent is None
    agent = agent or make_agent(
        settings.agent,
        settings.edit_format,
        settings.aider_reminder,
        command=settings.agent_command,
        max_calls=settings.max_calls,
    )
    runner = RolloutRunner(
        agent,
        proxy,
        model,
        concurrency=concurrency,
        timeout_s=settings.timeout_s,
        max_calls=settings.max_calls,
        context_window=settings.context_window,
        recycle_workspaces=settings.recycle_workspaces,
    )
    log.info(
        "%d rollouts (%d tasks x %d) with %s, %d at a time, model %s via %s, %s",
        len(requests),
        len(prepared),
        settings.n,
        agent.name,
        concurrency,
        model,
        proxy,
        "unseeded" if settings.seed is None else f"seed {settings.seed}",
    )
    try:
        outcomes = runner.run(requests, on_progress=on_progress or log_progress())
    finally:
        runner.close()
        if owned and hasattr(agent, "close"):
            agent.close()
    return Batch([p.task for p in prepared for _ in range(settings.n)], outcomes, [r.seed for r in requests])


def write_outcomes(path: Path, outcomes: Sequence[RolloutOutcome], rewards: Mapping[str, Sequence[float]]) -> None:
    """One JSON line per rollout: its summary, its ``rewards`` by name and its ``trace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for i, o in enumerate(outcomes):
            scores = {name: values[i] for name, values in rewards.items()}
            fh.write(json.dumps({**o.summary(), "rewards": scores, "trace": o.trace}) + "\n")

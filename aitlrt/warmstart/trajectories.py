"""Successful trajectories of the real agent for supervised warm start (``aitlrt trajectories``).

A teacher (the oracle of ``aitlrt.warmstart.oracle_server``, or any OpenAI-compatible server) answers the real,
unmodified agent through ``aitlrt-serve``, so every prompt is recorded exactly as the agent sent it. Every
rollout is scored with the built-in rewards; the ones whose weighted reward reaches ``min_reward`` are kept
(rejection sampling), and each of their policy calls becomes one line of trl's conversational prompt-completion
format.

With the oracle and Aider's test feedback on (``RolloutSettings.test_feedback_rounds`` > 0), every task that has a
decoy (``aitlrt.warmstart.oracle.decoy``: an edit that applies and fixes nothing; Python files) also gets multi-turn
trajectories: the oracle answers the decoy first, Aider runs the tests and sends their output back, and the oracle
answers that with the fix. Of such a trajectory only the calls that answer the tests' output become lines: the
decoy is a wrong answer, never trained on (it stays in the later prompts, as the agent sent them, where nothing is
trained on).

mini-swe-agent (``agent: mini-swe-agent``, its text mode) gets the oracle's shell actions
(``aitlrt.warmstart.oracle_shell``: inspect, patch, submit): every call of a kept rollout is one line, its prompt the
append-only history so far. Its tool-calling mode has no oracle.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aitlrt.common.procs import free_port
from aitlrt.rewards.builtin import REWARDS
from aitlrt.rewards.inputs import RewardFunc, reward_row, score
from aitlrt.rollout.batch import Batch, PreparedTask, RolloutSettings, prepare_tasks, run_batch
from aitlrt.rollout.runner import Progress, RolloutOutcome
from aitlrt.serving.process import ServeProcess
from aitlrt.tasks.task import Task
from aitlrt.warmstart.oracle import OracleTask, decoy, feedback_turn
from aitlrt.warmstart.oracle_server import fix_patch, oracle_server, oracle_tasks
from aitlrt.warmstart.oracle_shell import SHELL

log = logging.getLogger(__name__)

ORACLE = "oracle"
DEFAULT_REWARDS = {"tests_pass": 1.0, "patch_similarity": 0.5}
"""Reward name → weight: resolved counts 1, similarity to the oracle patch 0.5."""


@dataclass(frozen=True)
class Teacher:
    """Who answers the agent: the oracle (``url`` None) or the OpenAI-compatible server at ``url``."""

    url: str | None = None
    model: str | None = None
    """The model to ask ``url`` for (default: the first it lists)."""
    api_key_env: str | None = None
    """The environment variable holding ``url``'s API key."""
    tokenizer: str | None = None
    """The oracle's: the policy's tokenizer (path, Hub id or ``bundled``, the default) for the token ids it records."""

    @property
    def label(self) -> str:
        return self.url or ORACLE

    @property
    def default_min_reward(self) -> float:
        """With ``DEFAULT_REWARDS``: the oracle must resolve the task with its own patch (1.5); another teacher
        must resolve it (1.0), its similarity to the oracle patch only ranking."""
        return 1.5 if self.url is None else 1.0


def teacher_from(
    spec: str, model: str | None = None, api_key_env: str | None = None, tokenizer: str | None = None
) -> Teacher:
    """``oracle`` (with ``tokenizer``) or a server's URL (its root; a trailing ``/v1`` is dropped)."""
    if spec == ORACLE:
        return Teacher(tokenizer=tokenizer)
    if not spec.startswith(("http://", "https://")):
        raise ValueError(f"a teacher is 'oracle' or an http(s) URL, not {spec!r}")
    url = spec.rstrip("/")
    return Teacher(url.removesuffix("/v1"), model, api_key_env)


def oracle_format(settings: RolloutSettings) -> str:
    """The format the oracle answers ``settings.agent`` in: mini-swe-agent's shell actions, else Aider's
    ``settings.edit_format``; ValueError for mini-swe-agent's tool-calling mode."""
    if settings.agent == "mini-swe-agent-tools":
        raise ValueError("the oracle answers mini-swe-agent in its text mode (agent mini-swe-agent), not in tool calls")
    return SHELL if settings.agent == "mini-swe-agent" else settings.edit_format


def reward_funcs(names: Sequence[str]) -> dict[str, RewardFunc]:
    """The built-in rewards called ``names``; ValueError naming the unknown ones."""
    unknown = [name for name in names if name not in REWARDS]
    if unknown:
        raise ValueError(f"unknown rewards {unknown} (known: {', '.join(REWARDS)})")
    return {name: REWARDS[name] for name in names}


@dataclass
class CollectReport:
    tasks: list[Task]
    """Each rollout's task."""
    outcomes: list[RolloutOutcome]
    rewards: dict[str, list[float]]
    """Each reward's value per rollout."""
    weighted: list[float]
    kept: list[bool]
    multi_turn: list[bool]
    """Whether each rollout is a multi-turn oracle trajectory (decoy first)."""
    calls_written: int
    out: Path
    seconds: float

    def kept_per_task(self) -> dict[str, tuple[int, int]]:
        """(kept, run) rollouts per task id, every task listed."""
        run = Counter(t.instance_id for t in self.tasks)
        kept = Counter(t.instance_id for t, k in zip(self.tasks, self.kept, strict=True) if k)
        return {task_id: (kept[task_id], n) for task_id, n in run.items()}


def policy_calls(outcome: RolloutOutcome) -> Iterator[dict[str, Any]]:
    """The rollout's answered calls of the policy itself (untagged: not Aider's weak-model summaries), in order."""
    calls = [c for c in outcome.trace if c.get("status") == 200 and not c.get("tag")]
    yield from sorted(calls, key=lambda c: c["call_index"])


def sft_rows(
    outcome: RolloutOutcome, task: Task, reward: float, teacher: str, edit_format: str, *, multi_turn: bool = False
) -> list[dict]:
    """One trl conversational prompt-completion row per policy call: the messages as the agent sent them, the
    teacher's answer. Of a ``multi_turn`` trajectory (decoy first), only the calls whose prompt holds the tests'
    output (``oracle.feedback_turn``): the decoy is never trained on."""
    calls = [c for c in policy_calls(outcome) if not multi_turn or feedback_turn(c["request"]["messages"])]
    return [
        {
            "prompt": call["request"]["messages"],
            "completion": [{"role": "assistant", "content": call["text"]}],
            "instance_id": task.instance_id,
            "rollout_id": outcome.rollout_id,
            "call_index": call["call_index"],
            "reward": reward,
            "teacher": teacher,
            "edit_format": edit_format,
        }
        for call in calls
    ]


def _proxy_args(teacher: Teacher, upstream: str, serve_dir: Path) -> list[str]:
    args = ["--upstream", upstream, "--run-dir", str(serve_dir)]
    if teacher.url is not None:
        args.append("--no-token-ids")
        if teacher.api_key_env:
            args += ["--upstream-api-key-env", teacher.api_key_env]
    return args


def _teacher_batch(
    prepared: Sequence[PreparedTask],
    teacher: Teacher,
    oracles: Mapping[str, OracleTask],
    settings: RolloutSettings,
    serve_dir: Path,
    on_progress: Callable[[Progress], None] | None,
    *,
    decoy_first: bool = False,
) -> Batch:
    """``run_batch`` with ``teacher`` (the oracle of ``oracles``, decoy first or not) behind a fresh proxy."""
    with ExitStack() as stack:
        if teacher.url is None:
            oracle = oracle_server(
                list(oracles.values()), oracle_format(settings), tokenizer=teacher.tokenizer, decoy_first=decoy_first
            )
            upstream = stack.enter_context(oracle)
        else:
            upstream = teacher.url
        proxy = ServeProcess(_proxy_args(teacher, upstream, serve_dir), free_port(), serve_dir / "serve.log")
        proxy.start()
        stack.callback(proxy.stop)
        proxy.wait_ready(timeout_s=60, upstream=teacher.url is None)  # a hosted API may have no /health
        log.info("teacher %s behind aitlrt-serve at %s (log %s)", teacher.label, proxy.url, proxy.log_path)
        return run_batch(prepared, proxy.url, settings, model=teacher.model, on_progress=on_progress)


def collect(
    tasks: Sequence[Task],
    teacher: Teacher,
    settings: RolloutSettings,
    rewards: Mapping[str, RewardFunc],
    weights: Sequence[float],
    min_reward: float,
    out: Path,
    *,
    serve_dir: Path = Path("runs/trajectories/serve"),
    on_progress: Callable[[Progress], None] | None = None,
) -> CollectReport:
    """``settings.n`` rollouts of every task with ``teacher`` answering through a fresh ``aitlrt-serve`` (journal
    and log in ``serve_dir``), scored with ``rewards``; the calls of those whose weighted reward reaches
    ``min_reward`` are written to ``out`` (JSON lines, ``sft_rows``). ``patch_similarity`` compares each rollout's
    patch with the task's fix as git writes it (``oracle_server.fix_patch``), so a rollout that leaves exactly the
    fixed files scores 1.0 even where the task's patch text aligns the change differently. With the oracle and
    ``settings.test_feedback_rounds`` > 0 and Aider, then as many multi-turn rollouts of every task that has a decoy
    (decoy first; their proxy's journal in ``serve_dir/multi-turn``), listed after the others. Rows record the
    teacher's format: ``settings.edit_format``, or the oracle's (``oracle_format``)."""
    if len(weights) != len(rewards):
        raise ValueError(f"{len(weights)} weights for {len(rewards)} rewards")
    started = time.monotonic()
    answers = settings.edit_format if teacher.url is not None else oracle_format(settings)
    prepared: list[PreparedTask] = prepare_tasks(tasks)
    oracles = oracle_tasks(p.task for p in prepared)
    batch = _teacher_batch(prepared, teacher, oracles, settings, serve_dir, on_progress)
    multi_turn = [False] * len(batch.outcomes)
    feedback_on = teacher.url is None and answers != SHELL and settings.test_feedback_rounds > 0
    decoyed = [
        p for p in prepared if feedback_on and p.task.instance_id in oracles and decoy(oracles[p.task.instance_id])
    ]
    if decoyed:
        more = _teacher_batch(
            decoyed, teacher, oracles, settings, serve_dir / "multi-turn", on_progress, decoy_first=True
        )
        batch = Batch(batch.tasks + more.tasks, batch.outcomes + more.outcomes, batch.seeds + more.seeds)
        multi_turn += [True] * len(more.outcomes)
    # similarity to the oracle fix as git writes it (what the agent's patch is when its files are the fixed ones),
    # not to the task's patch text, which may align the same change differently (see ``fix_patch``)
    fixes = {instance_id: fix_patch(oracle) for instance_id, oracle in oracles.items()}
    rows = [
        reward_row({**task.as_row(), "patch": fixes.get(task.instance_id, task.patch)}, task, o)
        for task, o in zip(batch.tasks, batch.outcomes, strict=True)
    ]
    scores = score(rewards, rows)
    weighted = [
        sum(w * values[i] for w, values in zip(weights, scores.values(), strict=True))
        for i in range(len(batch.outcomes))
    ]
    kept = [not math.isnan(r) and r >= min_reward for r in weighted]
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(out, "w") as fh:
        for task, outcome, reward, keep, multi in zip(
            batch.tasks, batch.outcomes, weighted, kept, multi_turn, strict=True
        ):
            if keep:
                for row in sft_rows(outcome, task, reward, teacher.label, answers, multi_turn=multi):
                    fh.write(json.dumps(row) + "\n")
                    written += 1
    log.info(
        "%d of %d rollouts kept (%d multi-turn), %d calls written to %s",
        sum(kept),
        len(kept),
        sum(k and m for k, m in zip(kept, multi_turn, strict=True)),
        written,
        out,
    )
    return CollectReport(
        tasks=batch.tasks,
        outcomes=batch.outcomes,
        rewards=scores,
        weighted=weighted,
        kept=kept,
        multi_turn=multi_turn,
        calls_written=written,
        out=out,
        seconds=time.monotonic() - started,
    )

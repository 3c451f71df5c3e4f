"""Evaluate one checkpoint, or compare two, on the same tasks, agent and sampling: the second is loaded into the
same server with ``POST /weights/reload``. Results go to JSON lines and a static HTML report."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from aitlrt.common.keys import admin_headers
from aitlrt.common.model import resolve_model
from aitlrt.evaluation.scoring import (
    paired,
    paired_difference,
    same_patch_share,
    score_batch,
    summarise,
    weighted_rewards,
)
from aitlrt.report.html import write_report
from aitlrt.rewards.inputs import RewardFunc
from aitlrt.rollout.agents.scripted import TRIVIAL_POLICIES, ScriptedAgent, trivial_edits
from aitlrt.rollout.batch import Batch, PreparedTask, RolloutSettings, run_batch
from aitlrt.rollout.record import RolloutRecord, write_rollouts
from aitlrt.rollout.runner import Progress
from aitlrt.serving.process import managed_server

log = logging.getLogger(__name__)

SERVED = "served"
"""The checkpoint label for the weights a running server has now."""
TRIVIAL_SERVER = "bundled"
"""What a managed server serves when every checkpoint is a trivial policy (their one call each needs a model)."""


@dataclass
class CheckpointResult:
    label: str
    batch: Batch
    rewards: dict[str, list[float]]
    """Each reward's value per rollout."""
    summary: dict[str, float]
    """``aitlrt.evaluation.scoring.summarise``."""


@dataclass(frozen=True)
class PairedGain:
    gain: float
    """Mean over paired rollouts of the weighted reward after minus before."""
    se: float
    """Its standard error, clustered by task."""
    same_patch: float
    """Share of paired rollouts that left the very same patch."""


def paired_gain(before: CheckpointResult, after: CheckpointResult, weights: Mapping[str, float]) -> PairedGain | None:
    """The weighted reward's gain of ``after`` over ``before`` rollout by rollout (its error clustered by task), or
    None when their rollouts do not pair up (``aitlrt.evaluation.scoring.paired``: seeded alike, same tasks in the
    same order; never a trivial policy's, which are unseeded)."""
    if not paired(before.batch, after.batch):
        return None
    gain, se = paired_difference(
        weighted_rewards(before.rewards, weights),
        weighted_rewards(after.rewards, weights),
        clusters=[t.instance_id for t in before.batch.tasks],
    )
    return PairedGain(gain, se, same_patch_share(before.batch, after.batch))


def evaluate(
    checkpoints: Sequence[str],
    prepared: Sequence[PreparedTask],
    settings: RolloutSettings,
    rewards: Mapping[str, RewardFunc],
    *,
    proxy: str | None = None,
    serve_dir: Path = Path("runs/eval/serve"),
    max_tokens: int = 512,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    serve_args: Sequence[str] = ("--enforce-eager",),
    on_progress: Callable[[Progress], None] | None = None,
    on_result: Callable[[CheckpointResult], None] | None = None,
) -> list[CheckpointResult]:
    """Run, score and summarise the rollouts of each checkpoint (a weights folder, ``bundled``, ``served``, or a
    trivial policy of ``TRIVIAL_POLICIES``).

    With ``proxy`` (a running ``aitlrt-serve``) the first weights are loaded into it unless they are ``served``;
    without, a server is started on the first weights (``TRIVIAL_SERVER`` if there are none; ``managed_server`` in
    ``serve_dir`` with ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` and ``serve_args``) and stopped at the
    end. Every later weights are loaded into that server. A trivial policy loads nothing: its scripted agent runs one
    rollout per task through the same server, runner and grader (``run_trivial``). ``on_result`` gets each
    checkpoint's result as soon as it is scored (a caller keeping them survives an interrupted evaluation).
    """
    models = [label for label in checkpoints if label not in TRIVIAL_POLICIES]
    with ExitStack() as stack:
        if proxy is None:
            loaded = models[0] if models else TRIVIAL_SERVER
            model = resolve_model(loaded)
            serve = managed_server(
                model,
                serve_dir,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_tokens,
                extra_args=serve_args,
            )
            proxy = stack.enter_context(serve).url
        else:
            loaded = SERVED
        results = []
        for label in checkpoints:
            if label in TRIVIAL_POLICIES:
                batch = run_trivial(label, prepared, proxy, settings, on_progress)
            else:
                if label != loaded:
                    load_weights(proxy, label)
                    loaded = label
                batch = run_batch(prepared, proxy, settings, on_progress=on_progress)
            scores = score_batch(rewards, batch)
            results.append(CheckpointResult(label, batch, scores, summarise(batch, scores)))
            if on_result is not None:
                on_result(results[-1])
        return results


def load_weights(proxy: str, label: str) -> None:
    """Load checkpoint ``label``'s weights into the server at ``proxy`` (``POST /weights/reload``)."""
    path = resolve_model(label)
    log.info("loading %s into the server", path)
    headers = admin_headers(proxy)
    httpx.post(f"{proxy}/weights/reload", json={"path": str(path)}, headers=headers, timeout=600).raise_for_status()


def run_trivial(
    policy: str,
    prepared: Sequence[PreparedTask],
    proxy: str,
    settings: RolloutSettings,
    on_progress: Callable[[Progress], None] | None = None,
) -> Batch:
    """The rollouts of trivial policy ``policy`` (``TRIVIAL_POLICIES``): its scripted agent, one unseeded rollout
    per task (it is deterministic), through the server at ``proxy`` and ``settings``' runner limits (no test
    feedback: the scripted agent runs no tests)."""
    agent = ScriptedAgent(trivial_edits(policy, prepared), name=policy)
    once = replace(settings, n=1, seed=None, test_feedback_rounds=0)
    return run_batch(prepared, proxy, once, on_progress=on_progress, agent=agent)


def report_records(
    results: Sequence[CheckpointResult], weights: Mapping[str, float] | None = None
) -> list[RolloutRecord]:
    """One record per rollout for ``aitlrt.report.html`` (``checkpoint``: the label; ``step``: its position), with
    the runner's details, the last call's conversation, the task's oracle patch and, with ``weights``, the weighted
    reward (``reward``, as ``aitlrt.evaluation.scoring.summarise``)."""
    records = []
    for step, result in enumerate(results):
        for i, (task, outcome) in enumerate(zip(result.batch.tasks, result.batch.outcomes, strict=True)):
            rewards = {name: values[i] for name, values in result.rewards.items()}
            weighted = {"reward": sum(weights.get(n, 0.0) * v for n, v in rewards.items())} if weights else {}
            records.append(
                RolloutRecord.from_outcome(
                    outcome,
                    oracle_patch=task.patch,
                    rewards=rewards,
                    step=step,
                    details=True,
                    checkpoint=result.label,
                    **weighted,
                )
            )
    return records


def write_results(
    results: Sequence[CheckpointResult], out_dir: Path, weights: Mapping[str, float] | None = None
) -> tuple[Path, Path]:
    """``out_dir/rollouts.jsonl`` (``report_records``) and ``out_dir/report.html`` (these rollouts as the held-out
    evaluation: per checkpoint and task, then each rollout); return both paths."""
    records = report_records(results, weights)
    rollouts = write_rollouts(out_dir / "rollouts.jsonl", records)
    title = f"aitlrt eval: {' vs '.join(r.label for r in results)}"
    return rollouts, write_report([], out_dir / "report.html", title, heldout=records)

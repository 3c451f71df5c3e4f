"""One saved rollout as a JSON line: ``OUTPUT/rollouts/step_XXXX.jsonl`` (a training step's rollouts) and
``rollouts.jsonl`` (an evaluation's, ``aitlrt.evaluation.checkpoints.write_results``), read by the run report.

``RolloutRecord.from_outcome`` builds one, ``write_rollouts`` writes a file of them and ``read_rollouts`` reads one
back (files of earlier runs included: every field but the few each writer sets is optional, and unknown ones are
ignored). A record keeps the fields its writer set, no more, so a file reads as before this type existed."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from aitlrt.rollout.runner import RolloutOutcome

STEP_FILE = "step_{:04d}.jsonl"
"""A training step's file under ``OUTPUT/rollouts/``."""


class RolloutRecordError(ValueError):
    """A rollouts file that does not read as records; the message names the file, line and field."""


class RolloutRecord(BaseModel):
    """One rollout: what the agent did, how it scored and, in training, what it trained."""

    model_config = ConfigDict(extra="ignore")

    step: int = 0
    """Training: the global step that generated it; evaluation: the checkpoint's position."""
    rollout_id: str = ""
    instance_id: str = ""
    status: str = ""
    """``aitlrt.rollout.status.Status``."""
    reason: str = ""
    patch: str = ""
    """The agent's final diff."""
    oracle_patch: str | None = None
    """The task's reference patch (None: not recorded)."""
    rewards: dict[str, float] = {}
    """Each reward function's value (NaN: unscorable)."""
    calls: int | None = None
    """Model calls answered."""
    completion_tokens: int | None = None
    conversation: list[dict[str, Any]] = []
    """The last policy call's messages and its answer (``from_outcome``): a multi-turn rollout's whole history where
    the agent keeps it, test feedback included."""

    # training (``trainer._save_rollouts``)
    round: int | None = None
    """The dynamic-sampling round that drew it."""
    unscorable: str | None = None
    """Why it cannot be scored (None: it can)."""
    advantage: float | None = None
    informative: bool | None = None
    """Its group had reward variance and was kept."""
    rows: int | None = None
    """Rows trained from its calls."""
    trained_tokens: int | None = None

    # evaluation (``aitlrt.evaluation.checkpoints.report_records``)
    checkpoint: str | None = None
    """The evaluated weights' label."""
    reward: float | None = None
    """The weighted reward, where weights were given."""
    task_id: str | None = None
    failed_calls: int | None = None
    log_tail: str | None = None
    timings: dict[str, float] | None = None
    """``RolloutOutcome.timings``."""
    call_times: list[tuple[float, float]] | None = None
    """Each recorded call's (started_at, ended_at) at the proxy."""

    @classmethod
    def from_outcome(
        cls,
        outcome: RolloutOutcome,
        *,
        oracle_patch: str | None,
        rewards: Mapping[str, float],
        step: int,
        details: bool = False,
        **fields: Any,
    ) -> RolloutRecord:
        """The record of ``outcome`` (``instance_id``: its task's id) with the task's ``oracle_patch``, ``rewards`` and
        ``step``, the conversation of its last policy call (a tagged call, such as Aider's weak-model summary, is
        not the policy's turn: the last call only where every call is tagged) and ``fields`` (the writer's own:
        ``round``, ``advantage``, ``checkpoint``, ...); with ``details`` also the runner's (``RolloutOutcome.summary``:
        timings, call times, log tail, failed calls)."""
        policy = [call for call in outcome.trace if not call.get("tag")] or outcome.trace
        last = policy[-1] if policy else {}
        conversation = list((last.get("request") or {}).get("messages") or [])
        conversation += [last["message"]] if last.get("message") else []
        summary = outcome.summary()
        runner = {k: summary[k] for k in ("task_id", "failed_calls", "log_tail", "timings", "call_times")}
        own = {
            "step": step,
            "rollout_id": outcome.rollout_id,
            "instance_id": outcome.task_id,
            "status": outcome.status,
            "reason": outcome.reason,
            "patch": outcome.patch,
            "oracle_patch": oracle_patch,
            "rewards": dict(rewards),
            "calls": outcome.calls,
            "completion_tokens": outcome.completion_tokens,
            "conversation": conversation,
        }
        return cls(**{**own, **(runner if details else {}), **fields})

    @property
    def edited(self) -> bool:
        """Whether the agent left a non-empty patch."""
        return bool(self.patch.strip())

    def as_json(self) -> dict[str, Any]:
        """The fields its writer set, as ``json.dumps`` writes them (NaN rewards as ``NaN``, as always)."""
        return self.model_dump(mode="python", exclude_unset=True)


def write_rollouts(path: Path, records: Iterable[RolloutRecord]) -> Path:
    """``records`` as ``path``, one JSON line each (the folder made); return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fh.writelines(json.dumps(r.as_json()) + "\n" for r in records)
    return path


def read_rollouts(path: Path) -> list[RolloutRecord]:
    """The records of ``path`` ([] without the file); ``RolloutRecordError`` naming the line and field of one that
    is not a record."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(RolloutRecord.model_validate(json.loads(line)))
        except json.JSONDecodeError as exc:
            raise RolloutRecordError(f"{path} line {number}: not JSON ({exc.msg} at column {exc.colno})") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(part) for part in first["loc"]) or "the line"
            raise RolloutRecordError(f"{path} line {number}: {field}: {first['msg']}") from None
    return records


def read_run_rollouts(run_dir: Path) -> list[RolloutRecord]:
    """Every saved rollout of a training run (``RUN_DIR/rollouts/step_*.jsonl``), step by step."""
    return [r for path in sorted((run_dir / "rollouts").glob("step_*.jsonl")) for r in read_rollouts(path)]

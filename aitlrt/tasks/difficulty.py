"""Task difficulty under a policy: the sidecar file of ``aitlrt tasks probe`` that the training curriculum reads
(``aitlrt.training.curriculum``).

One JSON line per task: ``instance_id``, ``k`` (scorable rollouts), ``reward_mean`` (mean weighted reward, with
``reward_weights`` as given), ``rewards`` (each reward's mean), ``solved_rate`` (share of rollouts with
``tests_pass`` == 1), ``edit_rate`` (share with a non-empty patch), ``model`` and ``probed_at`` (UTC, ISO 8601).
A task is *solved* when every probe solved it, *failed* when none did, *mixed* otherwise.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

SOLVED_REWARD = "tests_pass"
"""The reward whose value 1 means a rollout solved its task."""

Level = Literal["solved", "mixed", "failed"]


@dataclass(frozen=True)
class TaskDifficulty:
    """One task's probe: ``k`` scorable rollouts of ``model``."""

    instance_id: str
    k: int
    reward_mean: float
    solved_rate: float
    edit_rate: float
    model: str
    probed_at: str
    rewards: dict[str, float] = field(default_factory=dict)
    reward_weights: dict[str, float] = field(default_factory=dict)

    @property
    def level(self) -> Level:
        """``solved`` (every rollout solved it), ``failed`` (none did) or ``mixed``."""
        if self.solved_rate >= 1.0:
            return "solved"
        return "failed" if self.solved_rate <= 0.0 else "mixed"


def sidecar_path(tasks_file: str | Path) -> Path:
    """The default sidecar of a task file: ``FILE.difficulty.jsonl`` beside it."""
    return Path(f"{tasks_file}.difficulty.jsonl")


def difficulty_from_rollouts(
    instance_id: str,
    rewards: Mapping[str, Sequence[float]],
    weights: Mapping[str, float],
    patches: Sequence[str],
    *,
    model: str,
    probed_at: str,
) -> TaskDifficulty | None:
    """The record of one task from its rollouts' reward values (``rewards[SOLVED_REWARD]`` required) and patches,
    in rollout order. A rollout with a NaN reward is unscorable and left out; None when none is left."""
    solved = rewards[SOLVED_REWARD]
    keep = [i for i in range(len(patches)) if all(not math.isnan(values[i]) for values in rewards.values())]
    if not keep:
        return None
    means = {name: sum(values[i] for i in keep) / len(keep) for name, values in rewards.items()}
    return TaskDifficulty(
        instance_id=instance_id,
        k=len(keep),
        reward_mean=sum(weights.get(name, 0.0) * mean for name, mean in means.items()),
        solved_rate=sum(solved[i] >= 1.0 for i in keep) / len(keep),
        edit_rate=sum(bool(patches[i].strip()) for i in keep) / len(keep),
        model=model,
        probed_at=probed_at,
        rewards=means,
        reward_weights={name: weights.get(name, 0.0) for name in rewards},
    )


def read_difficulty(path: str | Path) -> dict[str, TaskDifficulty]:
    """The records of a sidecar by instance id (a later line wins); ValueError naming ``file:line`` on a bad
    line, FileNotFoundError when the file is missing."""
    records = {}
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                record = TaskDifficulty(
                    instance_id=str(row["instance_id"]),
                    k=int(row["k"]),
                    reward_mean=float(row["reward_mean"]),
                    solved_rate=float(row["solved_rate"]),
                    edit_rate=float(row["edit_rate"]),
                    model=str(row.get("model", "")),
                    probed_at=str(row.get("probed_at", "")),
                    rewards={str(k): float(v) for k, v in (row.get("rewards") or {}).items()},
                    reward_weights={str(k): float(v) for k, v in (row.get("reward_weights") or {}).items()},
                )
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{n}: not a task difficulty record ({exc!r})") from None
            if record.k < 1 or not 0.0 <= record.solved_rate <= 1.0:
                raise ValueError(f"{path}:{n}: k must be >= 1 and solved_rate in [0, 1]")
            records[record.instance_id] = record
    return records


def write_difficulty(
    path: str | Path, records: Iterable[TaskDifficulty], *, merge: bool = False
) -> dict[str, TaskDifficulty]:
    """Write ``records`` to the sidecar ``path`` (atomically: a temporary file renamed over it). With ``merge``, the
    records already there are kept, those of the same tasks replaced in place, new ones appended. Returns every
    record written, by instance id."""
    path = Path(path)
    out = read_difficulty(path) if merge and path.exists() else {}
    out.update((r.instance_id, r) for r in records)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(asdict(r)) + "\n" for r in out.values())
    os.replace(tmp, path)
    return out

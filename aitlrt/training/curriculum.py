"""The task curriculum: draw training tasks by their difficulty under the policy (the ``aitlrt tasks probe`` sidecar,
``aitlrt.tasks.difficulty``), updated online from the training rollouts.

A group whose rollouts all get the same reward carries no GRPO gradient, so tasks are drawn by class:

- *solved* (every probe solved it): weight 0, never drawn;
- *mixed* (some probes solved it; unprobed tasks count here): ``1 - failed_share`` of the draws, shared in
  proportion to ``p (1 - p)``, ``p`` the solve rate (unprobed: 0.5). ``p (1 - p)`` is the variance of the
  pass/fail reward: with group-relative advantages it is the expected squared advantage of a rollout, a lower bound
  on the expected improvement of a policy-gradient step on the task grows with it (Bae et al. 2025, *Online
  Difficulty Filtering for Reasoning Oriented RL*), and so does ``1 - p^G - (1 - p)^G``, the chance that a group of
  ``G`` carries any gradient at all. Tasks near 50 % come first; an unprobed task gets the top weight, so training
  probes it soon;
- *failed* (no probe solved it): ``failed_share`` of the draws, evenly (a partial reward may still teach there,
  and the policy may grow into them).

When a class is empty its share goes to the other; when both are empty (every task solved) a ``ValueError`` says
so. ``CurriculumSampler`` has trl's ``RepeatSampler`` contract (same structure, identical on every rank given the
seed) but draws each chunk of ``batch_size`` tasks by these weights: without replacement inside a chunk while enough
tasks have weight, with replacement across chunks. Chunks are drawn lazily, when the DataLoader reaches them
(accelerate reads one batch ahead), so an ``update`` applies to the first chunk not yet drawn. On every rank,
``update`` must be called with the same gathered values in the same order, and ``draw_groups`` the same times.

Wiring into a ``GRPOTrainer`` subclass::

    def _get_train_sampler(self, dataset=None):
        if self.args.task_difficulty_file is None:
            return super()._get_train_sampler(dataset)
        dataset = self.train_dataset if dataset is None else dataset
        self._curriculum = CurriculumSampler(
            dataset["instance_id"],
            mini_repeat_count=self.num_generations,
            batch_size=self.args.generation_batch_size // self.num_generations,
            repeat_count=self.num_iterations * self.args.steps_per_generation,
            seed=self.args.seed,
            records=read_difficulty(self.args.task_difficulty_file),
            failed_share=self.args.curriculum_failed_share,
        )
        return self._curriculum

    # after the rewards are gathered, on every rank, group after group (G = num_generations):
    self._curriculum.update(instance_ids[g * G], tests_pass_values[g * G : (g + 1) * G])

    # dynamic sampling, for more task groups mid-step (dataset indices, the same on every rank):
    picked = self._curriculum.draw_groups(n, exclude=instance_ids_already_rolled_out)
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import Sampler

from aitlrt.tasks.difficulty import TaskDifficulty

log = logging.getLogger(__name__)

UNPROBED_RATE = 0.5
"""The solve rate assumed for a task never probed: maximal uncertainty, so the top weight of the mixed class."""


def task_weights(
    instance_ids: Sequence[str], records: Mapping[str, TaskDifficulty], failed_share: float
) -> list[float]:
    """Each task's draw probability (they sum to 1; see the module docstring); ValueError when every task is
    solved."""
    return _weights(instance_ids, {i: r.solved_rate for i, r in records.items()}, failed_share)


def _weights(instance_ids: Sequence[str], rates: Mapping[str, float], failed_share: float) -> list[float]:
    """``task_weights`` from each task's solve rate (a task missing from ``rates`` is unprobed)."""
    if not 0.0 <= failed_share <= 1.0:
        raise ValueError(f"failed_share must be in [0, 1], got {failed_share}")
    if not instance_ids:
        raise ValueError("no tasks to draw from")
    p = [rates.get(i, UNPROBED_RATE) for i in instance_ids]
    mixed = [x * (1.0 - x) if 0.0 < x < 1.0 else 0.0 for x in p]
    failed = [1.0 if x <= 0.0 else 0.0 for x in p]
    mixed_total, failed_total = sum(mixed), sum(failed)
    if not mixed_total and not failed_total:
        raise ValueError(
            f"every one of the {len(instance_ids)} tasks is always solved by the policy (solve rate 1): nothing "
            "left to learn from them; use harder tasks, or train without the curriculum (task_difficulty_file)"
        )
    share = failed_share if mixed_total and failed_total else float(not mixed_total)
    return [
        (1.0 - share) * m / (mixed_total or 1.0) + share * f / (failed_total or 1.0)
        for m, f in zip(mixed, failed, strict=True)
    ]


class CurriculumSampler(Sampler[int]):
    """trl's ``RepeatSampler`` with tasks drawn by difficulty: each chunk of ``batch_size`` dataset indices is drawn
    by ``task_weights``, every index repeated ``mini_repeat_count`` times in a row, the chunk ``repeat_count``
    times. One pass has as many chunks as ``RepeatSampler``'s (at least one); successive passes go on drawing.

    ``instance_ids``: the dataset's task id of each index (stands for ``RepeatSampler``'s ``data_source``);
    ``records``: the probe's sidecar (``aitlrt.tasks.difficulty.read_difficulty``)."""

    def __init__(
        self,
        instance_ids: Sequence[str],
        mini_repeat_count: int,
        batch_size: int = 1,
        repeat_count: int = 1,
        seed: int = 0,
        *,
        records: Mapping[str, TaskDifficulty] | None = None,
        failed_share: float = 0.2,
    ) -> None:
        self.instance_ids = list(instance_ids)
        self._known = set(self.instance_ids)
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.failed_share = failed_share
        self._rates = {i: r.solved_rate for i, r in (records or {}).items()}
        self._chunks = max(1, len(self.instance_ids) // batch_size)
        self._rng = random.Random(f"aitlrt-curriculum-{seed}")
        self._extra_rng = random.Random(f"aitlrt-curriculum-extra-{seed}")
        self._cached: list[float] | None = _weights(self.instance_ids, self._rates, failed_share)

    @property
    def weights(self) -> list[float]:
        """Each dataset index's draw probability now."""
        if self._cached is None:
            self._cached = _weights(self.instance_ids, self._rates, self.failed_share)
        return self._cached

    def __iter__(self) -> Iterator[int]:
        for _ in range(self._chunks):
            chunk = self._draw(self.batch_size, self._rng)
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return self._chunks * self.batch_size * self.mini_repeat_count * self.repeat_count

    def update(self, instance_id: str, rewards: Sequence[float]) -> None:
        """Make the task's latest group its difficulty: ``rewards`` are the group's per-rollout success values
        (``tests_pass``; a value >= 1 is solved; NaN, an unscorable rollout, is left out). A group all solved drops
        the task from later draws. KeyError for a task not in the dataset."""
        if instance_id not in self._known:
            raise KeyError(f"task {instance_id!r} is not in the curriculum's dataset")
        scored = [v for v in rewards if not math.isnan(v)]
        if not scored:
            return
        rate = sum(v >= 1.0 for v in scored) / len(scored)
        if rate >= 1.0 and self._rates.get(instance_id) != rate:
            log.info("curriculum: task %s solved by all %d rollouts, no longer drawn", instance_id, len(scored))
        self._rates[instance_id] = rate
        self._cached = None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the solve rates learned online and both random streams (JSON-serialisable)."""
        return {"rates": dict(self._rates), "rng": self._rng.getstate(), "extra_rng": self._extra_rng.getstate()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a checkpoint's ``state_dict``: its rates (for tasks still in the dataset) and random streams."""
        self._rates = {i: float(r) for i, r in state["rates"].items() if i in self._known}
        self._rng.setstate(_from_json(state["rng"]))
        self._extra_rng.setstate(_from_json(state["extra_rng"]))
        self._cached = None

    def draw_groups(self, n: int, exclude: Collection[str] = ()) -> list[int]:
        """``n`` more task groups (dataset indices, not repeated) by the current weights, preferring tasks not in
        ``exclude`` (instance ids, e.g. those already rolled out this step). Uses its own random stream, so extra
        rounds do not shift the sampler's chunks."""
        excluded = set(exclude)
        avoid = {i for i, iid in enumerate(self.instance_ids) if iid in excluded}
        return self._draw(n, self._extra_rng, avoid)

    def _draw(self, n: int, rng: random.Random, avoid: Collection[int] = frozenset()) -> list[int]:
        """``n`` indices by weight (Efraimidis-Spirakis keys: successive draws without replacement); once every
        task with weight was drawn, again from all of them."""
        weights = self.weights
        live = [i for i, w in enumerate(weights) if w > 0.0]
        pool = [i for i in live if i not in avoid] or live
        out: list[int] = []
        while len(out) < n:
            keys = {i: math.log(1.0 - rng.random()) / weights[i] for i in pool}
            out += sorted(pool, key=keys.__getitem__, reverse=True)[: n - len(out)]
            pool = live
        return out


def _from_json(state: Sequence[Any]) -> tuple[Any, ...]:
    """``random.Random.getstate()`` back from JSON (which made its tuples lists)."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)

"""The task curriculum: draw training tasks by their difficulty under the policy (the ``aitlrt tasks probe`` sidecar,
``aitlrt.tasks.difficulty``), updated online from the training rollouts.

Each task's difficulty is an estimate of its *success* ``p``: a rollout's weighted reward under the run's
``reward_weights``, scaled to [0, 1] by the largest it can be (the sum of the positive weights; ``tests_pass``
alone when none are given). The estimate is a Beta posterior (uniform prior; a rollout of success ``s`` adds ``s``
to ``a`` and ``1 - s`` to ``b``), seeded with the probe's rollouts and updated with each training group, older
evidence discounted by ``DISCOUNT`` per group (the policy changes: at most ``G / (1 - DISCOUNT)`` rollouts of
evidence). A group whose rollouts all get the same reward carries no GRPO gradient, so tasks are drawn by class:

- *retired* (confidently solved: ``mean - Z * sd >= RETIRE_AT``): weight 0, never drawn. One all-solved group of 4
  does not retire a task (``a = 5, b = 1``: lower bound 0.55): a task solved 70 % of the time does that with
  p = 0.7^4 = 0.24, and was retired forever by it; five all-solved groups in a row do (0.7^20 = 0.0008);
- *mixed* (some reward seen; unprobed tasks count here): ``1 - failed_share`` of the draws, shared in proportion
  to ``p (1 - p)`` (``p`` the posterior mean; unprobed: 0.5). ``p (1 - p)`` is the variance of a pass/fail
  reward, and bounds that of any reward in [0, 1] of mean ``p``: with group-relative advantages it is the expected
  squared advantage of a rollout, a lower bound on the expected improvement of a policy-gradient step on the task
  grows with it (Bae et al. 2025, *Online Difficulty Filtering for Reasoning Oriented RL*), and so does
  ``1 - p^G - (1 - p)^G``, the chance that a group of ``G`` carries any gradient at all. Tasks near 50 % come
  first; an unprobed task gets the top weight, so training probes it soon;
- *failed* (rollouts seen, none with any reward): ``failed_share`` of the draws, evenly (the policy may grow into
  them).

When a class is empty its share goes to the other; when both are empty (every task retired) a ``ValueError`` says
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
            reward_weights=dict(zip(self.reward_func_names, self.reward_weights.tolist())),
        )
        return self._curriculum

    # after the rewards are gathered, on every rank, group after group (G = num_generations):
    self._curriculum.update(instance_ids[g * G], weighted_rewards[g * G : (g + 1) * G])

    # dynamic sampling, for more task groups mid-step (dataset indices, the same on every rank):
    picked = self._curriculum.draw_groups(n, exclude=instance_ids_already_rolled_out)
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torch.utils.data import Sampler

from aitlrt.tasks.difficulty import TaskDifficulty

log = logging.getLogger(__name__)

SOLVED_REWARD = {"tests_pass": 1.0}
"""The success of a rollout when no reward weights are given: its tests pass."""
DISCOUNT = 0.8
"""Each group update first scales the evidence so far by this (an EMA over groups): at most ``G / 0.2`` rollouts of
evidence (20 for groups of 4), so the estimate follows the policy as it learns."""
RETIRE_AT = 0.8
Z = 2.0
"""A task is retired once ``mean - Z * sd`` of its success is at least ``RETIRE_AT`` (about 97.7 % sure of a
success above 0.8): from no evidence, five all-solved groups of 4 in a row."""


@dataclass
class Estimate:
    """A task's success under the policy: Beta(``a``, ``b``) (uniform prior), and whether any rollout of it was
    seen (``seen``) and earned any reward (``rewarded``)."""

    a: float = 1.0
    b: float = 1.0
    seen: bool = False
    rewarded: bool = False

    @property
    def mean(self) -> float:
        return self.a / (self.a + self.b)

    @property
    def retired(self) -> bool:
        n = self.a + self.b
        return self.mean - Z * math.sqrt(self.a * self.b / (n * n * (n + 1))) >= RETIRE_AT

    def add(self, successes: Sequence[float], discount: float = 1.0) -> None:
        """The evidence so far times ``discount``, plus these rollouts' successes (each in [0, 1])."""
        self.a = 1.0 + discount * (self.a - 1.0) + sum(successes)
        self.b = 1.0 + discount * (self.b - 1.0) + sum(1.0 - s for s in successes)
        self.seen = True
        self.rewarded = self.rewarded or any(s > 0.0 for s in successes)


def success_scale(reward_weights: Mapping[str, float]) -> float:
    """The largest weighted reward (every built-in reward is in [0, 1]): the sum of the positive weights."""
    scale = sum(w for w in reward_weights.values() if w > 0)
    if scale <= 0:
        raise ValueError(f"the curriculum needs a reward with a positive weight, got {dict(reward_weights)}")
    return scale


def prior(record: TaskDifficulty, reward_weights: Mapping[str, float]) -> Estimate:
    """The estimate after the probe's ``record.k`` rollouts: their mean success from the probe's per-reward means
    under ``reward_weights``, or its solve rate when the probe lacks one of the weighted rewards."""
    weighted = {name: w for name, w in reward_weights.items() if w}
    if all(name in record.rewards for name in weighted):
        mean = sum(w * record.rewards[name] for name, w in weighted.items()) / success_scale(reward_weights)
    else:
        mean = record.solved_rate
    mean = min(1.0, max(0.0, mean))
    estimate = Estimate()
    estimate.add([mean] * record.k)
    return estimate


def task_weights(
    instance_ids: Sequence[str],
    records: Mapping[str, TaskDifficulty],
    failed_share: float,
    reward_weights: Mapping[str, float] = SOLVED_REWARD,
) -> list[float]:
    """Each task's draw probability from the probe's records alone (they sum to 1; see the module docstring);
    ValueError when every task is retired."""
    return _weights(instance_ids, {i: prior(r, reward_weights) for i, r in records.items()}, failed_share)


def _weights(instance_ids: Sequence[str], estimates: Mapping[str, Estimate], failed_share: float) -> list[float]:
    """``task_weights`` from each task's estimate (a task missing from ``estimates`` is unprobed)."""
    if not 0.0 <= failed_share <= 1.0:
        raise ValueError(f"failed_share must be in [0, 1], got {failed_share}")
    if not instance_ids:
        raise ValueError("no tasks to draw from")
    tasks = [estimates.get(i, Estimate()) for i in instance_ids]
    failed = [1.0 if e.seen and not e.rewarded else 0.0 for e in tasks]
    mixed = [0.0 if f or e.retired else e.mean * (1.0 - e.mean) for e, f in zip(tasks, failed, strict=True)]
    mixed_total, failed_total = sum(mixed), sum(failed)
    if not mixed_total and not failed_total:
        raise ValueError(
            f"every one of the {len(instance_ids)} tasks is always solved by the policy (retired, success "
            f"confidently above {RETIRE_AT}): nothing left to learn from them; use harder tasks, or train without "
            "the curriculum (task_difficulty_file)"
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
        reward_weights: Mapping[str, float] = SOLVED_REWARD,
    ) -> None:
        self.instance_ids = list(instance_ids)
        self._known = set(self.instance_ids)
        self.mini_repeat_count = mini_repeat_count
        self.batch_size = batch_size
        self.repeat_count = repeat_count
        self.failed_share = failed_share
        self._scale = success_scale(reward_weights)
        self._estimates = {i: prior(r, reward_weights) for i, r in (records or {}).items()}
        self._chunks = max(1, len(self.instance_ids) // batch_size)
        self._rng = random.Random(f"aitlrt-curriculum-{seed}")
        self._extra_rng = random.Random(f"aitlrt-curriculum-extra-{seed}")
        self._cached: list[float] | None = _weights(self.instance_ids, self._estimates, failed_share)

    @property
    def weights(self) -> list[float]:
        """Each dataset index's draw probability now."""
        if self._cached is None:
            self._cached = _weights(self.instance_ids, self._estimates, self.failed_share)
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
        """Add the task's latest group to its estimate: ``rewards`` are the group's weighted rewards under the
        sampler's ``reward_weights`` (NaN, an unscorable rollout, is left out), the evidence before discounted by
        ``DISCOUNT``. KeyError for a task not in the dataset."""
        if instance_id not in self._known:
            raise KeyError(f"task {instance_id!r} is not in the curriculum's dataset")
        successes = [min(1.0, max(0.0, v / self._scale)) for v in rewards if not math.isnan(v)]
        if not successes:
            return
        estimate = self._estimates.setdefault(instance_id, Estimate())
        was_retired = estimate.retired
        estimate.add(successes, DISCOUNT)
        if estimate.retired and not was_retired:
            log.info(
                "curriculum: task %s solved confidently (success %.2f), no longer drawn", instance_id, estimate.mean
            )
        self._cached = None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the estimates learned online and both random streams (JSON-serialisable)."""
        return {
            "estimates": {i: asdict(e) for i, e in self._estimates.items()},
            "rng": self._rng.getstate(),
            "extra_rng": self._extra_rng.getstate(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a checkpoint's ``state_dict``: its estimates (for tasks still in the dataset) and random
        streams."""
        saved = state.get("estimates", {})
        self._estimates = {i: Estimate(**e) for i, e in saved.items() if i in self._known}
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

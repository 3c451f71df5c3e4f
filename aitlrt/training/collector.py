"""The rollout collector: one step's rollouts of this rank's slice (task x ``num_generations``), scored, in rounds.

It keeps what lives across steps: the ``Task`` built once per instance id and its checkout, the runner (one per
run: it keeps the recycled workspaces), the early grader (grades each rollout as it ends, when a reward runs the
tests), the rollouts run ahead (``max_staleness`` 1, ``aitlrt.training.pipeline``) and the curriculum sampler.

Dynamic sampling: a round's rewards and advantages are gathered over ranks (a group may straddle ranks), so every
rank sees the same informative groups (reward variance among at least two scorable rollouts); further rounds of
new task groups are drawn (by the curriculum when there is one, else uniformly, preferring tasks not yet rolled
out in this step, the same draw on every rank) until ``min_informative_groups`` or ``max_sampling_rounds``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from accelerate.utils import gather, gather_object

from aitlrt.rewards.builtin import GRADED
from aitlrt.rewards.inputs import reward_row
from aitlrt.rewards.runtime import EarlyGrader, grader_failure
from aitlrt.rollout.batch import agent_task
from aitlrt.rollout.runner import RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.tasks.difficulty import read_difficulty
from aitlrt.tasks.task import Task, task_from_row
from aitlrt.training.advantages import rollout_advantages
from aitlrt.training.curriculum import CurriculumSampler
from aitlrt.training.failures import unscorable_reason
from aitlrt.training.pipeline import RolloutsAhead, Taken

Score = Callable[[list[dict[str, Any]], list[Any], list[str], dict[str, str]], torch.Tensor]
"""(reward rows, prompts, completions, errors) -> rewards per rollout and function, gathered over ranks (trl's
``_calculate_rewards``; a function that raises gives NaN, its error in ``errors``)."""


def informative_groups(weighted: torch.Tensor, zero_std: torch.Tensor, group: int) -> torch.Tensor:
    """Per rollout (laid out group after group): whether its group carries a gradient, i.e. has reward variance
    (``zero_std`` False) among at least two scorable rollouts (``weighted`` not NaN)."""
    scorable = (~torch.isnan(weighted)).view(-1, group).sum(dim=1) >= 2
    varied = ~zero_std.view(-1, group).all(dim=1)
    return (scorable & varied).repeat_interleave(group)


@dataclass
class SamplingRound:
    """One round of rollouts of a step: this rank's inputs and outcomes, the rewards and advantages of every
    rank's (gathered, group after group) and which of them belong to informative groups."""

    inputs: list[dict[str, Any]]
    outcomes: list[RolloutOutcome]
    rewards_per_func: torch.Tensor
    weighted: torch.Tensor
    advantages: torch.Tensor
    zero_std: torch.Tensor
    informative: torch.Tensor
    local: slice
    """This rank's rollouts in the gathered tensors."""
    reasons: list[str]
    """Why each of this rank's rollouts is unscorable ("": it is not; ``failures.unscorable_reason``)."""
    instance_ids: list[str]
    """Every rank's rollouts' task ids, gathered."""
    group: int
    rollout_s: float
    reward_s: float

    @property
    def groups(self) -> int:
        return len(self.instance_ids) // self.group

    @property
    def informative_groups(self) -> int:
        return int(self.informative.sum()) // self.group

    def kept(self, i: int) -> bool:
        """Whether this rank's rollout ``i`` is trained on."""
        return bool(self.informative[self.local][i])


@dataclass
class Scoring:
    """How rollouts are scored: trl's reward functions (``score``, their ``names`` and ``weights``) and the
    advantages' ``scale`` and ``aggregation``."""

    score: Score
    names: list[str]
    weights: torch.Tensor
    scale: str
    aggregation: str


class RolloutCollector:
    """This rank's rollouts of a step, in dynamic-sampling rounds (``sample``), with the rollouts of the next step
    run ahead when pipelined (``take_ahead``/``run_ahead``). ``trainer``: its ``args``, ``accelerator``, ``state``
    and ``train_dataset`` are read; ``served_model``: the served model's name, asked when the runner starts."""

    def __init__(self, trainer: Any, agent: Any, proxy_url: str, served_model: Callable[[], str]) -> None:
        self.trainer = trainer
        self.args = trainer.args
        self.agent = agent
        self.proxy_url = proxy_url
        self.served_model = served_model
        self.tasks: dict[str, Task] = {}
        self._checkouts: dict[str, tuple[Path, str]] = {}
        self._runner: RolloutRunner | None = None
        self.curriculum: CurriculumSampler | None = None
        self.curriculum_state: dict[str, Any] | None = None  # from the checkpoint resumed, for the sampler
        self._early_grader: EarlyGrader | None = None
        self.ahead: RolloutsAhead | None = None
        self.peeked: tuple[Any, Any] | None = None  # (epoch iterator, the next step's generation batch)
        self._graded = False

    def start(self, reward_funcs: list[Any]) -> None:
        """The background helpers: the early grader (when a reward runs the tests) and the rollouts run ahead
        (``max_staleness`` 1); threads start on first use."""
        self._graded = any(f in GRADED for f in reward_funcs)
        self._early_grader = EarlyGrader() if self._graded else None
        self.ahead = RolloutsAhead() if self.args.max_staleness else None

    def close(self) -> None:
        """Wait for rollouts run ahead, stop the agents and remove the idle workspaces; the collector can collect
        again after it."""
        if self.ahead is not None:
            self.ahead.close()
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._early_grader is not None:
            self._early_grader.close()
        if hasattr(self.agent, "close"):
            self.agent.close()
        self._early_grader = EarlyGrader() if self._graded else None
        self.ahead = RolloutsAhead() if self.args.max_staleness else None

    def task(self, row: dict[str, Any]) -> Task:
        """The row's ``Task``, built once per instance id."""
        if row["instance_id"] not in self.tasks:
            self.tasks[row["instance_id"]] = task_from_row(row)
        return self.tasks[row["instance_id"]]

    def _checkout(self, task: Task) -> tuple[Path, str]:
        if task.instance_id not in self._checkouts:
            self._checkouts[task.instance_id] = task.checkout()
        return self._checkouts[task.instance_id]

    def rollouts(self, inputs: list[dict[str, Any]], step: int | None = None) -> list[RolloutOutcome]:
        """This rank's rollouts of ``inputs`` for training step ``step`` (default: the current one)."""
        args = self.args
        if self._runner is None:
            self._runner = RolloutRunner(
                self.agent,
                self.proxy_url,
                self.served_model(),
                concurrency=cast(int, args.rollout_concurrency),  # set by AgentGRPOConfig
                timeout_s=args.rollout_timeout_s,
                max_calls=args.rollout_max_calls,
                context_window=args.context_window,
                recycle_workspaces=args.recycle_workspaces,
            )
        done = self.trainer.state.global_step if step is None else step - 1
        tag = f"s{done:05d}-r{self.trainer.accelerator.process_index}-{uuid.uuid4().hex[:6]}"
        requests, rows = [], {}
        settings = args.rollout_settings()  # the test feedback's
        for i, row in enumerate(inputs):
            task = self.task(row)
            repo, base = self._checkout(task)
            requests.append(RolloutRequest(f"{tag}-{i:03d}", agent_task(task, settings), repo, base))
            rows[requests[-1].rollout_id] = row

        def grade_early(outcome: RolloutOutcome) -> None:
            if self._early_grader is not None:
                row = rows[outcome.rollout_id]
                self._early_grader.submit(reward_row(row, self.task(row), outcome))

        return self._runner.run(requests, on_outcome=grade_early)

    # ---- pipelined steps -------------------------------------------------------------------------------------
    def take_ahead(self, inputs: list[dict[str, Any]]) -> Taken | None:
        """The rollouts run ahead for the coming step on ``inputs``, if any (waiting for them)."""
        return None if self.ahead is None else self.ahead.take(inputs, self.trainer.state.global_step + 1)

    def wait_ahead(self) -> None:
        """Wait for the rollouts run ahead (never cut their calls with a weight sync)."""
        if self.ahead is not None:
            self.ahead.wait()

    def run_ahead(self, version: int) -> None:
        """Pipelined: start the next step's first round of rollouts in the background, with the weights the server
        has now (``version``; none after the last step or the epoch's last batch)."""
        state = self.trainer.state
        step = state.global_step + 2
        if self.ahead is None or self.peeked is None or step > state.max_steps:
            return
        inputs = self.peeked[1]
        self.ahead.start(inputs, step, version, lambda: self.rollouts(inputs, step))

    # ---- one step's rounds -----------------------------------------------------------------------------------
    def sample(
        self,
        inputs: list[dict[str, Any]],
        group: int,
        scoring: Scoring,
        training: bool,
        taken: Taken | None,
        on_round: Callable[[SamplingRound], None],
    ) -> list[SamplingRound]:
        """The step's rounds: ``inputs`` (rolled out, or the rollouts run ahead, ``taken``), then in training
        further rounds until enough groups are informative (module docstring); ``on_round`` after each."""
        rounds = [self._round(inputs, group, scoring, training, taken, on_round)]
        limit = self.args.max_sampling_rounds if training else 1
        while len(rounds) < limit and sum(r.informative_groups for r in rounds) < self.args.min_informative_groups:
            more = self.more_inputs(len(inputs), group, rounds)
            rounds.append(self._round(more, group, scoring, training, None, on_round))
        return rounds

    def _round(
        self,
        inputs: list[dict[str, Any]],
        group: int,
        scoring: Scoring,
        training: bool,
        taken: Taken | None,
        on_round: Callable[[SamplingRound], None],
    ) -> SamplingRound:
        """Roll out (or take ``taken``) and score this rank's ``inputs`` (whole groups over all ranks).
        ``rollout_s``: the seconds this step waited for the rollouts."""
        t1 = time.monotonic()
        outcomes = self.rollouts(inputs) if taken is None else taken.outcomes
        t2 = time.monotonic()
        waited = t2 - t1 if taken is None else taken.waited_s
        scored = [reward_row(row, self.task(row), o) for row, o in zip(inputs, outcomes, strict=True)]
        errors: dict[str, str] = {}
        rewards_per_func = scoring.score(scored, [row["prompt"] for row in inputs], [o.patch for o in outcomes], errors)
        # A rollout that failed outside the policy (runner.infrastructure_failure) or got a NaN reward (a grade
        # that failed on the grader's side, a reward function that raised) is unscorable: all its rewards NaN, it
        # leaves the group's baseline and gets advantage 0; the trainer trains none of its tokens.
        rank = self.trainer.accelerator.process_index
        local = slice(rank * len(inputs), (rank + 1) * len(inputs))
        reasons = self._unscorable_reasons(scoring.names, outcomes, scored, rewards_per_func[local], errors)
        infrastructure = gather(torch.tensor([int(o.unscorable) for o in outcomes], device=rewards_per_func.device))
        rewards_per_func[infrastructure.bool() | torch.isnan(rewards_per_func).any(dim=1)] = torch.nan
        weights = scoring.weights.to(rewards_per_func.device)
        weighted = (rewards_per_func * weights.unsqueeze(0)).sum(dim=1)
        advantages, zero_std = rollout_advantages(
            rewards_per_func, weighted, scoring.weights, group, scoring.scale, scoring.aggregation
        )
        ids = [i for chunk in gather_object([[self.task(row).instance_id for row in inputs]]) for i in chunk]
        rnd = SamplingRound(
            inputs=inputs,
            outcomes=outcomes,
            rewards_per_func=rewards_per_func,
            weighted=weighted,
            advantages=advantages,
            zero_std=zero_std,
            informative=informative_groups(weighted, zero_std, group),
            local=local,
            reasons=reasons,
            instance_ids=ids,
            group=group,
            rollout_s=waited,
            reward_s=time.monotonic() - t2,
        )
        on_round(rnd)
        if self.curriculum is not None and self.args.curriculum_update and training:
            self._curriculum_update(rnd)
        return rnd

    @staticmethod
    def _unscorable_reasons(
        names: list[str],
        outcomes: list[RolloutOutcome],
        scored: list[dict[str, Any]],
        rewards: torch.Tensor,
        errors: dict[str, str],
    ) -> list[str]:
        """Per rollout of this rank, why it is unscorable ("": it is not): ``failures.unscorable_reason`` of its
        outcome and NaN rewards (``rewards``: per rollout and reward function), with the grade's failure if any."""
        reasons = []
        for outcome, row, bad in zip(outcomes, scored, torch.isnan(rewards).tolist(), strict=True):
            nan = [name for name, b in zip(names, bad, strict=True) if b]
            reason = unscorable_reason(outcome, nan, errors)
            if nan and not outcome.unscorable and (graded := grader_failure(row)):
                reason += f"; {graded}"
            reasons.append(reason)
        return reasons

    # ---- the curriculum --------------------------------------------------------------------------------------
    def sampler(
        self, dataset: Any, group: int, num_iterations: int, reward_weights: dict[str, float]
    ) -> CurriculumSampler:
        """With ``task_difficulty_file``: the curriculum's sampler of trl's ``RepeatSampler`` contract
        (``aitlrt.training.curriculum``; a task's success is its weighted reward under ``reward_weights``), resumed
        from ``curriculum_state`` when a checkpoint gave one."""
        self.curriculum = CurriculumSampler(
            dataset["instance_id"],
            mini_repeat_count=group,
            batch_size=cast(int, self.args.generation_batch_size) // group,
            repeat_count=num_iterations * cast(int, self.args.steps_per_generation),
            seed=self.args.seed,
            records=read_difficulty(cast(str, self.args.task_difficulty_file)),
            failed_share=self.args.curriculum_failed_share,
            reward_weights=reward_weights,
        )
        if self.curriculum_state is not None:  # resumed: go on from what the checkpoint's run had learned
            self.curriculum.load_state_dict(self.curriculum_state)
        return self.curriculum

    def _curriculum_update(self, rnd: SamplingRound) -> None:
        """Each group's weighted rewards update its task's difficulty (every rank, the same gathered values)."""
        if self.curriculum is None:
            return
        weighted = rnd.weighted.tolist()
        for g in range(rnd.groups):
            self.curriculum.update(rnd.instance_ids[g * rnd.group], weighted[g * rnd.group : (g + 1) * rnd.group])

    def more_inputs(self, count: int, group: int, rounds: list[SamplingRound]) -> list[dict[str, Any]]:
        """This rank's share of a further round: new task groups from the dataset (module docstring)."""
        dataset = cast(Any, self.trainer.train_dataset)
        world = self.trainer.accelerator.num_processes
        groups = count * world // group
        used = {i for r in rounds for i in r.instance_ids}
        if self.curriculum is not None:
            picked = self.curriculum.draw_groups(groups, exclude=used)
        else:
            seed = (self.args.seed + 1) * 1_000_003 + self.trainer.state.global_step * 1_009 + len(rounds)
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
            fresh = [i for i in order if dataset[i]["instance_id"] not in used]
            picked = (fresh + order * (groups // max(1, len(order)) + 1))[:groups]
        everyone = [dataset[i] for i in picked for _ in range(group)]
        rank = self.trainer.accelerator.process_index
        return everyone[rank * count : (rank + 1) * count]

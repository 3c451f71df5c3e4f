"""``AgentGRPOTrainer``: trl's ``GRPOTrainer`` whose generation step is parallel agent rollouts.

One step on each rank: sync the policy to the server when it changed (``aitlrt.training.weight_sync``), run one
agent per prompt of the rank's slice (task x ``num_generations``) through ``aitlrt-serve``, score each rollout's
final patch with the reward functions (on ``aitlrt.rewards.inputs.reward_row`` rows, with the ``Task`` built once per
instance id; trl's ``_calculate_rewards``: gathered over ranks, so a group may straddle ranks), turn group-relative
advantages into per-token advantages on rows built from the exact recorded tokens (``aitlrt.training.rows``), pad
every rank to the same row count (ZeRO-3 and trl's gathers need equal shapes; padding rows carry no loss), and hand
trl's loss the batch it expects.

Importance sampling: trl corrects for the sampler only when it runs vLLM itself, so AITLRT computes trl's
``vllm_importance_sampling_*`` ratio against the recorded sampler logprobs (a sequence-level ratio spans the whole
rollout) and multiplies each token's advantage by it: trl multiplies the per-token loss by that ratio (>= 0), and
every trl loss is positively homogeneous in the advantage, so the loss is trl's; ``vespo``, which folds the ratio
into its own weight, gets it as trl's ``importance_sampling_ratio`` instead. On-policy (one optimizer step per
generation) with a token-level mode, the ratio comes from the loss forward's own logprobs, detached (the policy at the
start of the update is the one trl's ``old_per_token_logps`` would hold), so no separate no-grad forward runs; else
``_batch`` runs that forward first, as trl does. The LM head sees only the scored positions
(``aitlrt.common.lm_head``).

A rollout weighs in the loss as one of trl's completions, however many rows it became and however many
zero-loss padding rows its rank got (``_rollout_weights`` scales the rows' advantages):
- ``dapo``, ``cispo``, ``vespo``: each trained token 1 / (trained tokens of the generation batch, all ranks);
  ``bnpo``: 1 / (trained tokens of the micro-batch). trl's own normalisers; rows and padding do not enter.
- ``grpo``, ``sapo``: the rollout's token-mean loss (over all its rows) 1 / (rollouts per micro-batch).
- ``luspo``: the rollout's token-sum loss 1 / (rollouts per micro-batch); ``dr_grpo``: 1 / (rollouts per
  micro-batch x ``max_completion_length``).
With ``beta != 0`` (token-normalised losses only, ``AgentGRPOConfig``) the KL term is weighted per token as the
policy term is.

Memory: every forward/backward holds at most ``max_tokens_per_forward`` padded tokens (``micro_batches``: rows of
similar length together, each micro-batch padded to its own longest row). ``compute_loss`` runs trl's loss on each
micro-batch of the chunk, backward on all but the last (returned to the Trainer's backward), scaled so the sum is
trl's loss of the whole chunk: x1 for ``dapo``/``cispo``/``vespo`` (global ``num_items_in_batch``), x(micro-batch
trained tokens / chunk trained tokens) for ``bnpo``, x(micro-batch rows / chunk rows) for ``grpo``/``sapo``/
``luspo``/``dr_grpo``; the KL term is inside trl's per-token loss and scales with it. Its logged metrics are merged
per chunk (min/max keys: min/max; the others: weighted by each pass's trained tokens, all ranks). Every rank runs the
largest rank's number of passes (ZeRO-3 collectives): the extra ones are zero-loss passes over one row.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import math
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from accelerate.utils import DistributedType, gather, gather_object, is_peft_model
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanmax, nanmin, pad, use_adapter

from aitlrt.common.lm_head import scored_positions_only
from aitlrt.common.shared_prefix import prefix_batches, shared_prefix_forward, use_shared_prefix
from aitlrt.rewards.builtin import GRADED, EarlyGrader, grader_failure
from aitlrt.rewards.inputs import guarded, reward_row
from aitlrt.rollout.agents import make_agent
from aitlrt.rollout.batch import agent_task
from aitlrt.rollout.runner import RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.rollout.timing import time_split
from aitlrt.tasks.difficulty import read_difficulty
from aitlrt.tasks.task import Task, task_from_row
from aitlrt.training.advantages import rollout_advantages
from aitlrt.training.config import ROW_NORMALISED_LOSSES, AgentGRPOConfig
from aitlrt.training.curriculum import CurriculumSampler
from aitlrt.training.failures import UnscorableSteps, unscorable_reason
from aitlrt.training.pipeline import RolloutsAhead, Taken
from aitlrt.training.probe import check_sampling, make_weight_probe
from aitlrt.training.rows import Row, RowStats, build_rows
from aitlrt.training.weight_sync import make_weight_sync, proxy_request, zero3

log = logging.getLogger(__name__)

CURRICULUM_STATE = "curriculum.json"
"""In each checkpoint of a curriculum run: ``CurriculumSampler.state_dict``, for a resumed run to go on from."""
PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def micro_batches(prompt_lens: list[int], completion_lens: list[int], budget: int | None) -> list[list[int]]:
    """Row indices in micro-batches whose padded size, rows x (longest prompt + longest completion), fits
    ``budget`` (a longer row goes alone; None: one micro-batch), longest rows first so similar lengths share one."""
    if budget is None:
        return [list(range(len(prompt_lens)))] if prompt_lens else []
    order = sorted(range(len(prompt_lens)), key=lambda i: (prompt_lens[i] + completion_lens[i], prompt_lens[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    width_p = width_c = 0
    for i in reversed(order):
        p, c = max(width_p, prompt_lens[i]), max(width_c, completion_lens[i])
        if current and (len(current) + 1) * (p + c) > budget:
            groups.append(sorted(current))
            current, p, c = [], prompt_lens[i], completion_lens[i]
        current.append(i)
        width_p, width_c = p, c
    if current:
        groups.append(sorted(current))
    return groups


def row_tokens(batch: dict[str, Any]) -> list[list[int]]:
    """Each row of ``batch`` (trl's layout) as its tokens: prompt then completion, no padding."""
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    parts = zip(*(batch[key] for key in keys), strict=True)
    return [p[pm.bool()].tolist() + c[cm.bool()].tolist() for p, pm, c, cm in parts]


def slice_rows(batch: dict[str, Any], rows: list[int], multiple: int | None = None) -> dict[str, Any]:
    """``batch`` (trl's: prompts left-padded, completion-aligned tensors right-padded) restricted to ``rows`` and
    padded only to their own longest prompt and completion (rounded up to ``multiple``: trl's
    ``pad_to_multiple_of``)."""

    def rounded(needed: int, full: int) -> int:
        return min(full, -(-needed // multiple) * multiple) if multiple else needed

    index = torch.tensor(rows, device=batch["prompt_mask"].device)
    width = batch["completion_mask"].size(1)
    prompt_width = rounded(int(batch["prompt_mask"][index].sum(dim=1).max()), batch["prompt_mask"].size(1))
    completion_width = rounded(max(1, int(batch["completion_mask"][index].sum(dim=1).max())), width)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
            continue
        value = value[index]
        if key in PROMPT_KEYS:
            value = value[:, value.size(1) - prompt_width :]
        elif value.dim() == 2 and value.size(1) == width:
            value = value[:, :completion_width]
        out[key] = value
    return out


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


class WeightVersionError(RuntimeError):
    """Rows were sampled by another weight version than the trainer synced: the sync silently failed."""


class AgentGRPOTrainer(GRPOTrainer):
    args: AgentGRPOConfig

    def __init__(self, *args: Any, agent=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.args.proxy_url:
            raise ValueError("AgentGRPOConfig.proxy_url is required (the aitlrt-serve URL)")
        self.proxy_url = self.args.proxy_url.rstrip("/")
        self.agent = agent or make_agent(self.args.agent, self.args.edit_format, self.args.aider_reminder)
        self._served_model = ""  # asked of the proxy at the first generation
        self.weight_sync = make_weight_sync(self.args)
        self.weight_version = -1
        self._synced_step = self.state.global_step  # the server starts with the initial weights
        self.weight_probe = make_weight_probe(self.args, self._tokenizer)  # None: weight_probe=False
        self._tasks: dict[str, Task] = {}
        self._checkouts: dict[str, tuple[Path, str]] = {}
        self._runner: RolloutRunner | None = None  # one for the whole run: it keeps the recycled workspaces
        self._generation_s = 0.0
        self._step_s = 0.0  # wall time of the optimizer step so far
        self._skip_update = False  # this generation's groups all lacked reward variance (dynamic sampling)
        self._prepared: Any = None
        self._weights_changed = False  # an update ran since the last sync
        self._curriculum: CurriculumSampler | None = None
        self._curriculum_state: dict[str, Any] | None = None  # from the checkpoint resumed, for the sampler
        self._early_grader: EarlyGrader | None = None  # grades each rollout as it ends
        self._ahead: RolloutsAhead | None = None  # pipelined steps
        self._start_background()
        self._unscorable_steps = UnscorableSteps(self.args.max_unscorable_steps, self.proxy_url)
        self._peeked: tuple[Any, Any] | None = None  # (epoch iterator, the next step's generation batch)
        self._fused_part: dict[str, Any] | None = None  # the micro-batch whose loss forward computes it
        self._shares_prefix: bool | None = None  # decided at the first forward (_shared_prefix)

    # ---- the weight sync ---------------------------------------------------------------------------------------
    def sync_weights(self) -> float:
        """Push the current policy to the server (every rank calls), learn the new weight version and check that the
        server now serves the policy (the weight probe); the seconds it took."""
        if self._ahead is not None:
            self._ahead.wait()  # never cut the calls of rollouts running ahead
        started = time.monotonic()
        version = self.weight_sync.sync(self)
        if version is not None:
            self.weight_version = version
            self._probe_weights()
        self._synced_step = self.state.global_step
        self._weights_changed = False
        return time.monotonic() - started

    def sync_final_weights(self) -> None:
        """After training (every rank): push the policy to the server if an update ran since the last sync."""
        if self._weights_changed:
            self.sync_weights()

    def _probe_weights(self) -> None:
        """Fail unless the server scores the probe as the policy does (``aitlrt.training.probe``; every rank calls);
        log the gap."""
        if self.weight_probe is None:
            return
        mode = "train" if cast(torch.nn.Module, self.model).training else "eval"
        gap = self.weight_probe.check(self, self.weight_version)
        self._metrics[mode]["weight_probe/mean_gap"].append(gap.mean)
        self._metrics[mode]["weight_probe/max_gap"].append(gap.max)

    # ---- one generation step ---------------------------------------------------------------------------------
    def _task(self, row: dict[str, Any]) -> Task:
        """The row's ``Task``, built once per instance id."""
        if row["instance_id"] not in self._tasks:
            self._tasks[row["instance_id"]] = task_from_row(row)
        return self._tasks[row["instance_id"]]

    def _checkout(self, task: Task) -> tuple[Path, str]:
        if task.instance_id not in self._checkouts:
            self._checkouts[task.instance_id] = task.checkout()
        return self._checkouts[task.instance_id]

    def _rollouts(self, inputs: list[dict[str, Any]], step: int | None = None) -> list[RolloutOutcome]:
        """This rank's rollouts of ``inputs`` for training step ``step`` (default: the current one)."""
        if self._runner is None:
            self._runner = RolloutRunner(
                self.agent,
                self.proxy_url,
                self._served_model,
                concurrency=cast(int, self.args.rollout_concurrency),  # set by AgentGRPOConfig
                timeout_s=self.args.rollout_timeout_s,
                max_calls=self.args.rollout_max_calls,
                context_window=self.args.context_window,
                recycle_workspaces=self.args.recycle_workspaces,
            )
        done = self.state.global_step if step is None else step - 1
        tag = f"s{done:05d}-r{self.accelerator.process_index}-{uuid.uuid4().hex[:6]}"
        requests, rows = [], {}
        settings = self.args.rollout_settings()  # the test feedback's
        for i, row in enumerate(inputs):
            task = self._task(row)
            repo, base = self._checkout(task)
            requests.append(RolloutRequest(f"{tag}-{i:03d}", agent_task(task, settings), repo, base))
            rows[requests[-1].rollout_id] = row

        def grade_early(outcome: RolloutOutcome) -> None:
            if self._early_grader is not None:
                row = rows[outcome.rollout_id]
                self._early_grader.submit(reward_row(row, self._task(row), outcome))

        return self._runner.run(requests, on_outcome=grade_early)

    def _start_background(self) -> None:
        """The background helpers: the early grader (when a reward runs the tests) and the rollouts run ahead
        (``max_staleness`` 1); threads start on first use."""
        graded = any(f in GRADED for f in self.reward_funcs)
        self._early_grader = EarlyGrader() if graded else None
        self._ahead = RolloutsAhead() if self.args.max_staleness else None

    def close(self) -> None:
        """Wait for rollouts run ahead, stop the agents and remove the idle workspaces (call when training is over;
        the trainer can train again after it)."""
        if self._ahead is not None:
            self._ahead.close()
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self._early_grader is not None:
            self._early_grader.close()
        if hasattr(self.agent, "close"):
            self.agent.close()
        self._start_background()

    def _connect(self) -> None:
        """At the first generation: check that the server forces the config's sampling and, unless a sync comes
        first, serves the policy; learn the weight version and the served model."""
        if not self._served_model:
            forced = proxy_request(self.proxy_url, "GET", "/settings").json()["sampling"]
            check_sampling(self.args, forced, self.proxy_url)
            self.weight_version = proxy_request(self.proxy_url, "GET", "/weights").json()["weight_version"]
            if self.state.global_step == self._synced_step:  # else the sync before this generation probes
                self._probe_weights()
            self._served_model = proxy_request(self.proxy_url, "GET", "/v1/models").json()["data"][0]["id"]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if cast(torch.nn.Module, self.model).training else "eval"
        t0 = time.monotonic()
        self._connect()
        taken = None
        if self._ahead is not None and mode == "train":
            taken = self._ahead.take(inputs, self.state.global_step + 1)
        sync_s = 0.0
        if self.state.global_step != self._synced_step and self._weights_changed:
            sync_s = self.sync_weights()
        group = cast(int, self.num_generations if mode == "train" else self.num_generations_eval)  # set by trl
        rounds = [self._sample_round(inputs, mode, group, taken)]
        limit = self.args.max_sampling_rounds if mode == "train" else 1
        while len(rounds) < limit and sum(r.informative_groups for r in rounds) < self.args.min_informative_groups:
            rounds.append(self._sample_round(self._more_inputs(len(inputs), group, rounds), mode, group))
        informative = sum(r.informative_groups for r in rounds)
        self._skip_update = mode == "train" and informative == 0
        t3 = time.monotonic()

        # Dynamic sampling: only the rollouts of groups with reward variance are trained on (training mode).
        keep = [(r, i) for r in rounds for i in range(len(r.outcomes)) if mode != "train" or r.kept(i)]
        outcomes = [r.outcomes[i] for r, i in keep]
        unscorable = {j for j, (r, i) in enumerate(keep) if r.reasons[i]}
        rows, owners, stats = self._rows(outcomes, unscorable, mode, None if taken is None else taken.version)
        advantages = [float(r.advantages[r.local][i]) for r, i in keep]
        batch, gap = self._batch(rows, owners, advantages, mode, self._truncated(outcomes))
        t4 = time.monotonic()
        self._log_step(mode, group, rounds, rows, stats, batch, gap)
        metrics = self._metrics[mode]
        metrics["sampling/groups"].append(float(sum(r.groups for r in rounds)))
        metrics["sampling/informative_groups"].append(float(informative))
        metrics["sampling/rounds"].append(float(len(rounds)))
        metrics["sampling/skipped_update"].append(float(self._skip_update))
        metrics["time/sync_s"].append(sync_s)
        metrics["time/rollouts_s"].append(sum(r.rollout_s for r in rounds))
        metrics["time/rewards_s"].append(sum(r.reward_s for r in rounds))
        metrics["time/rows_s"].append(t4 - t3)
        self._generation_s += time.monotonic() - t0
        if self._skip_update:
            log.info(
                "step %d: no informative group in %d round(s) of %d group(s): update skipped",
                self.state.global_step + 1,
                len(rounds),
                sum(r.groups for r in rounds),
            )
        if self.args.save_rollouts and mode == "train":
            self._save_rollouts(rounds, rows, owners, keep)
        if mode == "train":
            self._watch_unscorable(rounds)
            self._run_ahead()
        return batch

    def _watch_unscorable(self, rounds: list[SamplingRound]) -> None:
        """Stop the run (``UnscorableStepsError``) after ``max_unscorable_steps`` consecutive steps whose every
        rollout (all rounds, all ranks) was unscorable (every rank decides alike, on the gathered rewards)."""
        everything = all(bool(torch.isnan(r.weighted).all()) for r in rounds)
        reasons = [reason for r in rounds for reason in r.reasons] if everything else []
        everyone = [reason for chunk in gather_object([reasons]) for reason in chunk] if everything else []
        self._unscorable_steps.observe(self.state.global_step + 1, everything, everyone)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """transformers'; pipelined, it also reads the next step's first batch (the generation batch that step rolls
        out, ``_run_ahead``), which the next call returns first."""
        if self._ahead is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        peeked, self._peeked = self._peeked, None
        head = [peeked[1]] if peeked is not None and peeked[0] is epoch_iterator else []
        batches, items = super().get_batch_samples(itertools.chain(head, epoch_iterator), num_batches, device)
        if len(batches) == num_batches:
            following = next(epoch_iterator, None)
            self._peeked = None if following is None else (epoch_iterator, following)
        return batches, items

    def _run_ahead(self) -> None:
        """Pipelined: start the next step's first round of rollouts in the background, with the weights the server
        has now (none after the last step or the epoch's last batch)."""
        step = self.state.global_step + 2
        if self._ahead is None or self._peeked is None or step > self.state.max_steps:
            return
        inputs = self._peeked[1]
        self._ahead.start(inputs, step, self.weight_version, lambda: self._rollouts(inputs, step))

    def _sample_round(
        self, inputs: list[dict[str, Any]], mode: str, group: int, taken: Taken | None = None
    ) -> SamplingRound:
        """Roll out (or take the rollouts run ahead, ``taken``) and score this rank's ``inputs`` (whole groups over
        all ranks); rewards and advantages are gathered over ranks, so every rank sees the same informative
        groups. ``rollout_s``: the seconds this step waited for the rollouts."""
        t1 = time.monotonic()
        outcomes = self._rollouts(inputs) if taken is None else taken.outcomes
        t2 = time.monotonic()
        waited = t2 - t1 if taken is None else taken.waited_s
        scored = [reward_row(row, self._task(row), o) for row, o in zip(inputs, outcomes, strict=True)]
        prompts = [row["prompt"] for row in inputs]
        completions = [o.patch for o in outcomes]
        errors: dict[str, str] = {}
        rewards_per_func = self._calculate_rewards(scored, prompts, completions, [[] for _ in inputs], errors)
        # A rollout that failed outside the policy (runner.infrastructure_failure) or got a NaN reward (a grade
        # that failed on the grader's side, a reward function that raised) is unscorable: all its rewards NaN, it
        # leaves the group's baseline and gets advantage 0; ``_rows`` trains none of its tokens.
        rank = self.accelerator.process_index
        local = slice(rank * len(inputs), (rank + 1) * len(inputs))
        reasons = self._unscorable_reasons(outcomes, scored, torch.isnan(rewards_per_func[local]), errors)
        infrastructure = gather(torch.tensor([int(o.unscorable) for o in outcomes], device=rewards_per_func.device))
        rewards_per_func[infrastructure.bool() | torch.isnan(rewards_per_func).any(dim=1)] = torch.nan
        weighted = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).sum(dim=1)
        advantages, zero_std = rollout_advantages(
            rewards_per_func, weighted, self.reward_weights, group, self.scale_rewards, self.multi_objective_aggregation
        )
        ids = [i for chunk in gather_object([[self._task(row).instance_id for row in inputs]]) for i in chunk]
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
        self._record_completions(mode, inputs, outcomes, rewards_per_func, advantages)
        if self._curriculum is not None and self.args.curriculum_update and mode == "train":
            self._curriculum_update(rnd, group)
        return rnd

    def _calculate_rewards(
        self,
        inputs: list[dict[str, Any]],
        prompts: list[Any],
        completions: list[Any],
        completion_ids_list: list[Any],
        errors: dict[str, str] | None = None,
    ) -> torch.Tensor:
        """trl's, with each plain reward function ``guarded``: one that raises gives NaN on the rollouts of that
        call (unscorable), its error kept in ``errors``, instead of stopping the run."""
        plain: list[Any] = self.reward_funcs
        errors = {} if errors is None else errors
        self.reward_funcs = [
            f if isinstance(f, torch.nn.Module) or inspect.iscoroutinefunction(f) else guarded(f, name, errors)
            for f, name in zip(plain, self.reward_func_names, strict=True)
        ]
        try:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        finally:
            self.reward_funcs = plain

    def _unscorable_reasons(
        self, outcomes: list[RolloutOutcome], scored: list[dict[str, Any]], nan: torch.Tensor, errors: dict[str, str]
    ) -> list[str]:
        """Per rollout of this rank, why it is unscorable ("": it is not): ``failures.unscorable_reason`` of its
        outcome and NaN rewards (``nan``: per rollout and reward function), with the grade's failure if it has one."""
        reasons = []
        for outcome, row, bad in zip(outcomes, scored, nan.tolist(), strict=True):
            names = [name for name, b in zip(self.reward_func_names, bad, strict=True) if b]
            reason = unscorable_reason(outcome, names, errors)
            if names and not outcome.unscorable and (graded := grader_failure(row)):
                reason += f"; {graded}"
            reasons.append(reason)
        return reasons

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        """trl's ``RepeatSampler``, or with ``task_difficulty_file`` the curriculum's sampler of the same contract
        (``aitlrt.training.curriculum``)."""
        if self.args.task_difficulty_file is None:
            return super()._get_train_sampler(dataset)
        dataset = self.train_dataset if dataset is None else dataset
        group = cast(int, self.num_generations)
        self._curriculum = CurriculumSampler(
            cast(Any, dataset)["instance_id"],
            mini_repeat_count=group,
            batch_size=cast(int, self.args.generation_batch_size) // group,
            repeat_count=self.num_iterations * cast(int, self.args.steps_per_generation),
            seed=self.args.seed,
            records=read_difficulty(self.args.task_difficulty_file),
            failed_share=self.args.curriculum_failed_share,
        )
        if self._curriculum_state is not None:  # resumed: go on from what the checkpoint's run had learned
            self._curriculum.load_state_dict(self._curriculum_state)
        return self._curriculum

    def _curriculum_update(self, rnd: SamplingRound, group: int) -> None:
        """Each group's ``tests_pass`` rewards update its task's difficulty (every rank, the same gathered values)."""
        if self._curriculum is None or "tests_pass" not in self.reward_func_names:
            return
        solved = rnd.rewards_per_func[:, self.reward_func_names.index("tests_pass")].tolist()
        for g in range(rnd.groups):
            values = [v for v in solved[g * group : (g + 1) * group] if v == v]  # NaN: unscorable
            if values:
                self._curriculum.update(rnd.instance_ids[g * group], values)

    def _more_inputs(self, count: int, group: int, rounds: list[SamplingRound]) -> list[dict[str, Any]]:
        """This rank's share of a further round: new task groups from the dataset (by the curriculum when there is
        one, else uniformly, preferring tasks not yet rolled out in this step), the same draw on every rank."""
        dataset = cast(Any, self.train_dataset)
        world = self.accelerator.num_processes
        groups = count * world // group
        used = {i for r in rounds for i in r.instance_ids}
        if self._curriculum is not None:
            picked = self._curriculum.draw_groups(groups, exclude=used)
        else:
            seed = (self.args.seed + 1) * 1_000_003 + self.state.global_step * 1_009 + len(rounds)
            order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
            fresh = [i for i in order if dataset[i]["instance_id"] not in used]
            picked = (fresh + order * (groups // max(1, len(order)) + 1))[:groups]
        everyone = [dataset[i] for i in picked for _ in range(group)]
        rank = self.accelerator.process_index
        return everyone[rank * count : (rank + 1) * count]

    def _rows(
        self, outcomes: list[RolloutOutcome], unscorable: set[int], mode: str, ahead: int | None = None
    ) -> tuple[list[Row], list[int], RowStats]:
        """The rows of ``outcomes`` (the ``unscorable`` ones, by index, give none), checked to come from the weight
        version the server had when their rollouts started: the synced one, or ``ahead`` for rollouts run ahead (at
        most ``max_staleness`` behind); the staleness of the rows is logged (``staleness/*``)."""
        rows, owners, stats = [], [], RowStats()
        for i, outcome in enumerate(outcomes):
            if i in unscorable:
                stats.skipped_unscorable += len(outcome.trace)
                continue
            built, s = build_rows(outcome.trace, self.args.max_row_tokens, self.args.include_non_policy_calls)
            stats.add(s)
            rows += built
            owners += [i] * len(built)
        versions = {v for r in rows for v in r.weight_versions}
        expected = {self.weight_version} | ({ahead} if ahead is not None else set())
        if versions - expected:
            msg = (
                f"rows of step {self.state.global_step + 1} were sampled by weight version(s) {sorted(versions)}, "
                f"expected {sorted(expected)}: the weight sync did not reach the server"
            )
            if self.args.weight_version_check == "error":
                raise WeightVersionError(msg)
            log.warning(msg)
        lags = gather_object([self.weight_version - min(r.weight_versions) for r in rows if r.weight_versions])
        metrics = self._metrics[mode]
        for lag in range(self.args.max_staleness + 1):
            metrics[f"staleness/{lag}"].append(sum(x == lag for x in lags) / max(1, len(lags)))
        metrics["staleness/max"].append(float(max(lags, default=0)))
        return rows, owners, stats

    def _batch(
        self, rows: list[Row], owners: list[int], advantages: list[float], mode: str, truncated: set[int] | None = None
    ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """trl's batch for ``rows`` (row i belongs to local rollout ``owners[i]``, of advantage
        ``advantages[owners[i]]``; the rows of the rollouts in ``truncated`` get no loss), padded with zero-loss rows
        to the same count on every rank (a multiple of ``steps_per_generation`` in training, so trl's split drops
        nothing); and, where the trainer's logprobs were computed, each token's ``|trainer - sampler logprob|``
        (0 where no loss)."""
        device = self.accelerator.device
        counts = gather(torch.tensor([len(rows)], device=device))
        target = max(1, int(counts.max()))
        chunks = cast(int, self.args.steps_per_generation) if mode == "train" else 1  # set by GRPOConfig
        target = -(-target // chunks) * chunks
        pad_id = self._tokenizer.pad_token_id
        padding = [Row([pad_id], [pad_id], [0], [0.0]) for _ in range(target - len(rows))]
        owner = torch.tensor(owners + [-1] * len(padding), device=device)
        row_adv = [advantages[o] for o in owners] + [0.0] * len(padding)
        rows = rows + padding
        multiple = cast(int | None, self.pad_to_multiple_of)  # GRPOConfig resolves "auto"
        prompt_ids = pad([torch.tensor(r.prompt_ids) for r in rows], pad_id, "left", multiple).to(device)
        prompt_mask = pad([torch.ones(len(r.prompt_ids), dtype=torch.long) for r in rows], 0, "left", multiple)
        completion_ids = pad([torch.tensor(r.completion_ids) for r in rows], pad_id, "right", multiple).to(device)
        completion_mask = pad([torch.ones(len(r.completion_ids), dtype=torch.long) for r in rows], 0, "right", multiple)
        prompt_mask, completion_mask = prompt_mask.to(device), completion_mask.to(device)
        tool_mask = pad([torch.tensor(r.mask, dtype=torch.long) for r in rows], 0, "right", multiple).to(device)
        if truncated:
            tool_mask[torch.tensor([o in truncated for o in owner.tolist()], device=device)] = 0
        sampler = pad([torch.tensor(r.logprobs, dtype=torch.float32) for r in rows], 0, "right", multiple).to(device)
        loss_mask = completion_mask * tool_mask
        per_token_adv = torch.tensor(row_adv, device=device).unsqueeze(1) * self._rollout_weights(
            owner, loss_mask, len(advantages)
        )
        per_token_adv = per_token_adv.expand_as(sampler).contiguous()
        out: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "tool_mask": tool_mask,
            "sampling_per_token_logps": sampler,
            "num_items_in_batch": gather(loss_mask.sum()).sum(),
        }
        fused = mode == "train" and self._fuses_ratio()
        out["fused_ratio"] = torch.tensor(fused)  # 0-d: kept whole by trl's split and shuffle
        old, ref = self._fixed_logps(prompt_ids, prompt_mask, completion_ids, completion_mask, fused)
        gap = None
        if old is not None:
            out["old_per_token_logps"] = old
            diff = torch.nan_to_num((old - sampler) * loss_mask, nan=0.0)
            gap = diff.abs()
            if self.args.vllm_importance_sampling_correction:
                ratio = self._importance_sampling_ratio(diff, owner, len(advantages))
                self._log_importance_sampling(mode, ratio, loss_mask)
                if self.loss_type == "vespo":
                    out["importance_sampling_ratio"] = ratio  # trl folds it into VESPO's sequence weight
                else:
                    per_token_adv = per_token_adv * ratio  # = trl's per-token loss x ratio (module docstring)
        if ref is not None:
            out["ref_per_token_logps"] = ref
        out["advantages"] = per_token_adv
        return out, gap

    def _fixed_logps(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        fused: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-token logprobs without gradient, in ``max_tokens_per_forward`` micro-batches: the policy's
        (``old_per_token_logps``) where trl computes them (importance sampling on and not ``fused`` into the loss
        forward, or generation not aligned with the optimizer steps: else trl's PPO ratio is 1 by construction),
        and the reference's with ``beta != 0`` (the ref model; under PEFT the base model, adapters disabled, or the
        adapter named ``ref``)."""
        needs_old = not self._on_policy() or (self.args.vllm_importance_sampling_correction and not fused)
        if not needs_old and self.beta == 0.0:
            return None, None
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
        }
        groups, real = self._passes(batch)
        old = ref = None
        policy, checkpointing = cast(Any, self.model), cast(Any, self.args.gradient_checkpointing_kwargs)
        with torch.no_grad(), disable_gradient_checkpointing(policy, checkpointing):
            if needs_old:
                old = self._logps(self.model, batch, groups, real)
            if self.beta != 0.0 and self.ref_model is not None:
                ref = self._logps(self.ref_model, batch, groups, real)
            elif self.beta != 0.0:
                model = self.accelerator.unwrap_model(self.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    ref = self._logps(self.model, batch, groups, real)
        return old, ref

    def _on_policy(self) -> bool:
        """One optimizer step per generation: the policy at the start of the update is the one whose logprobs trl's
        PPO ratio divides by (trl then uses the loss forward's own logprobs, detached)."""
        generate_every = cast(int, self.args.steps_per_generation) * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every == 0

    def _fuses_ratio(self) -> bool:
        """The importance-sampling ratio comes from the loss forward itself (no separate no-grad forward): on-policy,
        and a token-level mode, whose ratio of a token needs only that token's logprobs."""
        args = self.args
        return (
            args.vllm_importance_sampling_correction
            and args.vllm_importance_sampling_mode.startswith("token")
            and self._on_policy()
        )

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **kwargs: Any
    ) -> Any:
        """trl's, with the LM head run on the scored positions only (``scored_positions_only``); inside the loss of
        a micro-batch whose ratio is fused (``_fused_part``), the ratio is computed from these logprobs (detached)
        before trl's loss reads the batch's advantages."""
        head = self._patched_model(model)
        sharing = shared_prefix_forward(head) if self._shared_prefix() else nullcontext()
        with scored_positions_only(head, logits_to_keep), sharing:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs)
        part, self._fused_part = self._fused_part, None
        if part is not None:
            self._apply_fused_ratio(part, out[0].detach())
        return out

    def _patched_model(self, model: Any) -> Any:
        """The model trl patched with its fused LM head (under PEFT, the base model)."""
        head = self.accelerator.unwrap_model(model)
        return head.get_base_model() if is_peft_model(head) else head

    def _shared_prefix(self) -> bool:
        """Whether micro-batches are formed and forwarded sharing their common prefix (``shared_prefix``, where the
        model and the parallelism allow it: else off, logged once)."""
        if self._shares_prefix is None:
            sharded = "ZeRO-3/FSDP shard the weights" if zero3(self) or self.is_fsdp_enabled else None
            model = self._patched_model(self.model)
            self._shares_prefix = use_shared_prefix(self.args.shared_prefix, model, sharded)
        return self._shares_prefix

    def _apply_fused_ratio(self, part: dict[str, Any], logps: torch.Tensor) -> None:
        """Weigh ``part``'s advantages by the importance-sampling ratio of ``logps`` (the policy at the start of the
        update) against the sampler's, as ``_batch`` does with a separate forward, and log the ratio and the
        logprob gap of this pass (every rank logs each pass: the gathers match)."""
        mask = part["completion_mask"] * part["tool_mask"] * part.pop("real")
        diff = torch.nan_to_num((logps.float() - part["sampling_per_token_logps"]) * mask, nan=0.0)
        ratio = self._importance_sampling_ratio(diff)
        self._log_importance_sampling("train", ratio, mask)
        self._log_gap("train", diff.abs(), mask)
        if self.loss_type == "vespo":
            part["importance_sampling_ratio"] = ratio
        else:
            part["advantages"] = part["advantages"] * ratio

    def _passes(self, batch: dict[str, Any]) -> tuple[list[list[int]], int]:
        """``batch``'s micro-batches (``prefix_batches`` with ``shared_prefix``, else ``micro_batches``), then
        zero-loss one-row passes up to the largest rank's count, so that every rank runs as many forwards (ZeRO-3
        collectives); and how many are real."""
        budget = self.args.max_tokens_per_forward
        if self._shared_prefix():
            groups = prefix_batches(row_tokens(batch), budget)
        else:
            lens = batch["prompt_mask"].sum(dim=1).tolist(), batch["completion_mask"].sum(dim=1).tolist()
            groups = micro_batches(*lens, budget)
        passes = int(gather(torch.tensor([len(groups)], device=self.accelerator.device)).max())
        return groups + [[groups[-1][-1]]] * (passes - len(groups)), len(groups)

    def _logps(self, model: Any, batch: dict[str, Any], groups: list[list[int]], real: int) -> torch.Tensor:
        """``model``'s per-token completion logprobs of ``batch``, one forward per micro-batch (0 past a row's
        completion); the passes from ``real`` on run only to keep collectives matched."""
        out = torch.zeros(batch["completion_ids"].shape, device=batch["completion_ids"].device)
        for i, rows in enumerate(groups):
            part = slice_rows(batch, rows, cast(int | None, self.pad_to_multiple_of))
            ids = torch.cat([part["prompt_ids"], part["completion_ids"]], dim=1)
            attention = torch.cat([part["prompt_mask"], part["completion_mask"]], dim=1)
            keep = part["completion_ids"].size(1)
            logps = self._get_per_token_logps_and_entropies(model, ids, attention, keep)[0]
            if i < real:
                out[torch.tensor(rows, device=out.device), :keep] = logps.float()
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """trl's loss of ``inputs`` in ``max_tokens_per_forward`` micro-batches: backward on all but the last, which
        the Trainer backpropagates; each scaled so their sum is the whole chunk's loss (module docstring)."""
        if return_outputs or not torch.is_grad_enabled():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        groups, real = self._passes(inputs)
        tokens = [float(mask[rows].sum()) if i < real else 0.0 for i, rows in enumerate(groups)]
        weights = gather(torch.tensor([tokens], device=mask.device)).sum(dim=0).tolist()
        metrics = self._metrics["train" if model.training else "eval"]
        marks = {key: len(values) for key, values in metrics.items()}
        done = torch.zeros((), device=mask.device)
        loss = done
        with self._ragged_gathers():
            for i, rows in enumerate(groups):
                scale = self._part_scale(rows, mask, i < real)
                multiple = cast(int | None, self.pad_to_multiple_of)
                part = slice_rows(inputs, rows, multiple)
                if part.get("fused_ratio", False):
                    part["real"] = float(i < real)
                    self._fused_part = part
                loss = super().compute_loss(model, part) * scale
                if i < len(groups) - 1:
                    self._backward_part(loss)
                    done = done + loss.detach()
        self._merge_metrics(metrics, marks, weights)
        return loss + done

    @contextmanager
    def _ragged_gathers(self) -> Iterator[None]:
        """trl gathers per-row values (its clip-ratio min/max) over ranks, whose micro-batches hold different row
        counts: within this, 1-D float gathers are padded across ranks with NaN, which trl's nanmin/nanmax skip."""
        accelerator = self.accelerator
        plain = accelerator.gather

        def gather_rows(tensor: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 1 and tensor.is_floating_point():
                tensor = accelerator.pad_across_processes(tensor, pad_index=math.nan)
            return plain(tensor)

        accelerator.gather = gather_rows  # an instance attribute, removed below
        try:
            yield
        finally:
            delattr(accelerator, "gather")

    def _part_scale(self, rows: list[int], mask: torch.Tensor, real: bool) -> float:
        """The factor on trl's loss of micro-batch ``rows`` that makes the micro-batches sum to the chunk's loss
        (``mask``: the chunk's trained tokens); 0 for a padding pass."""
        if not real:
            return 0.0
        if self.loss_type in ROW_NORMALISED_LOSSES:  # trl: mean over the micro-batch's rows
            return len(rows) / mask.size(0)
        if self.loss_type == "bnpo":  # trl: over the micro-batch's trained tokens
            return max(1.0, float(mask[rows].sum())) / max(1.0, float(mask.sum()))
        return 1.0  # dapo, cispo, vespo: over the generation batch's tokens (num_items_in_batch)

    def _backward_part(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch that is not the chunk's last: gradients accumulate, no optimizer step."""
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            engine = cast(Any, self.accelerator.deepspeed_engine_wrapped).engine
            engine.set_gradient_accumulation_boundary(False)  # accelerate's backward would step the engine
            engine.backward(loss, scale_wrt_gas=False)  # as the Trainer's own backward
        else:
            self.accelerator.backward(loss)

    @staticmethod
    def _merge_metrics(metrics: dict[str, list[float]], marks: dict[str, int], weights: list[float]) -> None:
        """Merge the entries trl logged per micro-batch pass into one per chunk: min/max keys by min/max,
        ``entropy_coef`` its last, the others weighted by each pass's trained tokens over all ranks (``weights``)."""
        for key, values in metrics.items():
            new = torch.tensor(values[marks.get(key, 0) :], dtype=torch.float64)
            if new.numel() < 2:
                continue
            if key.endswith("min"):
                merged = nanmin(new)
            elif key.endswith("max"):
                merged = nanmax(new)
            elif key == "entropy_coef":
                merged = new[-1]
            else:
                weight = torch.tensor(weights, dtype=torch.float64) if new.numel() == len(weights) else None
                keep = ~new.isnan()
                if weight is None or weight[keep].sum() == 0:
                    merged = new.nanmean()
                else:
                    merged = (new[keep] * weight[keep]).sum() / weight[keep].sum()
            del values[marks.get(key, 0) :]
            values.append(float(merged))

    def _importance_sampling_ratio(
        self, diff: torch.Tensor, owner: torch.Tensor | None = None, rollouts: int = 0
    ) -> torch.Tensor:
        """trl's importance-sampling ratio for ``vllm_importance_sampling_mode`` and its clip bounds, from each
        token's ``trainer - sampler`` logprob (0 where no loss): (B, T) in the token modes, (B, 1) in the sequence
        modes, where a row's sequence is its whole rollout (``owner``: the rows' rollouts, -1 for padding)."""
        args = self.args
        if args.vllm_importance_sampling_mode.startswith("sequence"):
            assert owner is not None, "a sequence-level ratio needs the rows' rollouts"
            totals = torch.zeros(rollouts + 1, device=diff.device).index_add_(0, owner + 1, diff.sum(dim=1))
            diff = totals[owner + 1].unsqueeze(1)
        ratio = torch.exp(diff)
        low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
        if args.vllm_importance_sampling_mode.endswith("truncate"):
            return ratio.clamp(min=low, max=high)
        outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
        return ratio.masked_fill(outside, 0.0)

    def _log_importance_sampling(self, mode: str, ratio: torch.Tensor, loss_mask: torch.Tensor) -> None:
        """trl's ``sampling/importance_sampling_ratio/{min,mean,max}`` over the trained tokens (sequences)."""
        trained = ratio[loss_mask.any(dim=1)].flatten() if ratio.size(1) == 1 else ratio[loss_mask.bool()]
        local = torch.full((3,), math.nan, device=ratio.device)
        if trained.numel():
            local = torch.stack([trained.min(), trained.mean(), trained.max()])
        everyone = gather(local.unsqueeze(0))
        metrics = self._metrics[mode]
        metrics["sampling/importance_sampling_ratio/min"].append(nanmin(everyone[:, 0]).item())
        metrics["sampling/importance_sampling_ratio/mean"].append(everyone[:, 1].nanmean().item())
        metrics["sampling/importance_sampling_ratio/max"].append(nanmax(everyone[:, 2]).item())

    def _rollout_weights(self, owner: torch.Tensor, loss_mask: torch.Tensor, rollouts: int) -> torch.Tensor:
        """(B, 1) factors on the rows' advantages that weigh each of the ``rollouts`` as one of trl's completions
        in the row-normalised losses (module docstring): trl divides by the rows of a micro-batch, padding
        included, where a rollout should count as one of its rollouts; and under ``grpo``/``sapo`` a row's
        token-mean counts for its share of the rollout's trained tokens. 1 for the token-normalised losses."""
        weights = torch.ones(owner.size(0), 1, device=owner.device)
        if self.loss_type not in ROW_NORMALISED_LOSSES:
            return weights
        weights *= owner.size(0) / max(rollouts, 1)  # = rows per micro-batch / rollouts per micro-batch
        if self.loss_type in ("grpo", "sapo"):
            tokens = loss_mask.sum(dim=1).float()
            per_rollout = torch.zeros(rollouts + 1, device=owner.device).index_add_(0, owner + 1, tokens)
            weights *= (tokens / per_rollout[owner + 1].clamp(min=1.0)).unsqueeze(1)
        return weights

    def _truncated(self, outcomes: list[RolloutOutcome]) -> set[int]:
        """With ``mask_truncated_completions``: the rollouts of which a trained call was cut at
        ``max_completion_length`` (finish reason ``length``), to get no loss as trl's truncated completions."""
        if not self.mask_truncated_completions:
            return set()
        trained = (lambda call: not call.get("tag")) if not self.args.include_non_policy_calls else (lambda call: True)
        return {
            i
            for i, outcome in enumerate(outcomes)
            if any(call.get("finish_reason") == "length" and trained(call) for call in outcome.trace)
        }

    def _record_completions(
        self,
        mode: str,
        inputs: list[dict[str, Any]],
        outcomes: list[RolloutOutcome],
        rewards_per_func: torch.Tensor,
        advantages: torch.Tensor,
    ) -> None:
        """What trl's own generation step logs: with ``log_completions`` the completions table, one entry per rollout
        (prompt: task id and problem statement; completion: the final patch; rewards and advantage gathered over
        ranks), with the columns reward functions queued through ``log_extra``; and the metrics they queued through
        ``log_metric``, averaged over ranks (every rank calls)."""
        if self.log_completions:
            logs = cast(dict[str, Any], self._logs)
            prompts = [f"{self._task(row).instance_id}: {self._task(row).problem_statement}" for row in inputs]
            logs["prompt"].extend(gather_object(prompts))
            logs["completion"].extend(gather_object([o.patch for o in outcomes]))
            for i, name in enumerate(self.reward_func_names):
                logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
            logs["advantages"].extend(advantages.tolist())
            for column in sorted(set(gather_object(list(self._pending_extra_logs)))):  # same order on every rank
                values = self._pending_extra_logs.get(column, [None] * len(inputs))
                logs["extra"][column].extend(gather_object(values))
        self._pending_extra_logs.clear()
        for name in sorted(set(gather_object(list(self._pending_metrics)))):
            values = self._pending_metrics.get(name, [])
            local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=self.accelerator.device)
            total, count = gather(local).view(-1, 2).sum(dim=0).tolist()
            self._metrics[mode][name].append(total / count)
        self._pending_metrics.clear()

    # ---- observability ---------------------------------------------------------------------------------------
    def _log_step(
        self,
        mode: str,
        group: int,
        rounds: list[SamplingRound],
        rows: list[Row],
        stats: RowStats,
        batch: dict[str, Any],
        gap: torch.Tensor | None,
    ) -> None:
        """The step's metrics: rewards and rollouts over every round's rollouts (all ranks), rows over the trained
        ones."""
        metrics = self._metrics[mode]
        outcomes = [o for r in rounds for o in r.outcomes]
        rewards_per_func = torch.cat([r.rewards_per_func for r in rounds])
        weighted = torch.cat([r.weighted for r in rounds])
        zero_std = torch.cat([r.zero_std for r in rounds])
        for i, name in enumerate(self.reward_func_names):
            values = [v for v in rewards_per_func[:, i].tolist() if v == v]
            if values:
                metrics[f"rewards/{name}/mean"].append(statistics.fmean(values))
                metrics[f"rewards/{name}/median"].append(statistics.median(values))
                metrics[f"rewards/{name}/std"].append(statistics.pstdev(values))
        metrics["reward"].append(torch.nanmean(weighted).item())
        scorable = weighted[~torch.isnan(weighted)]
        metrics["reward_std"].append(scorable.std().item() if scorable.numel() > 1 else float("nan"))
        metrics["frac_reward_zero_std"].append(zero_std.float().mean().item())
        metrics["zero_variance_groups"].append(float(zero_std.view(-1, group)[:, 0].sum()))
        everyone = [o for chunk in gather_object([[o.summary() for o in outcomes]]) for o in chunk]
        statuses = Counter(o["status"] for o in everyone)
        for status in ("ok", "no_patch", "timeout", "call_limit", "agent_error", "crashed"):
            metrics[f"rollouts/{status}"].append(statuses.get(status, 0) / len(everyone))
        for key, value in time_split(everyone).items():  # where the rollouts' time went (all ranks, all rounds)
            metrics[f"time/{key}"].append(value)
        metrics["rollouts/unscorable"].append(int(torch.isnan(weighted).sum()))
        metrics["rollouts/calls_mean"].append(statistics.fmean(o["calls"] for o in everyone))
        metrics["rollouts/completion_tokens_mean"].append(statistics.fmean(o["completion_tokens"] for o in everyone))
        metrics["rollouts/non_empty_patch_rate"].append(statistics.fmean(bool(o["patch"].strip()) for o in everyone))
        counts = {
            "count": len(rows),
            "split": stats.split_rows,
            "windows": stats.windows,
            "skipped_failed_calls": stats.skipped_failed,
            "skipped_tagged_calls": stats.skipped_tagged,
            "skipped_unscorable_calls": stats.skipped_unscorable,
        }
        totals = gather(torch.tensor([list(counts.values())], device=self.accelerator.device)).sum(0).tolist()
        for name, total in zip(counts, totals, strict=True):
            metrics[f"rows/{name}"].append(total)
        metrics["rows/per_rollout"].append(totals[0] / len(everyone))
        metrics["weight_version"].append(float(self.weight_version))
        if gap is not None:
            self._log_gap(mode, gap, batch["completion_mask"] * batch["tool_mask"])

    def _log_gap(self, mode: str, gap: torch.Tensor, mask: torch.Tensor) -> None:
        """``logprob_gap/{mean,max}``: |trainer - sampler logprob| over the trained tokens of all ranks."""
        metrics = self._metrics[mode]
        total = gather(torch.stack([(gap * mask).sum(), mask.sum().float()]).unsqueeze(0)).sum(0)
        metrics["logprob_gap/mean"].append((total[0] / total[1].clamp(min=1)).item())
        metrics["logprob_gap/max"].append(gather((gap * mask).max().unsqueeze(0)).max().item())

    def _save_rollouts(
        self,
        rounds: list[SamplingRound],
        rows: list[Row],
        owners: list[int],
        keep: list[tuple[SamplingRound, int]],
    ) -> None:
        """``OUTPUT/rollouts/step_XXXX.jsonl``: every rollout of the step (all rounds, all ranks) with its task's
        oracle patch, rewards, why it is unscorable (None: it is not), advantage, whether it was trained on and its
        rows."""
        tokens: Counter[tuple[int, int]] = Counter()
        trained_rows: Counter[tuple[int, int]] = Counter()
        for row, owner in zip(rows, owners, strict=True):
            tokens[(id(keep[owner][0]), keep[owner][1])] += row.sampled
            trained_rows[(id(keep[owner][0]), keep[owner][1])] += 1
        records = []
        for number, rnd in enumerate(rounds):
            rewards, advantages = rnd.rewards_per_func[rnd.local], rnd.advantages[rnd.local]
            for i, (task_row, outcome) in enumerate(zip(rnd.inputs, rnd.outcomes, strict=True)):
                last = outcome.trace[-1] if outcome.trace else {}
                conversation = list((last.get("request") or {}).get("messages") or []) + (
                    [last["message"]] if last.get("message") else []
                )
                records.append(
                    {
                        "step": self.state.global_step,
                        "round": number,
                        "rollout_id": outcome.rollout_id,
                        "instance_id": task_row["instance_id"],
                        "status": outcome.status,
                        "reason": outcome.reason,
                        "unscorable": rnd.reasons[i] or None,
                        "patch": outcome.patch,
                        "oracle_patch": self._task(task_row).patch,
                        "rewards": dict(zip(self.reward_func_names, rewards[i].tolist(), strict=True)),
                        "advantage": advantages[i].item(),
                        "informative": rnd.kept(i),
                        "calls": outcome.calls,
                        "completion_tokens": outcome.completion_tokens,
                        "rows": trained_rows[(id(rnd), i)],
                        "trained_tokens": tokens[(id(rnd), i)],
                        "conversation": conversation,
                    }
                )
        everyone = [r for chunk in gather_object([records]) for r in chunk]
        if self.accelerator.is_main_process:
            folder = Path(cast(str, self.args.output_dir)) / "rollouts"  # set by TrainingArguments
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"step_{self.state.global_step:04d}.jsonl", "w") as fh:
                for record in everyone:
                    fh.write(json.dumps(record) + "\n")

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """trl's, unless ``training_step`` already prepared this micro-step's inputs."""
        prepared, self._prepared = self._prepared, None
        return prepared if prepared is not None else super()._prepare_inputs(generation_batch)

    def training_step(self, model, inputs, num_items_in_batch):
        """trl's step, except when dynamic sampling found no informative group: then no forward or backward runs
        (the gradients stay None, so the optimizer leaves every weight as it is) and the weights need no sync."""
        started, before = time.monotonic(), self._generation_s
        if model.training:
            self._prepared = self._prepare_inputs(inputs)  # generates (and sets _skip_update) at a generation step
            if self._skip_update:
                self._prepared = None
                self._step += 1  # as trl's training_step counts micro-steps (its generation schedule)
                self._log_step_time(started)
                return torch.zeros((), device=self.args.device)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._weights_changed = True
        update = time.monotonic() - started - (self._generation_s - before)
        self._metrics["train"]["time/update_s"].append(update)
        if model.training:
            self._log_step_time(started)
        return loss

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """The Trainer's logged gradient norm; 0 for an update that dynamic sampling skipped (no gradient was made:
        DeepSpeed's engine would report its last real update's norm)."""
        return 0.0 if self._skip_update else super()._get_grad_norm(model, grad_norm)

    def _log_step_time(self, started: float) -> None:
        """``time/step_s``: the wall time of the optimizer step's micro-steps (generation or waiting for the rollouts
        run ahead, update), logged at its last micro-step."""
        self._step_s += time.monotonic() - started
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["time/step_s"].append(self._step_s)
            self._step_s = 0.0

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._weights_changed = True  # the server still has the initial weights
        saved = Path(resume_from_checkpoint) / CURRICULUM_STATE
        if self.args.task_difficulty_file is not None:
            if saved.is_file():
                self._curriculum_state = json.loads(saved.read_text())
            else:
                log.warning("%s has no %s: the curriculum starts again from %s", resume_from_checkpoint,
                            CURRICULUM_STATE, self.args.task_difficulty_file)  # fmt: skip

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """trl's checkpoint, plus the curriculum's state (what it learned online of each task's difficulty), written
        first: the Trainer removes older checkpoints (``save_total_limit``) at the end of its save, so the newest one
        is whole, curriculum included, before an older one goes."""
        if self._curriculum is not None and self.args.should_save:
            folder = Path(self._get_output_dir(trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / CURRICULUM_STATE).write_text(json.dumps(self._curriculum.state_dict()))
        super()._save_checkpoint(model, trial)

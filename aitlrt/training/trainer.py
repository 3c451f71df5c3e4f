"""``AgentGRPOTrainer``: trl's ``GRPOTrainer`` whose generation step is parallel agent rollouts.

One step on each rank: sync the policy to the server when it changed (``aitlrt.training.server_link``), run one
agent per prompt of the rank's slice (task x ``num_generations``) through ``aitlrt-serve`` and score each rollout's
final patch with the reward functions, in dynamic-sampling rounds (``aitlrt.training.collector``; trl's
``_calculate_rewards``: gathered over ranks, so a group may straddle ranks), turn group-relative advantages into
per-token advantages on rows built from the exact recorded tokens (``aitlrt.training.rows``), pad every rank to the
same row count (ZeRO-3 and trl's gathers need equal shapes; padding rows carry no loss) and hand trl's loss the
batch it expects (``aitlrt.training.batching``: the rollout weights, micro-batches and part scales).

Importance sampling: trl corrects for the sampler only when it runs vLLM itself, so AITLRT computes trl's
``vllm_importance_sampling_*`` ratio against the recorded sampler logprobs and folds it into the advantages, from a
separate no-grad forward or, on-policy with a token-level mode, from the loss forward itself
(``aitlrt.training.batch_builder``). A rollout, not a row, is trl's sequence for ``importance_sampling_level:
sequence`` and ``off_policy_mask_threshold`` (on-policy; refused off-policy). The LM head sees only the scored
positions (``aitlrt.common.lm_head``).

The update: ``compute_loss`` runs trl's loss on each micro-batch of the chunk, backward on all but the last
(returned to the Trainer's backward), scaled so the sum is trl's loss of the whole chunk; its logged metrics are
merged per chunk. A step whose groups all lacked reward variance (dynamic sampling) runs no forward, no backward
and no optimizer step (the LR schedule still advances, as the step counts), at any micro-step.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from accelerate.utils import DistributedType, gather, gather_object, is_peft_model
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from aitlrt.common.lm_head import scored_positions_only
from aitlrt.common.memory import peak_memory_gib, reset_peak_memory, unmap_freed_tensors
from aitlrt.common.shared_prefix import shared_prefix_forward, use_shared_prefix
from aitlrt.report import metric_names as m
from aitlrt.rewards.inputs import guarded
from aitlrt.rollout.agents import make_agent
from aitlrt.rollout.runner import RolloutOutcome
from aitlrt.training import batching, step_metrics
from aitlrt.training.batch_builder import BatchBuilder
from aitlrt.training.collector import RolloutCollector, SamplingRound, Scoring
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.failures import UnscorableSteps
from aitlrt.training.rows import Row, RowStats, rollout_rows, truncated_rollouts
from aitlrt.training.server_link import ServerLink
from aitlrt.training.weight_sync import zero3

log = logging.getLogger(__name__)

CURRICULUM_STATE = "curriculum.json"
"""In each checkpoint of a curriculum run: ``CurriculumSampler.state_dict``, for a resumed run to go on from."""


class WeightVersionError(RuntimeError):
    """Rows were sampled by another weight version than the trainer synced: the sync silently failed."""


@dataclass
class StepContext:
    """What the hooks of one update hand each other (trl calls them in turn)."""

    skip_update: bool = False
    """This generation's groups all lacked reward variance (dynamic sampling): no forward, backward or step."""
    updated: bool = False
    """A backward ran in the current optimizer step's micro-steps."""
    prepared: Any = None
    """This micro-step's inputs, prepared (and generated) by ``training_step`` before trl's own step."""
    part: dict[str, Any] | None = None
    """The micro-batch whose loss forward runs now, when its ratio is fused into it."""
    optimizer_skipped: bool = False
    """No micro-step of this optimizer step made a gradient: no clipping, norm 0 (``_skip_optimizer_step``)."""
    step_s: float = 0.0
    """Wall time of the optimizer step's micro-steps so far."""
    generation_s: float = 0.0


class AgentGRPOTrainer(GRPOTrainer):
    args: AgentGRPOConfig

    def __init__(self, *args: Any, agent=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unmap_freed_tensors(self.accelerator.device)  # on CPU the update's freed activations leave the process
        self.server = ServerLink(self, self.args, self._tokenizer)
        agent = agent or make_agent(
            self.args.agent,
            self.args.edit_format,
            self.args.aider_reminder,
            command=self.args.agent_command,
            max_calls=self.args.rollout_max_calls,
        )
        self.collector = RolloutCollector(self, agent, self.server.proxy_url, lambda: self.server.served_model)
        self.collector.start(self.reward_funcs)
        self.ctx = StepContext()
        self._unscorable_steps = UnscorableSteps(self.args.max_unscorable_steps, self.server.proxy_url)
        self._shares_prefix: bool | None = None  # decided at the first forward (_shared_prefix)
        sequence = self.importance_sampling_level == "sequence" or self.off_policy_mask_threshold is not None
        self.builder = BatchBuilder(self)
        if sequence and not self.builder.on_policy():
            raise ValueError(
                "importance_sampling_level 'sequence' and off_policy_mask_threshold weigh a rollout, all its rows, "
                "as one sequence: off-policy (num_iterations > 1 or steps_per_generation > gradient_accumulation_"
                "steps) its rows are trained in different optimizer steps, under different policies"
            )

    # ---- the server and the collector, for callers of the trainer ---------------------------------------------
    @property
    def weight_version(self) -> int:
        return self.server.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.server.weight_version = version

    @property
    def weight_sync(self) -> Any:
        return self.server.weight_sync

    @weight_sync.setter
    def weight_sync(self, sync: Any) -> None:
        self.server.weight_sync = sync

    @property
    def mode(self) -> str:
        return "train" if cast(torch.nn.Module, self.model).training else "eval"

    def sync_weights(self) -> float:
        """Push the current policy to the server (every rank calls; ``ServerLink.sync``), never cutting the calls
        of rollouts running ahead; the seconds it took."""
        self.collector.wait_ahead()
        return self.server.sync()

    def sync_final_weights(self) -> None:
        """After training (every rank): push the policy to the server if an update ran since the last sync."""
        if self.server.weights_changed:
            self.sync_weights()

    def close(self) -> None:
        """Stop the collector's agents and workspaces (call when training is over; the trainer can train again)."""
        self.collector.close()

    # ---- one generation step ---------------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        t0, mode = time.monotonic(), self.mode
        training = mode == "train"
        self.server.connect()
        taken = self.collector.take_ahead(inputs) if training else None
        sync_s = self.sync_weights() if self.server.needs_sync() else 0.0
        group = cast(int, self.num_generations if training else self.num_generations_eval)  # set by trl
        names, weights = self.reward_func_names, self.reward_weights
        scoring = Scoring(self._score, names, weights, self.scale_rewards, self.multi_objective_aggregation)

        def on_round(rnd: SamplingRound) -> None:
            tasks = [self.collector.task(row) for row in rnd.inputs]
            step_metrics.record_completions(self, mode, rnd, [f"{t.instance_id}: {t.problem_statement}" for t in tasks])

        rounds = self.collector.sample(inputs, group, scoring, training, taken, on_round)
        self.ctx.skip_update = training and sum(r.informative_groups for r in rounds) == 0
        t3 = time.monotonic()
        # Dynamic sampling: only the rollouts of groups with reward variance are trained on (training mode).
        keep = [(n, i) for n, r in enumerate(rounds) for i in range(len(r.outcomes)) if not training or r.kept(i)]
        outcomes = [rounds[n].outcomes[i] for n, i in keep]
        unscorable = {j for j, (n, i) in enumerate(keep) if rounds[n].reasons[i]}
        rows, owners, stats = self._rows(outcomes, unscorable, None if taken is None else taken.version)
        advantages = [float(rounds[n].advantages[rounds[n].local][i]) for n, i in keep]
        batch, gap = self.builder.build(rows, owners, advantages, self._truncated(outcomes))
        t4 = time.monotonic()
        metrics = self._metrics[mode]
        step_metrics.log_rounds(metrics, self.reward_func_names, rounds)
        step_metrics.log_rows(metrics, rows, stats, len(keep) - len(unscorable), self.accelerator.device)
        metrics[m.WEIGHT_VERSION].append(float(self.weight_version))
        if gap is not None:
            step_metrics.log_gap(metrics, gap, batch["completion_mask"] * batch["tool_mask"])
        metrics[m.SKIPPED_UPDATE].append(float(self.ctx.skip_update))
        metrics[m.TIME_SYNC].append(sync_s)
        metrics[m.TIME_ROWS].append(t4 - t3)
        self.ctx.generation_s += time.monotonic() - t0
        if self.ctx.skip_update:
            log.info("step %d: no informative group in %d round(s) of %d group(s): update skipped",
                     self.state.global_step + 1, len(rounds), sum(r.groups for r in rounds))  # fmt: skip
        if training:
            if self.args.save_rollouts:
                self._save_rollouts(rounds, rows, owners, keep)
            self._watch_unscorable(rounds)
            self.collector.run_ahead(self.weight_version)
        return batch

    def _save_rollouts(
        self, rounds: list[SamplingRound], rows: list[Row], owners: list[int], keep: list[tuple[int, int]]
    ) -> None:
        """``OUTPUT/rollouts/step_XXXX.jsonl`` (``step_metrics.save_rollouts``), with each rollout's trained rows."""
        trained: dict[tuple[int, int], tuple[int, int]] = {}
        for row, owner in zip(rows, owners, strict=True):
            count, tokens = trained.get(keep[owner], (0, 0))
            trained[keep[owner]] = (count + 1, tokens + row.sampled)
        oracle: dict[str, str | None] = {
            row["instance_id"]: self.collector.task(row).patch for r in rounds for row in r.inputs
        }
        folder = Path(cast(str, self.args.output_dir)) / "rollouts"  # set by TrainingArguments
        step, main = self.state.global_step, self.accelerator.is_main_process
        step_metrics.save_rollouts(folder, step, self.reward_func_names, rounds, trained, oracle, main)

    def _watch_unscorable(self, rounds: list[SamplingRound]) -> None:
        """Stop the run (``UnscorableStepsError``) after ``max_unscorable_steps`` consecutive steps whose every
        rollout (all rounds, all ranks) was unscorable (every rank decides alike, on the gathered rewards)."""
        everything = all(bool(torch.isnan(r.weighted).all()) for r in rounds)
        reasons = [reason for r in rounds for reason in r.reasons] if everything else []
        everyone = [reason for chunk in gather_object([reasons]) for reason in chunk] if everything else []
        self._unscorable_steps.observe(self.state.global_step + 1, everything, everyone)

    def _score(
        self, inputs: list[dict[str, Any]], prompts: list[Any], completions: list[str], errors: dict[str, str]
    ) -> torch.Tensor:
        """trl's ``_calculate_rewards``, with each plain reward function ``guarded``: one that raises gives NaN on
        the rollouts of that call (unscorable), its error kept in ``errors``, instead of stopping the run."""
        plain: list[Any] = self.reward_funcs
        self.reward_funcs = [
            f if isinstance(f, torch.nn.Module) or inspect.iscoroutinefunction(f) else guarded(f, name, errors)
            for f, name in zip(plain, self.reward_func_names, strict=True)
        ]
        try:
            return self._calculate_rewards(inputs, prompts, completions, [[] for _ in inputs])
        finally:
            self.reward_funcs = plain

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        """trl's ``RepeatSampler``, or with ``task_difficulty_file`` the curriculum's sampler of the same contract."""
        if self.args.task_difficulty_file is None:
            return super()._get_train_sampler(dataset)
        dataset = self.train_dataset if dataset is None else dataset
        weights = dict(zip(self.reward_func_names, self.reward_weights.tolist(), strict=True))
        return self.collector.sampler(dataset, cast(int, self.num_generations), self.num_iterations, weights)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        """transformers'; pipelined, it also reads the next step's first batch (the generation batch that step rolls
        out, ``RolloutCollector.run_ahead``), which the next call returns first."""
        collector = self.collector
        if collector.ahead is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        peeked, collector.peeked = collector.peeked, None
        head = [peeked[1]] if peeked is not None and peeked[0] is epoch_iterator else []
        batches, items = super().get_batch_samples(itertools.chain(head, epoch_iterator), num_batches, device)
        if len(batches) == num_batches:
            following = next(epoch_iterator, None)
            collector.peeked = None if following is None else (epoch_iterator, following)
        return batches, items

    def _rows(
        self, outcomes: list[RolloutOutcome], unscorable: set[int], ahead: int | None = None
    ) -> tuple[list[Row], list[int], RowStats]:
        """The rows of ``outcomes`` (the ``unscorable`` ones, by index, give none), checked to come from the weight
        version the server had when their rollouts started: the synced one, or ``ahead`` for rollouts run ahead (at
        most ``max_staleness`` behind); their staleness, in updates behind the trainer's policy, is logged."""
        traces = [o.trace for o in outcomes]
        rows, owners, stats = rollout_rows(
            traces, unscorable, self.args.max_row_tokens, self.args.include_non_policy_calls
        )
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
        unsynced = self.server.unsynced_updates
        lags = [unsynced + self.weight_version - min(r.weight_versions) for r in rows if r.weight_versions]
        step_metrics.log_staleness(self._metrics[self.mode], lags, self.args.max_staleness)
        return rows, owners, stats

    def _truncated(self, outcomes: list[RolloutOutcome]) -> set[int]:
        """With ``mask_truncated_completions``: the rollouts that get no loss (``rows.truncated_rollouts``)."""
        if not self.mask_truncated_completions:
            return set()
        return truncated_rollouts([o.trace for o in outcomes], self.args.include_non_policy_calls)

    # ---- forwards --------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, **kwargs: Any
    ) -> Any:
        """trl's, with the LM head run on the scored positions only (``scored_positions_only``); inside the loss of
        a micro-batch whose ratio is fused (``StepContext.part``), the ratio is computed from these logprobs
        (detached) before trl's loss reads the batch's advantages."""
        head = self._patched_model(model)
        sharing = shared_prefix_forward(head) if self._shared_prefix() else nullcontext()
        with scored_positions_only(head, logits_to_keep), sharing:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs)
        part, self.ctx.part = self.ctx.part, None
        if part is not None:
            self.builder.apply_fused_ratio(part, out[0].detach())
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

    def get_off_policy_mask(self, mask: torch.Tensor, **_: Any) -> torch.Tensor:  # type: ignore[override]
        """trl's off-policy sequence mask, which ``BatchBuilder.build`` applied per rollout: all kept here."""
        return torch.ones(mask.size(0), 1, dtype=mask.dtype, device=mask.device)

    # ---- the update ------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """trl's loss of ``inputs`` in ``max_tokens_per_forward`` micro-batches: backward on all but the last, which
        the Trainer backpropagates; each scaled so their sum is the whole chunk's loss (``batching``)."""
        if return_outputs or not torch.is_grad_enabled():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mask = inputs["completion_mask"] * inputs["tool_mask"]
        groups, real = self.builder.passes(inputs)
        if real > 1 and self.top_entropy_quantile < 1.0:
            raise ValueError(
                f"top_entropy_quantile {self.top_entropy_quantile} takes its entropy threshold over each forward's "
                f"tokens: this chunk needs {real} micro-batches (max_tokens_per_forward "
                f"{self.args.max_tokens_per_forward}); raise max_tokens_per_forward or leave top_entropy_quantile 1.0"
            )
        tokens = [float(mask[rows].sum()) if i < real else 0.0 for i, rows in enumerate(groups)]
        weights = gather(torch.tensor([tokens], device=mask.device)).sum(dim=0).tolist()
        metrics = self._metrics[self.mode]
        marks = {key: len(values) for key, values in metrics.items()}
        multiple = cast(int | None, self.pad_to_multiple_of)
        done = torch.zeros((), device=mask.device)
        loss = done
        with self._ragged_gathers():
            for i, rows in enumerate(groups):
                scale = batching.part_scale(self.loss_type, rows, mask, i < real)
                part = batching.slice_rows(inputs, rows, multiple)
                part = part if i < real else batching.balancing_pass(part)
                part["num_items_in_batch"] = batching.part_items(self.loss_type, inputs["num_items_in_batch"], scale)
                if self.builder.fused_ratio:
                    self.ctx.part = part
                loss = super().compute_loss(model, part) * scale
                if i < len(groups) - 1:
                    self._backward_part(loss)
                    done = done + loss.detach()
        batching.merge_metrics(metrics, marks, weights)
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

    def _backward_part(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch that is not the chunk's last: gradients accumulate, no optimizer step."""
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            engine = cast(Any, self.accelerator.deepspeed_engine_wrapped).engine
            engine.set_gradient_accumulation_boundary(False)  # accelerate's backward would step the engine
            engine.backward(loss, scale_wrt_gas=False)  # as the Trainer's own backward
        else:
            self.accelerator.backward(loss)

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """trl's, unless ``training_step`` already prepared this micro-step's inputs."""
        prepared, self.ctx.prepared = self.ctx.prepared, None
        return prepared if prepared is not None else super()._prepare_inputs(generation_batch)

    def training_step(self, model, inputs, num_items_in_batch):
        """trl's step, except when dynamic sampling found no informative group: then no forward or backward runs
        (the gradients stay None) and, if no micro-step of the optimizer step made a gradient, no optimizer step
        either (``_skip_optimizer_step``). The model is put in training mode first, as the Trainer's own step does,
        so that the generation it runs is a training one at a run's first micro-step and after an evaluation."""
        started, before, ctx = time.monotonic(), self.ctx.generation_s, self.ctx
        if ctx.step_s == 0.0:  # the optimizer step's first micro-step
            reset_peak_memory(self.args.device)
        model.train()
        ctx.prepared = self._prepare_inputs(inputs)  # generates (and sets skip_update) at a generation step
        if ctx.skip_update:
            ctx.prepared = None
            self._step += 1  # as trl's training_step counts micro-steps (its generation schedule)
            loss = torch.zeros((), device=self.args.device)
        else:
            loss = super().training_step(model, inputs, num_items_in_batch)
            ctx.updated = self.server.weights_changed = True
            self._metrics["train"][m.TIME_UPDATE].append(time.monotonic() - started - (ctx.generation_s - before))
        ctx.step_s += time.monotonic() - started
        if self._step % self.current_gradient_accumulation_steps == 0:  # the optimizer step's last micro-step
            self._metrics["train"][m.TIME_STEP].append(ctx.step_s)
            self._metrics["train"][m.MEMORY_PEAK].append(peak_memory_gib(self.args.device))
            ctx.step_s = 0.0
            if ctx.updated:
                self.server.updates += 1
            else:
                self._skip_optimizer_step()
            ctx.updated = False
        return loss

    def _skip_optimizer_step(self) -> None:
        """No gradient was made in this optimizer step: the Trainer's next ``optimizer.step`` does nothing (fp16's
        grad scaler would fail on an optimizer without gradients), the gradient norm reads 0 and the LR schedule
        advances as the step counts (DeepSpeed's engine, which steps its scheduler only in its own step, too)."""
        optimizer = cast(Any, self.optimizer)

        def skipped(*_: Any, **__: Any) -> None:
            del optimizer.step  # the instance attribute: the optimizer's own step again

        optimizer.step = skipped
        self.ctx.optimizer_skipped = True
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            scheduler = cast(Any, self.accelerator.deepspeed_engine_wrapped).engine.lr_scheduler
            if scheduler is not None:
                scheduler.step()

    def _clip_grad_norm(self, model: Any) -> Any:
        """The Trainer's clipping, which reads (and under fp16 unscales) the gradients: none after a skipped step."""
        return None if self.ctx.optimizer_skipped else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        """The Trainer's logged gradient norm; 0 for an optimizer step that dynamic sampling skipped (no gradient
        was made: DeepSpeed's engine would report its last real update's norm)."""
        skipped, self.ctx.optimizer_skipped = self.ctx.optimizer_skipped, False
        return 0.0 if skipped else super()._get_grad_norm(model, grad_norm)

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self.server.weights_changed = True  # the server still has the initial weights
        saved = Path(resume_from_checkpoint) / CURRICULUM_STATE
        if self.args.task_difficulty_file is not None:
            if saved.is_file():
                self.collector.curriculum_state = json.loads(saved.read_text())
            else:
                log.warning("%s has no %s: the curriculum starts again from %s", resume_from_checkpoint,
                            CURRICULUM_STATE, self.args.task_difficulty_file)  # fmt: skip

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """trl's checkpoint, plus the curriculum's state (what it learned online of each task's difficulty), written
        first: the Trainer removes older checkpoints (``save_total_limit``) at the end of its save, so the newest one
        is whole, curriculum included, before an older one goes."""
        curriculum = self.collector.curriculum
        if curriculum is not None and self.args.should_save:
            folder = Path(self._get_output_dir(trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / CURRICULUM_STATE).write_text(json.dumps(curriculum.state_dict()))
        super()._save_checkpoint(model, trial)

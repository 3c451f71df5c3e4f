"""A training step's batch: trl's batch tensors for the rows (``batching``), with the no-grad forwards trl runs
before its loss (the policy's ``old_per_token_logps``, the reference's logprobs), the importance-sampling ratio
and, a rollout being trl's sequence, the rollout-level off-policy mask and sequence weight.

Importance sampling: AITLRT computes trl's ``vllm_importance_sampling_*`` ratio against the recorded sampler
logprobs (a sequence-level ratio spans the whole rollout) and multiplies each token's advantage by it: trl
multiplies the per-token loss by that ratio (>= 0), and every trl loss is positively homogeneous in the advantage,
so the loss is trl's; ``vespo``, which folds the ratio into its own weight, gets it as trl's
``importance_sampling_ratio`` instead. On-policy (one optimizer step per generation) with a token-level mode, the
ratio comes from the loss forward's own logprobs, detached (``fused_ratio``; the policy at the start of the update
is the one trl's ``old_per_token_logps`` would hold), so no separate no-grad forward runs; else ``build`` runs that
forward first, as trl does.

A rollout, not a row, is trl's sequence (on-policy; the trainer refuses these options off-policy, where a rollout's
rows are trained under different policies): ``off_policy_mask_threshold`` drops a negative-advantage rollout on its
mean ``sampler - policy`` logprob over all its rows (the policy at the start of the update, which trl's mask reads
on-policy); under ``importance_sampling_level: sequence`` each trained token's advantage is its rollout's
token-mean, before the row factors of ``batching.rollout_weights`` (exact: on-policy trl's sequence weight is 1 in
value, and the gradient of a rollout's weight reaches its tokens through that mean), except under ``cispo``/
``vespo``, whose sequence weight takes no gradient.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from accelerate.utils import gather
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import use_adapter

from aitlrt.common.shared_prefix import CPU_MIN_SHARED, prefix_batches
from aitlrt.training import batching, step_metrics
from aitlrt.training.rows import Row


class BatchBuilder:
    """Builds ``trainer``'s (an ``AgentGRPOTrainer``) batches and runs its no-grad and fused-ratio forwards."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.args = trainer.args
        self._fused: bool | None = None

    @property
    def fused_ratio(self) -> bool:
        """Whether the importance-sampling ratio comes from the loss forward: ``fuses_ratio``, unless set (a bench
        or test comparing both ways)."""
        return self.fuses_ratio() if self._fused is None else self._fused

    @fused_ratio.setter
    def fused_ratio(self, fused: bool) -> None:
        self._fused = fused

    def on_policy(self) -> bool:
        """One optimizer step per generation: the policy at the start of the update is the one whose logprobs trl's
        PPO ratio divides by (trl then uses the loss forward's own logprobs, detached)."""
        generate_every = cast(int, self.args.steps_per_generation) * self.trainer.num_iterations
        return self.args.gradient_accumulation_steps % generate_every == 0

    def fuses_ratio(self) -> bool:
        """The importance-sampling ratio can come from the loss forward itself (no separate no-grad forward):
        on-policy, and a token-level mode, whose ratio of a token needs only that token's logprobs (and no
        rollout-level sequence weight or mask, which need every row's)."""
        args, trainer = self.args, self.trainer
        return bool(
            args.vllm_importance_sampling_correction
            and args.vllm_importance_sampling_mode.startswith("token")
            and self.on_policy()
            and trainer.importance_sampling_level == "token"
            and trainer.off_policy_mask_threshold is None
        )

    def build(
        self, rows: list[Row], owners: list[int], advantages: list[float], truncated: set[int] | None = None
    ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """trl's batch for ``rows`` (row i of local rollout ``owners[i]``, of advantage ``advantages[owners[i]]``;
        the rollouts in ``truncated`` get no loss), padded with zero-loss rows to the same count on every rank (a
        multiple of ``steps_per_generation`` in training, so trl's split drops nothing); and, where the trainer's
        logprobs were computed, each token's ``|trainer - sampler logprob|`` (0 where no loss). Every rank calls."""
        trainer = self.trainer
        device, training = trainer.accelerator.device, trainer.mode == "train"
        counts = gather(torch.tensor([[len(rows), len(advantages)]], device=device)).view(-1, 2)
        chunks = cast(int, self.args.steps_per_generation) if training else 1  # set by GRPOConfig
        target = -(-max(1, int(counts[:, 0].max())) // chunks) * chunks
        multiple = cast(int | None, trainer.pad_to_multiple_of)  # GRPOConfig resolves "auto"
        pad_id = trainer._tokenizer.pad_token_id
        out: dict[str, Any] = batching.padded_rows(rows, owners, target, pad_id, multiple, truncated, device)
        owner, sampler = out.pop("owner"), out["sampling_per_token_logps"]
        loss_mask = out["completion_mask"] * out["tool_mask"]
        row_adv = torch.tensor([advantages[o] for o in owners] + [0.0] * (target - len(rows)), device=device)
        per_rank = float(counts[:, 1].sum()) / counts.size(0)  # all ranks' rollouts over the world size
        weights = batching.rollout_weights(trainer.loss_type, owner, loss_mask, len(advantages), per_rank)
        per_token_adv = (row_adv.unsqueeze(1) * weights).expand_as(sampler).contiguous()
        out["num_items_in_batch"] = gather(loss_mask.sum()).sum()
        old, ref = self.fixed_logps(out, training and self.fused_ratio)
        gap = None

        def rollout_mean(values: torch.Tensor) -> torch.Tensor:
            tokens = batching.per_rollout_sums(loss_mask.float(), owner, len(advantages)).clamp(min=1.0)
            return batching.per_rollout_sums(values * loss_mask, owner, len(advantages)) / tokens

        if old is not None:
            out["old_per_token_logps"] = old
            diff = torch.nan_to_num((old - sampler) * loss_mask, nan=0.0)
            gap = diff.abs()
            if (threshold := trainer.off_policy_mask_threshold) is not None:  # trl's mask, the rollout its sequence
                per_token_adv = per_token_adv * ((row_adv.unsqueeze(1) >= 0) | (-rollout_mean(diff) <= threshold))
            if self.args.vllm_importance_sampling_correction:
                ratio = self.ratio(diff, owner, len(advantages))
                step_metrics.log_importance_sampling(trainer._metrics[trainer.mode], ratio, loss_mask)
                if trainer.loss_type == "vespo":
                    out["importance_sampling_ratio"] = ratio  # trl folds it into VESPO's sequence weight
                else:
                    per_token_adv = per_token_adv * ratio  # = trl's per-token loss x ratio (module docstring)
        if ref is not None:
            out["ref_per_token_logps"] = ref
        if trainer.importance_sampling_level == "sequence" and trainer.loss_type not in ("cispo", "vespo"):
            unweighted = torch.where(weights > 0, per_token_adv / weights.clamp(min=1e-30), 0.0)  # the row factors
            per_token_adv = torch.where(loss_mask.bool(), rollout_mean(unweighted) * weights, per_token_adv)
        out["advantages"] = per_token_adv
        return out, gap

    def ratio(self, diff: torch.Tensor, owner: torch.Tensor | None = None, rollouts: int = 0) -> torch.Tensor:
        """``batching.importance_sampling_ratio`` under the config's mode and clip bounds."""
        args = self.args
        low, high = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
        return batching.importance_sampling_ratio(diff, args.vllm_importance_sampling_mode, low, high, owner, rollouts)

    def fixed_logps(self, batch: dict[str, Any], fused: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-token logprobs without gradient, in ``max_tokens_per_forward`` micro-batches: the policy's
        (``old_per_token_logps``) where trl computes them (importance sampling on and not ``fused`` into the loss
        forward, or generation not aligned with the optimizer steps: else trl's PPO ratio is 1 by construction)
        and for a rollout-level off-policy mask; the reference's with ``beta != 0`` (the ref model; under PEFT the
        base model, adapters disabled, or the adapter named ``ref``)."""
        trainer = self.trainer
        needs_old = (
            not self.on_policy()
            or (self.args.vllm_importance_sampling_correction and not fused)
            or trainer.off_policy_mask_threshold is not None
        )
        if not needs_old and trainer.beta == 0.0:
            return None, None
        groups, real = self.passes(batch)
        old = ref = None
        policy, checkpointing = cast(Any, trainer.model), cast(Any, self.args.gradient_checkpointing_kwargs)
        with torch.no_grad(), disable_gradient_checkpointing(policy, checkpointing):
            if needs_old:
                old = self.logps(trainer.model, batch, groups, real)
            if trainer.beta != 0.0 and trainer.ref_model is not None:
                ref = self.logps(trainer.ref_model, batch, groups, real)
            elif trainer.beta != 0.0:
                model = trainer.accelerator.unwrap_model(trainer.model)
                with use_adapter(model, adapter_name="ref" if "ref" in model.peft_config else None):
                    ref = self.logps(trainer.model, batch, groups, real)
        return old, ref

    def passes(self, batch: dict[str, Any]) -> tuple[list[list[int]], int]:
        """``batch``'s micro-batches (``prefix_batches`` with ``shared_prefix``, else ``micro_batches``; on CPU
        without it one row per pass unless the budget is None: ``CPU_MIN_SHARED``), then the balancing passes up
        to the largest rank's count (``batching.passes``); and how many are real."""
        budget = self.args.max_tokens_per_forward
        if self.trainer._shared_prefix():
            groups = prefix_batches(batching.row_tokens(batch), budget, self.min_shared)
        elif self.min_shared and budget is not None:  # padded rows cost more than they save on CPU (CPU_MIN_SHARED)
            groups = [[i] for i in range(len(batch["prompt_ids"]))]
        else:
            lens = batch["prompt_mask"].sum(dim=1).tolist(), batch["completion_mask"].sum(dim=1).tolist()
            groups = batching.micro_batches(*lens, budget)
        most = int(gather(torch.tensor([len(groups)], device=self.trainer.accelerator.device)).max())
        return batching.passes(groups, most), len(groups)

    @property
    def min_shared(self) -> float:
        """``prefix_batches``' ``min_shared`` on this trainer's device: ``CPU_MIN_SHARED`` on CPU, else 0."""
        return CPU_MIN_SHARED if self.trainer.accelerator.device.type == "cpu" else 0.0

    def logps(self, model: Any, batch: dict[str, Any], groups: list[list[int]], real: int) -> torch.Tensor:
        """``model``'s per-token completion logprobs of ``batch``, one forward per micro-batch (0 past a row's
        completion); the passes from ``real`` on run only to keep collectives matched."""
        out = torch.zeros(batch["completion_ids"].shape, device=batch["completion_ids"].device)
        for i, rows in enumerate(groups):
            part = batching.slice_rows(batch, rows, cast(int | None, self.trainer.pad_to_multiple_of))
            ids = torch.cat([part["prompt_ids"], part["completion_ids"]], dim=1)
            attention = torch.cat([part["prompt_mask"], part["completion_mask"]], dim=1)
            keep = part["completion_ids"].size(1)
            logps = self.trainer._get_per_token_logps_and_entropies(model, ids, attention, keep)[0]
            if i < real:
                out[torch.tensor(rows, device=out.device), :keep] = logps.float()
        return out

    def apply_fused_ratio(self, part: dict[str, Any], logps: torch.Tensor) -> None:
        """Weigh ``part``'s advantages by the importance-sampling ratio of ``logps`` (the policy at the start of the
        update) against the sampler's, as ``build`` does with a separate forward, and log the ratio and the logprob
        gap of this pass (every rank logs each pass: the gathers match)."""
        mask = part["completion_mask"] * part["tool_mask"]
        diff = torch.nan_to_num((logps.float() - part["sampling_per_token_logps"]) * mask, nan=0.0)
        ratio = self.ratio(diff)
        metrics = self.trainer._metrics["train"]
        step_metrics.log_importance_sampling(metrics, ratio, mask)
        step_metrics.log_gap(metrics, diff.abs(), mask)
        if self.trainer.loss_type == "vespo":
            part["importance_sampling_ratio"] = ratio
        else:
            part["advantages"] = part["advantages"] * ratio

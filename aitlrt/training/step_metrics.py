"""What a training step logs (trl's ``_metrics``, averaged per logging step by trl's ``log``) and saves: rewards,
rollout statuses and times over every round's rollouts; rows over the trained ones; the sampling rounds; the rows'
staleness; the importance-sampling ratio and the logprob gap over the trained tokens; trl's completions table; and
``OUTPUT/rollouts/step_XXXX.jsonl`` (``save_rollouts``). Every function that gathers is called by every rank."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather, gather_object
from trl.trainer.utils import nanmax, nanmin

from aitlrt.report import metric_names as m
from aitlrt.rollout.record import STEP_FILE, RolloutRecord, write_rollouts
from aitlrt.rollout.status import STATUSES
from aitlrt.rollout.timing import time_split
from aitlrt.training.collector import SamplingRound
from aitlrt.training.rows import Row, RowStats

Metrics = dict[str, list[float]]


def log_rounds(metrics: Metrics, names: list[str], rounds: list[SamplingRound]) -> None:
    """Rewards, statuses, times and sizes over every round's rollouts (all ranks), and the sampling rounds."""
    rewards_per_func = torch.cat([r.rewards_per_func for r in rounds])
    weighted = torch.cat([r.weighted for r in rounds])
    zero_std = torch.cat([r.zero_std for r in rounds])
    for i, name in enumerate(names):
        values = [v for v in rewards_per_func[:, i].tolist() if v == v]
        if values:
            metrics[m.reward_stat(name, "mean")].append(statistics.fmean(values))
            metrics[m.reward_stat(name, "median")].append(statistics.median(values))
            metrics[m.reward_stat(name, "std")].append(statistics.pstdev(values))
    metrics[m.REWARD].append(torch.nanmean(weighted).item())
    scorable = weighted[~torch.isnan(weighted)]
    metrics[m.REWARD_STD].append(scorable.std().item() if scorable.numel() > 1 else float("nan"))
    metrics[m.FRAC_REWARD_ZERO_STD].append(zero_std.float().mean().item())
    metrics[m.ZERO_VARIANCE_GROUPS].append(float(sum(r.zero_std.view(-1, r.group)[:, 0].sum() for r in rounds)))
    outcomes = [o for r in rounds for o in r.outcomes]
    everyone = [o for chunk in gather_object([[o.summary() for o in outcomes]]) for o in chunk]
    statuses = Counter(o["status"] for o in everyone)
    for status in STATUSES:
        metrics[m.rollout_share(status)].append(statuses.get(status, 0) / len(everyone))
    for key, value in time_split(everyone).items():  # where the rollouts' time went (all ranks, all rounds)
        metrics[m.seconds(key.removesuffix("_s"))].append(value)
    metrics[m.ROLLOUTS_UNSCORABLE].append(int(torch.isnan(weighted).sum()))
    metrics[m.CALLS_MEAN].append(statistics.fmean(o["calls"] for o in everyone))
    metrics[m.COMPLETION_TOKENS_MEAN].append(statistics.fmean(o["completion_tokens"] for o in everyone))
    metrics[m.EDIT_RATE].append(statistics.fmean(bool(o["patch"].strip()) for o in everyone))
    metrics[m.GROUPS].append(float(sum(r.groups for r in rounds)))
    metrics[m.INFORMATIVE_GROUPS].append(float(sum(r.informative_groups for r in rounds)))
    metrics[m.ROUNDS].append(float(len(rounds)))
    metrics[m.TIME_ROLLOUTS].append(sum(r.rollout_s for r in rounds))
    metrics[m.TIME_REWARDS].append(sum(r.reward_s for r in rounds))


def log_rows(metrics: Metrics, rows: list[Row], stats: RowStats, built_from: int, device: Any) -> None:
    """``rows/*``: the trained rows' counts (all ranks); ``rows/per_rollout`` over the rollouts they were built
    from (``built_from``: this rank's trained, scorable rollouts), not over every rollout of the step."""
    counts = {
        "count": len(rows),
        "split": stats.split_rows,
        "windows": stats.windows,
        "skipped_failed_calls": stats.skipped_failed,
        "skipped_tagged_calls": stats.skipped_tagged,
        "skipped_unscorable_calls": stats.skipped_unscorable,
    }
    totals = gather(torch.tensor([[*counts.values(), built_from]], device=device)).sum(0).tolist()
    for name, total in zip(counts, totals, strict=False):
        metrics[m.rows(name)].append(total)
    metrics[m.ROWS_PER_ROLLOUT].append(totals[0] / totals[-1] if totals[-1] else math.nan)


def log_staleness(metrics: Metrics, lags: list[int], max_staleness: int) -> None:
    """``staleness/{0..max_staleness}``: the share of the rows (all ranks) whose oldest call lags the trainer's
    policy by that many updates; ``staleness/max``."""
    everyone = gather_object(lags)
    for lag in range(max_staleness + 1):
        metrics[m.staleness(lag)].append(sum(x == lag for x in everyone) / max(1, len(everyone)))
    metrics[m.STALENESS_MAX].append(float(max(everyone, default=0)))


def log_gap(metrics: Metrics, gap: torch.Tensor, mask: torch.Tensor) -> None:
    """``logprob_gap/{mean,max}``: |trainer - sampler logprob| over the trained tokens of all ranks."""
    total = gather(torch.stack([(gap * mask).sum(), mask.sum().float()]).unsqueeze(0)).sum(0)
    metrics[m.LOGPROB_GAP_MEAN].append((total[0] / total[1].clamp(min=1)).item())
    metrics[m.LOGPROB_GAP_MAX].append(gather((gap * mask).max().unsqueeze(0)).max().item())


def log_importance_sampling(metrics: Metrics, ratio: torch.Tensor, loss_mask: torch.Tensor) -> None:
    """trl's ``sampling/importance_sampling_ratio/{min,mean,max}`` over the trained tokens (sequences)."""
    trained = ratio[loss_mask.any(dim=1)].flatten() if ratio.size(1) == 1 else ratio[loss_mask.bool()]
    local = torch.full((3,), math.nan, device=ratio.device)
    if trained.numel():
        local = torch.stack([trained.min(), trained.mean(), trained.max()])
    everyone = gather(local.unsqueeze(0))
    metrics[m.IS_RATIO_MIN].append(nanmin(everyone[:, 0]).item())
    metrics[m.IS_RATIO_MEAN].append(everyone[:, 1].nanmean().item())
    metrics[m.IS_RATIO_MAX].append(nanmax(everyone[:, 2]).item())


def record_completions(trainer: Any, mode: str, rnd: SamplingRound, instance: list[str]) -> None:
    """What trl's own generation step logs, for one round of ``trainer`` (trl's ``GRPOTrainer`` state): with
    ``log_completions`` the completions table, one entry per rollout (prompt: ``instance``, the rollouts' task ids
    and problem statements; completion: the final patch; rewards and advantage gathered over ranks), with the
    columns reward functions queued through ``log_extra``; and the metrics they queued through ``log_metric``,
    averaged over ranks."""
    pending_extra, pending = trainer._pending_extra_logs, trainer._pending_metrics
    if trainer.log_completions:
        logs = trainer._logs
        logs["prompt"].extend(gather_object(instance))
        logs["completion"].extend(gather_object([o.patch for o in rnd.outcomes]))
        for i, name in enumerate(trainer.reward_func_names):
            logs["rewards"][name].extend(rnd.rewards_per_func[:, i].tolist())
        logs["advantages"].extend(rnd.advantages.tolist())
        for column in sorted(set(gather_object(list(pending_extra)))):  # same order on every rank
            values = pending_extra.get(column, [None] * len(rnd.inputs))
            logs["extra"][column].extend(gather_object(values))
    pending_extra.clear()
    for name in sorted(set(gather_object(list(pending)))):
        values = pending.get(name, [])
        local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=trainer.accelerator.device)
        total, count = gather(local).view(-1, 2).sum(dim=0).tolist()
        trainer._metrics[mode][name].append(total / count)
    pending.clear()


def save_rollouts(
    folder: Path,
    step: int,
    names: list[str],
    rounds: list[SamplingRound],
    trained: dict[tuple[int, int], tuple[int, int]],
    oracle: dict[str, str | None],
    is_main: bool,
) -> None:
    """``folder/step_XXXX.jsonl``: every rollout of the step (all rounds, all ranks) with its task's oracle patch
    (``oracle`` by instance id), rewards, why it is unscorable (None: it is not), advantage, whether it was trained
    on and its rows and trained tokens (``trained``: by (round, rollout) of this rank). The record and its
    writer: ``aitlrt.rollout.record``."""
    records = []
    for number, rnd in enumerate(rounds):
        rewards, advantages = rnd.rewards_per_func[rnd.local], rnd.advantages[rnd.local]
        for i, (task_row, outcome) in enumerate(zip(rnd.inputs, rnd.outcomes, strict=True)):
            rows, tokens = trained.get((number, i), (0, 0))
            records.append(
                RolloutRecord.from_outcome(
                    outcome,
                    oracle_patch=oracle[task_row["instance_id"]],
                    rewards=dict(zip(names, rewards[i].tolist(), strict=True)),
                    step=step,
                    instance_id=task_row["instance_id"],
                    round=number,
                    unscorable=rnd.reasons[i] or None,
                    advantage=advantages[i].item(),
                    informative=rnd.kept(i),
                    rows=rows,
                    trained_tokens=tokens,
                )
            )
    everyone = [r for chunk in gather_object([records]) for r in chunk]
    if is_main:
        write_rollouts(folder / STEP_FILE.format(step), everyone)

"""``AgentGRPOTrainer``: trl's ``GRPOTrainer`` whose generation step is parallel agent rollouts.

One step on each rank: sync the policy to the server when it changed (``aitlrt.training.weight_sync``), run one
agent per prompt of the rank's slice (task x ``num_generations``) through ``aitlrt-serve``, score each rollout's
final patch with the reward functions (on ``aitlrt.rewards.inputs.reward_row`` rows, with the ``Task`` built once per
instance id; trl's ``_calculate_rewards``: gathered over ranks, so a group may straddle ranks), turn group-relative
advantages into per-token advantages on rows built from the exact recorded tokens (``aitlrt.training.rows``), pad
every rank to the same row count (ZeRO-3 and trl's gathers need equal shapes; padding rows carry no loss), and hand
trl's loss the batch it expects.

Importance sampling: trl only corrects for the sampler when it runs vLLM itself, so the trainer does it here:
each token's advantage is multiplied by ``min(exp(trainer - sampler logprob), cap)``, which for a positive
weight is exactly trl's truncated token-level correction of the clipped objective.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, cast

import torch
from accelerate.utils import gather, gather_object
from trl import GRPOTrainer
from trl.trainer.utils import pad

from aitlrt.rewards.inputs import reward_row
from aitlrt.rollout.agents import AgentTask, make_agent
from aitlrt.rollout.runner import RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.tasks.task import Task, task_from_row
from aitlrt.training.advantages import group_advantages
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.rows import Row, RowStats, build_rows
from aitlrt.training.weight_sync import make_weight_sync, proxy_request

log = logging.getLogger(__name__)


class WeightVersionError(RuntimeError):
    """Rows were sampled by another weight version than the trainer synced: the sync silently failed."""


class AgentGRPOTrainer(GRPOTrainer):
    args: AgentGRPOConfig

    def __init__(self, *args: Any, agent=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.args.proxy_url:
            raise ValueError("AgentGRPOConfig.proxy_url is required (the aitlrt-serve URL)")
        self.proxy_url = self.args.proxy_url.rstrip("/")
        self.agent = agent or make_agent(self.args.agent, self.args.edit_format)
        self._served_model = ""  # asked of the proxy at the first generation
        self.weight_sync = make_weight_sync(self.args)
        self.weight_version = -1
        self._synced_step = self.state.global_step  # the server starts with the initial weights
        self._tasks: dict[str, Task] = {}
        self._checkouts: dict[str, tuple[Path, str]] = {}
        self._runner: RolloutRunner | None = None  # one for the whole run: it keeps the recycled workspaces
        self._generation_s = 0.0

    # ---- the weight sync ---------------------------------------------------------------------------------------
    def sync_weights(self) -> float:
        """Push the current policy to the server (every rank calls) and learn the new weight version; the seconds
        it took."""
        started = time.monotonic()
        version = self.weight_sync.sync(self)
        if version is not None:
            self.weight_version = version
        self._synced_step = self.state.global_step
        return time.monotonic() - started

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

    def _rollouts(self, inputs: list[dict[str, Any]]) -> list[RolloutOutcome]:
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
        tag = f"s{self.state.global_step:05d}-r{self.accelerator.process_index}-{uuid.uuid4().hex[:6]}"
        requests = []
        for i, row in enumerate(inputs):
            task = self._task(row)
            repo, base = self._checkout(task)
            agent_task = AgentTask(task.instance_id, task.problem_statement, task.files)
            requests.append(RolloutRequest(f"{tag}-{i:03d}", agent_task, repo, base))
        return self._runner.run(requests)

    def close(self) -> None:
        """Stop the agents and remove the idle workspaces (call when training is over)."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if hasattr(self.agent, "close"):
            self.agent.close()

    def _connect(self) -> None:
        if not self._served_model:
            self._served_model = proxy_request(self.proxy_url, "GET", "/v1/models").json()["data"][0]["id"]
            self.weight_version = proxy_request(self.proxy_url, "GET", "/weights").json()["weight_version"]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if cast(torch.nn.Module, self.model).training else "eval"
        t0 = time.monotonic()
        self._connect()
        sync_s = self.sync_weights() if self.state.global_step != self._synced_step else 0.0
        t1 = time.monotonic()
        outcomes = self._rollouts(inputs)
        t2 = time.monotonic()
        scored = [reward_row(row, self._task(row), o) for row, o in zip(inputs, outcomes, strict=True)]
        prompts = [row["prompt"] for row in inputs]
        completions = [o.patch for o in outcomes]
        rewards_per_func = self._calculate_rewards(scored, prompts, completions, [[] for _ in inputs])
        weighted = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        weighted[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        group = cast(int, self.num_generations if mode == "train" else self.num_generations_eval)  # set by trl
        advantages, zero_std = group_advantages(weighted, group, self.scale_rewards)
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        t3 = time.monotonic()

        rows, owners, stats = self._rows(outcomes)
        batch, gap = self._batch(rows, owners, advantages[local].tolist(), mode)
        t4 = time.monotonic()
        self._log_step(mode, group, outcomes, rows, stats, rewards_per_func, weighted, zero_std, batch, gap)
        self._metrics[mode]["time/sync_s"].append(sync_s)
        self._metrics[mode]["time/rollouts_s"].append(t2 - t1)
        self._metrics[mode]["time/rewards_s"].append(t3 - t2)
        self._metrics[mode]["time/rows_s"].append(t4 - t3)
        self._generation_s += time.monotonic() - t0
        if self.args.save_rollouts and mode == "train":
            self._save_rollouts(inputs, outcomes, rewards_per_func[local], advantages[local], rows, owners)
        return batch

    def _rows(self, outcomes: list[RolloutOutcome]) -> tuple[list[Row], list[int], RowStats]:
        rows, owners, stats = [], [], RowStats()
        for i, outcome in enumerate(outcomes):
            built, s = build_rows(outcome.trace, self.args.max_row_tokens, self.args.include_non_policy_calls)
            stats.add(s)
            rows += built
            owners += [i] * len(built)
        versions = {v for r in rows for v in r.weight_versions}
        if versions - {self.weight_version}:
            msg = (
                f"rows of step {self.state.global_step} were sampled by weight version(s) {sorted(versions)}, "
                f"expected {self.weight_version}: the weight sync did not reach the server"
            )
            if self.args.weight_version_check == "error":
                raise WeightVersionError(msg)
            log.warning(msg)
        return rows, owners, stats

    def _batch(
        self, rows: list[Row], owners: list[int], advantages: list[float], mode: str
    ) -> tuple[dict[str, Any], torch.Tensor | None]:
        """trl's batch for ``rows``, padded with zero-loss rows to the same count on every rank (a multiple of
        ``steps_per_generation`` in training, so trl's split drops nothing); and, with importance sampling, each
        token's ``|trainer - sampler logprob|`` (0 where no loss)."""
        device = self.accelerator.device
        counts = gather(torch.tensor([len(rows)], device=device))
        target = max(1, int(counts.max()))
        chunks = cast(int, self.args.steps_per_generation) if mode == "train" else 1  # set by GRPOConfig
        target = -(-target // chunks) * chunks
        pad_id = self._tokenizer.pad_token_id
        padding = [Row([pad_id], [pad_id], [0], [0.0]) for _ in range(target - len(rows))]
        row_adv = [advantages[o] for o in owners] + [0.0] * len(padding)
        rows = rows + padding
        prompt_ids = pad([torch.tensor(r.prompt_ids) for r in rows], pad_id, "left").to(device)
        prompt_mask = pad([torch.ones(len(r.prompt_ids), dtype=torch.long) for r in rows], 0, "left").to(device)
        completion_ids = pad([torch.tensor(r.completion_ids) for r in rows], pad_id).to(device)
        completion_mask = pad([torch.ones(len(r.completion_ids), dtype=torch.long) for r in rows], 0).to(device)
        tool_mask = pad([torch.tensor(r.mask, dtype=torch.long) for r in rows], 0).to(device)
        sampler = pad([torch.tensor(r.logprobs, dtype=torch.float32) for r in rows], 0).to(device)
        loss_mask = completion_mask * tool_mask
        per_token_adv = torch.tensor(row_adv, device=device).unsqueeze(1).expand_as(sampler).clone()
        out: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "tool_mask": tool_mask,
            "sampling_per_token_logps": sampler,
            "num_items_in_batch": gather(loss_mask.sum()).sum(),
        }
        gap = None
        if self.args.importance_sampling_cap is not None:
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    torch.cat([prompt_ids, completion_ids], dim=1),
                    torch.cat([prompt_mask, completion_mask], dim=1),
                    completion_ids.size(1),
                    batch_size=self.args.per_device_train_batch_size,
                )
            diff = (old - sampler) * loss_mask
            out["old_per_token_logps"] = old
            per_token_adv = per_token_adv * torch.exp(diff).clamp(max=self.args.importance_sampling_cap) * loss_mask
            gap = diff.abs()
        out["advantages"] = per_token_adv
        return out, gap

    # ---- observability ---------------------------------------------------------------------------------------
    def _log_step(
        self,
        mode: str,
        group: int,
        outcomes: list[RolloutOutcome],
        rows: list[Row],
        stats: RowStats,
        rewards_per_func: torch.Tensor,
        weighted: torch.Tensor,
        zero_std: torch.Tensor,
        batch: dict[str, Any],
        gap: torch.Tensor | None,
    ) -> None:
        metrics = self._metrics[mode]
        for i, name in enumerate(self.reward_func_names):
            values = [v for v in rewards_per_func[:, i].tolist() if v == v]
            if values:
                metrics[f"rewards/{name}/mean"].append(statistics.fmean(values))
                metrics[f"rewards/{name}/median"].append(statistics.median(values))
                metrics[f"rewards/{name}/std"].append(statistics.pstdev(values))
        metrics["reward"].append(torch.nanmean(weighted).item())
        metrics["reward_std"].append(float(torch.std(torch.nan_to_num(weighted))))
        metrics["frac_reward_zero_std"].append(zero_std.float().mean().item())
        metrics["zero_variance_groups"].append(float(zero_std.view(-1, group)[:, 0].sum()))
        everyone = [o for chunk in gather_object([[o.summary() for o in outcomes]]) for o in chunk]
        statuses = Counter(o["status"] for o in everyone)
        for status in ("ok", "no_patch", "timeout", "call_limit", "agent_error", "crashed"):
            metrics[f"rollouts/{status}"].append(statuses.get(status, 0) / len(everyone))
        metrics["rollouts/calls_mean"].append(statistics.fmean(o["calls"] for o in everyone))
        metrics["rollouts/completion_tokens_mean"].append(statistics.fmean(o["completion_tokens"] for o in everyone))
        metrics["rollouts/non_empty_patch_rate"].append(statistics.fmean(bool(o["patch"].strip()) for o in everyone))
        totals = (
            gather(
                torch.tensor(
                    [len(rows), stats.new_rows, stats.truncated_rows, stats.skipped_tagged],
                    device=self.accelerator.device,
                ).unsqueeze(0)
            )
            .sum(0)
            .tolist()
        )
        metrics["rows/count"].append(totals[0])
        metrics["rows/per_rollout"].append(totals[0] / len(everyone))
        metrics["rows/truncated"].append(totals[2])
        metrics["rows/skipped_tagged_calls"].append(totals[3])
        metrics["weight_version"].append(float(self.weight_version))
        if gap is not None:
            mask = batch["completion_mask"] * batch["tool_mask"]
            total = gather(torch.stack([gap.sum(), mask.sum().float()]).unsqueeze(0)).sum(0)
            metrics["logprob_gap/mean"].append((total[0] / total[1].clamp(min=1)).item())
            metrics["logprob_gap/max"].append(gather(gap.max().unsqueeze(0)).max().item())

    def _save_rollouts(
        self,
        inputs: list[dict[str, Any]],
        outcomes: list[RolloutOutcome],
        rewards: torch.Tensor,
        advantages: torch.Tensor,
        rows: list[Row],
        owners: list[int],
    ) -> None:
        records = []
        for i, (row, outcome) in enumerate(zip(inputs, outcomes, strict=True)):
            last = outcome.trace[-1] if outcome.trace else {}
            conversation = list((last.get("request") or {}).get("messages") or []) + (
                [last["message"]] if last.get("message") else []
            )
            records.append(
                {
                    "step": self.state.global_step,
                    "rollout_id": outcome.rollout_id,
                    "instance_id": row["instance_id"],
                    "status": outcome.status,
                    "reason": outcome.reason,
                    "patch": outcome.patch,
                    "rewards": dict(zip(self.reward_func_names, rewards[i].tolist(), strict=True)),
                    "advantage": advantages[i].item(),
                    "calls": outcome.calls,
                    "completion_tokens": outcome.completion_tokens,
                    "rows": owners.count(i),
                    "trained_tokens": sum(rows[j].sampled for j, o in enumerate(owners) if o == i),
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

    def training_step(self, model, inputs, num_items_in_batch):
        started, before = time.monotonic(), self._generation_s
        loss = super().training_step(model, inputs, num_items_in_batch)
        update = time.monotonic() - started - (self._generation_s - before)
        self._metrics["train"]["time/update_s"].append(update)
        return loss

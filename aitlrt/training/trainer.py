"""``AgentGRPOTrainer``: trl's ``GRPOTrainer`` whose generation step is parallel agent rollouts.

One step on each rank: sync the policy to the server when it changed (safetensors + ``POST /weights/reload``, or
trl's ``VLLMClient`` over NCCL between ``POST /weights/pause`` and ``/weights/resume``),
run one agent per prompt of the rank's slice (task x ``num_generations``) through ``aitlrt-serve``, score each
rollout's final patch with the reward functions (trl's ``_calculate_rewards``: gathered over ranks, so a group
may straddle ranks), turn group-relative advantages into per-token advantages on rows built from the exact
recorded tokens (``aitlrt.training.rows``), pad every rank to the same row count (ZeRO-3 and trl's gathers need equal
shapes; padding rows carry no loss), and hand trl's loss the batch it expects.

Importance sampling: trl only corrects for the sampler when it runs vLLM itself, so the trainer does it here:
each token's advantage is multiplied by ``min(exp(trainer - sampler logprob), cap)``, which for a positive
weight is exactly trl's truncated token-level correction of the clipped objective.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
from accelerate.utils import gather, gather_object
from trl import GRPOTrainer
from trl.trainer.utils import pad

from aitlrt.rollout.agents import AgentTask, make_agent
from aitlrt.rollout.runner import RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.tasks.task import task_from_row
from aitlrt.training.advantages import group_advantages
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.rows import Row, RowStats, build_rows


def _once(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each storage once, under its first name: a tied ``lm_head`` is left out (as ``save_pretrained`` does and
    vLLM expects), so it is neither copied nor sent twice."""
    seen: set[int] = set()
    for name, tensor in items:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            yield name, tensor


def lora_weights(peft_model, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights vLLM loads for a PEFT model, one at a time, under the base model's names, each storage once.

    With ``merge``, the active LoRA adapters are added in out of place (``W + get_delta_weight``) where the layer
    lives, one layer at a time: no full copy of the model is made, and unlike merge/unmerge the model's own weights
    are never touched, so repeated syncs cannot accumulate rounding drift into a bf16 base. Without ``merge``: the
    base weights (the same names, shapes and dtypes). Unmerged tensors are the model's own: copy what you keep.
    """
    from peft.tuners.lora import LoraLayer

    def base_name(name: str) -> str:
        return name.removeprefix("base_model.model.").replace(".base_layer", "")

    layers = {
        base_name(f"{name}.base_layer.weight"): module
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer) and not module.merged
    }
    kept = ((k, v) for k, v in peft_model.state_dict().items() if "lora_" not in k and "modules_to_save" not in k)
    for key, value in _once(kept):
        name, tensor, layer = base_name(key), value.detach(), layers.get(base_name(key))
        if merge and layer is not None:
            for adapter in (a for a in layer.active_adapters if a in layer.lora_A):
                with torch.no_grad():
                    tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
        yield name, tensor


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
        self._served_model: str | None = None  # asked of the proxy at the first generation
        self.weight_version = -1
        self._synced_step = self.state.global_step  # the server starts with the initial weights
        self._checkouts: dict[str, tuple[Path, str]] = {}
        self._runner: RolloutRunner | None = None  # one for the whole run: it keeps the recycled workspaces
        self._generation_s = 0.0
        self._vllm_client = None  # trl's VLLMClient, with weight_sync=nccl (main process, first sync)

    # ---- the proxy -------------------------------------------------------------------------------------------
    def _proxy(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.proxy_url}{path}", timeout=600, **kw).raise_for_status()

    def sync_weights(self) -> float:
        """Push the current policy to the server (every rank calls; the main process sends) and learn the new weight
        version. LoRA runs send the merged weights (``lora_weights``)."""
        started = time.monotonic()
        main, zero3 = self.accelerator.is_main_process, self._zero3()
        if self.args.weight_sync == "reload" and main:
            from safetensors.torch import save_file

            folder = Path(self.args.weight_sync_dir or Path(self.args.output_dir) / "sync")
            folder.mkdir(parents=True, exist_ok=True)
            save_file(self.host_state_dict(), str(folder / "model.safetensors"))
            self.weight_version = self._proxy("POST", "/weights/reload", json={"path": str(folder)}).json()[
                "weight_version"
            ]
        elif self.args.weight_sync == "nccl" and main:
            meta = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in self._policy_weights(False)]
            self.weight_version = self._nccl_send(meta, self._policy_weights())
        elif self.args.weight_sync != "none" and zero3:  # the main process's gathers are collectives: join them
            for _ in range(1 + (self.args.weight_sync == "nccl")):
                for _ in self._policy_weights():
                    pass
        if self.args.weight_sync != "none":
            self.weight_version = gather_object([self.weight_version])[0]
        self._synced_step = self.state.global_step
        return time.monotonic() - started

    def _nccl_send(self, meta: list[tuple[str, str, list[int]]], weights: Iterator[tuple[str, torch.Tensor]]) -> int:
        """Stream ``weights`` to vLLM with trl's client while the proxy holds new calls; returns the new version."""
        if self._vllm_client is None:
            from trl.generation.vllm_client import VLLMClient

            url = self.args.vllm_url or self._proxy("GET", "/weights").json()["upstream"]
            self._vllm_client = VLLMClient(base_url=url, group_port=self.args.vllm_group_port, connection_timeout=60)
            self._vllm_client.init_communicator(device=self.accelerator.device)
        version = self._proxy("POST", "/weights/pause").json()["weight_version"]
        try:
            device = self.accelerator.device  # ZeRO-3 consolidates on the host; NCCL sends from the GPU
            self._vllm_client.update_named_params(meta, ((n, t.to(device).contiguous()) for n, t in weights))
            self._vllm_client.reset_prefix_cache()
        except BaseException:
            self._proxy("POST", "/weights/resume", json={})  # the old weights may be half-replaced: say so loudly
            raise
        return self._proxy("POST", "/weights/resume", json={"version": version + 1}).json()["weight_version"]

    def _zero3(self) -> bool:
        return self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3

    def _policy_weights(self, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the weights vLLM serves, each storage once, lazily where they live (``lora_weights``
        for LoRA). The model's own tensors: copy what you keep. Under ZeRO-3 every rank must iterate: the engine
        gathers the 16-bit weights (``zero3_save_16bit_model``) and LoRA layers are gathered to merge."""
        model = self.accelerator.unwrap_model(self.model)
        if hasattr(model, "merge_adapter"):
            if self._zero3():
                import deepspeed

                with deepspeed.zero.GatheredParameters(list(model.parameters())):
                    yield from lora_weights(model, merge)
            else:
                yield from lora_weights(model, merge)
            return
        engine = self.model_wrapped if self.is_deepspeed_enabled else self.model  # accelerate needs the engine
        yield from _once(self.accelerator.get_state_dict(engine).items())

    def host_state_dict(self) -> dict[str, torch.Tensor]:
        """What the reload sync saves: the served weights in host memory (main process; ZeRO-3: every rank calls)."""
        return {name: tensor.to("cpu").contiguous() for name, tensor in self._policy_weights()}

    # ---- one generation step ---------------------------------------------------------------------------------
    def _checkout(self, row: dict[str, Any]) -> tuple[Path, str]:
        if row["instance_id"] not in self._checkouts:
            self._checkouts[row["instance_id"]] = task_from_row(row).checkout()
        return self._checkouts[row["instance_id"]]

    def _rollouts(self, inputs: list[dict[str, Any]]) -> list[RolloutOutcome]:
        if self._runner is None:
            self._runner = RolloutRunner(
                self.agent,
                self.proxy_url,
                self._served_model,
                concurrency=self.args.rollout_concurrency,
                timeout_s=self.args.rollout_timeout_s,
                max_calls=self.args.rollout_max_calls,
                context_window=self.args.context_window,
                recycle_workspaces=self.args.recycle_workspaces,
            )
        tag = f"s{self.state.global_step:05d}-r{self.accelerator.process_index}-{uuid.uuid4().hex[:6]}"
        requests = []
        for i, row in enumerate(inputs):
            repo, base = self._checkout(row)
            task = AgentTask(row["instance_id"], row["problem_statement"], tuple(row.get("files") or ()))
            requests.append(RolloutRequest(f"{tag}-{i:03d}", task, repo, base))
        return self._runner.run(requests)

    def close(self) -> None:
        """Stop the agents and remove the idle workspaces (call when training is over)."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if hasattr(self.agent, "close"):
            self.agent.close()

    def _connect(self) -> None:
        if self._served_model is None:
            self._served_model = self._proxy("GET", "/v1/models").json()["data"][0]["id"]
            self.weight_version = self._proxy("GET", "/weights").json()["weight_version"]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        t0 = time.monotonic()
        self._connect()
        sync_s = self.sync_weights() if self.state.global_step != self._synced_step else 0.0
        t1 = time.monotonic()
        outcomes = self._rollouts(inputs)
        t2 = time.monotonic()
        for row, outcome in zip(inputs, outcomes, strict=True):
            row["agent_patch"] = outcome.patch
            row["rollout_status"] = outcome.status
            row["rollout_calls"] = outcome.calls
            row["rollout_completion_tokens"] = outcome.completion_tokens
        prompts = [row["prompt"] for row in inputs]
        completions = [o.patch for o in outcomes]
        rewards_per_func = self._calculate_rewards(inputs, prompts, completions, [[] for _ in inputs])
        weighted = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        weighted[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        group = self.num_generations if mode == "train" else self.num_generations_eval
        advantages, zero_std = group_advantages(weighted, group, self.scale_rewards)
        local = slice(self.accelerator.process_index * len(inputs), (self.accelerator.process_index + 1) * len(inputs))
        t3 = time.monotonic()

        rows, owners, stats = self._rows(outcomes)
        batch = self._batch(rows, owners, advantages[local].tolist(), mode)
        t4 = time.monotonic()
        self._log_step(mode, inputs, outcomes, rows, stats, rewards_per_func, weighted, advantages, zero_std, batch)
        self._metrics[mode]["time/sync_s"].append(sync_s)
        self._metrics[mode]["time/rollouts_s"].append(t2 - t1)
        self._metrics[mode]["time/rewards_s"].append(t3 - t2)
        self._metrics[mode]["time/rows_s"].append(t4 - t3)
        self._generation_s += time.monotonic() - t0
        if self.args.save_rollouts and mode == "train":
            self._save_rollouts(inputs, outcomes, rewards_per_func[local], advantages[local], rows, owners)
        batch.pop("_gap", None)
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
            print(f"[aitlrt] WARNING: {msg}", flush=True)
        return rows, owners, stats

    def _batch(self, rows: list[Row], owners: list[int], advantages: list[float], mode: str) -> dict[str, Any]:
        """trl's batch for ``rows``, padded with zero-loss rows to the same count on every rank (a multiple of
        ``steps_per_generation`` in training, so trl's split drops nothing)."""
        device = self.accelerator.device
        counts = gather(torch.tensor([len(rows)], device=device))
        target = max(1, int(counts.max()))
        chunks = self.args.steps_per_generation if mode == "train" else 1
        target = -(-target // chunks) * chunks
        pad_id = self.processing_class.pad_token_id
        padding = [Row([pad_id], [pad_id], [0], [0.0]) for _ in range(target - len(rows))]
        row_adv = [advantages[o] for o in owners] + [0.0] * len(padding)
        rows = rows + padding
        prompt_ids = pad([torch.tensor(r.prompt_ids) for r in rows], pad_id, "left").to(device)
        prompt_mask = pad([torch.ones(len(r.prompt_ids), dtype=torch.long) for r in rows], 0, "left").to(device)
        completion_ids = pad([torch.tensor(r.completion_ids) for r in rows], pad_id).to(device)
        completion_mask = pad([torch.ones(len(r.completion_ids), dtype=torch.long) for r in rows], 0).to(device)
        tool_mask = pad([torch.tensor(r.mask, dtype=torch.long) for r in rows], 0).to(device)
        sampler = pad([torch.tensor(r.logprobs, dtype=torch.float32) for r in rows], 0.0).to(device)
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
            out["_gap"] = diff.abs()
        out["advantages"] = per_token_adv
        return out

    # ---- observability ---------------------------------------------------------------------------------------
    def _log_step(self, mode, inputs, outcomes, rows, stats, rewards_per_func, weighted, advantages, zero_std, batch):
        metrics = self._metrics[mode]
        for i, name in enumerate(self.reward_func_names):
            values = [v for v in rewards_per_func[:, i].tolist() if v == v]
            if values:
                metrics[f"rewards/{name}/mean"].append(statistics.fmean(values))
                metrics[f"rewards/{name}/median"].append(statistics.median(values))
                metrics[f"rewards/{name}/std"].append(statistics.pstdev(values))
        metrics["reward"].append(torch.nanmean(weighted).item())
        metrics["reward_std"].append(float(torch.std(torch.nan_to_num(weighted))))
        group = self.num_generations if mode == "train" else self.num_generations_eval
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
        if "_gap" in batch:
            mask = batch["completion_mask"] * batch["tool_mask"]
            gap = batch["_gap"]
            total = gather(torch.stack([gap.sum(), mask.sum().float()]).unsqueeze(0)).sum(0)
            metrics["logprob_gap/mean"].append((total[0] / total[1].clamp(min=1)).item())
            metrics["logprob_gap/max"].append(gather(gap.max().unsqueeze(0)).max().item())

    def _save_rollouts(self, inputs, outcomes, rewards, advantages, rows, owners) -> None:
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
            folder = Path(self.args.output_dir) / "rollouts"
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

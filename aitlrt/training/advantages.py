"""Group-relative advantages of rollout rewards, exactly as trl 1.16 computes them for its
``multi_objective_aggregation`` (``sum_then_normalize`` and ``normalize_then_sum``)."""

from __future__ import annotations

import torch
from trl.trainer.utils import nanstd


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, zero_std)`` for weighted rewards laid out group after group (NaN = unscorable: excluded
    from the baseline, advantage 0). ``scale``: ``group`` (÷ group std), ``batch`` (÷ batch std) or ``none``."""
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group_size)
    group_std = nanstd(grouped, dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
    if scale in ("group", "none"):
        std = group_std
    elif scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale!r}")
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(group_std, torch.zeros_like(group_std))


def normalized_sum_advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, unscorable: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """trl's ``normalize_then_sum``: each reward function normalised within its group, the weighted sum normalised
    over the batch (``scale_rewards`` does not apply, as in trl). Rollouts marked ``unscorable`` are left out of
    every baseline and get advantage 0. ``zero_std``: the rollout's group has no variance in any function."""
    per_func = rewards_per_func.masked_fill(unscorable.unsqueeze(1), torch.nan)
    grouped = per_func.view(-1, group_size, per_func.size(1))
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nanstd(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    normalised = ((grouped - mean) / (std + 1e-4)).view_as(per_func)
    summed = (normalised * weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
    summed[unscorable] = torch.nan
    batch_std = nanstd(summed) if summed.numel() > 1 else torch.zeros((), device=summed.device)
    advantages = (summed - torch.nanmean(summed)) / (batch_std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std)).all(dim=2).squeeze(1).repeat_interleave(group_size)
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def rollout_advantages(
    rewards_per_func: torch.Tensor,
    weighted: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    scale: str,
    aggregation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, zero_std)`` by trl's ``aggregation`` of the reward functions' values ``rewards_per_func``
    (``weighted``: their weighted sum, NaN where a rollout is unscorable)."""
    if aggregation == "normalize_then_sum":
        return normalized_sum_advantages(rewards_per_func, weights, torch.isnan(weighted), group_size)
    return group_advantages(weighted, group_size, scale)  # sum_then_normalize (AgentGRPOConfig refuses others)

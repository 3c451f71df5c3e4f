"""Group-relative advantages of rollout rewards, exactly as trl 1.16's ``sum_then_normalize``."""

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

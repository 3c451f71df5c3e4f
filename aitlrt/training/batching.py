"""Pure batch functions of a training step: rows to trl's batch tensors, the weights that make each rollout one of
trl's completions, the importance-sampling ratio, micro-batches and passes, and the per-micro-batch loss scales.

No model and no collective runs here: the caller passes what every rank agreed on (row targets, rollout totals,
pass counts), so tests and benches call these directly.

A rollout weighs in the loss as one of trl's completions, however many rows it became and however many zero-loss
padding rows its rank got (``rollout_weights`` scales the rows' advantages):
- ``dapo``, ``cispo``, ``vespo``: each trained token 1 / (trained tokens of the generation batch, all ranks);
  ``bnpo``: 1 / (trained tokens of the micro-batch). trl's own normalisers; rows and padding do not enter.
- ``grpo``, ``sapo``: the rollout's token-mean loss (over all its rows) 1 / (rollouts per micro-batch).
- ``luspo``: the rollout's token-sum loss 1 / (rollouts per micro-batch); ``dr_grpo``: 1 / (rollouts per
  micro-batch x ``max_completion_length``).
"Rollouts per micro-batch" counts every rank's rollouts (DDP averages the ranks' gradients): with dynamic sampling
the ranks keep unequal counts, and a rank's own count would weigh its rollouts by 1 / (its count) instead.
With ``beta != 0`` (token-normalised losses only, ``AgentGRPOConfig``) the KL term is weighted per token as the
policy term is.

Memory: every forward/backward holds at most ``max_tokens_per_forward`` padded tokens (``micro_batches``: rows of
similar length together, each micro-batch padded to its own longest row). The trainer runs trl's loss on each
micro-batch of a chunk, scaled (``part_scale``) so the sum is trl's loss of the whole chunk: x(micro-batch trained
tokens / chunk trained tokens) for ``dapo``/``cispo``/``vespo`` and ``bnpo``, x(micro-batch rows / chunk rows) for
``grpo``/``sapo``/``luspo``/``dr_grpo``. Under ``dapo``/``cispo``/``vespo`` the micro-batch's ``num_items_in_batch``
is scaled alike (``part_items``), so its policy and KL terms are unchanged while trl's per-call additive terms (the
entropy bonus, a mean over the call's tokens; the MoE router's aux loss) count once per chunk, not once per
micro-batch. Every rank runs the largest rank's number of passes (ZeRO-3 collectives): the extra ones are
zero-loss passes over one row (``passes``), left out of the merged metrics.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from trl.trainer.utils import nanmax, nanmin, pad

from aitlrt.training.config import ROW_NORMALISED_LOSSES
from aitlrt.training.rows import Row

PROMPT_KEYS = ("prompt_ids", "prompt_mask")
TOKEN_SHARED_LOSSES = ("dapo", "cispo", "vespo")
"""Normalised by the generation batch's trained tokens (``num_items_in_batch``), not by the call's own."""


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


def passes(groups: list[list[int]], most: int) -> list[list[int]]:
    """``groups`` (this rank's micro-batches), then zero-loss one-row passes up to ``most`` (the largest rank's
    count), so that every rank runs as many forwards (ZeRO-3 collectives); the first ``len(groups)`` are real."""
    return groups + [[groups[-1][-1]]] * (most - len(groups))


def balancing_pass(part: dict[str, Any]) -> dict[str, Any]:
    """A zero-loss pass (``passes``) over ``part``: its row trains no token, so that trl's masked metrics of the
    pass (entropy, clip ratios, gathered over ranks) leave the duplicated row out."""
    return {**part, "tool_mask": torch.zeros_like(part["tool_mask"])}


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


def padded_rows(
    rows: list[Row],
    owners: list[int],
    target: int,
    pad_id: int,
    multiple: int | None,
    truncated: set[int] | None = None,
    device: Any = "cpu",
) -> dict[str, torch.Tensor]:
    """trl's row tensors for ``rows`` (row i of local rollout ``owners[i]``), then zero-loss padding rows up to
    ``target``: ``prompt_ids``/``prompt_mask`` left-padded, ``completion_ids``/``completion_mask``/``tool_mask``/
    ``sampling_per_token_logps`` right-padded (to ``multiple``), and ``owner`` (-1 for padding). The rows of the
    rollouts in ``truncated`` get no loss (``tool_mask`` 0)."""
    padding = [Row([pad_id], [pad_id], [0], [0.0]) for _ in range(target - len(rows))]
    owner = torch.tensor(owners + [-1] * len(padding), device=device)
    rows = rows + padding

    def right(values: list[list[Any]], value: Any, dtype: torch.dtype) -> torch.Tensor:
        return pad([torch.tensor(v, dtype=dtype) for v in values], value, "right", multiple).to(device)

    tool_mask = right([r.mask for r in rows], 0, torch.long)
    if truncated:
        tool_mask[torch.tensor([o in truncated for o in owner.tolist()], device=device)] = 0
    return {
        "prompt_ids": pad([torch.tensor(r.prompt_ids) for r in rows], pad_id, "left", multiple).to(device),
        "prompt_mask": pad([torch.ones(len(r.prompt_ids), dtype=torch.long) for r in rows], 0, "left", multiple).to(
            device
        ),
        "completion_ids": right([r.completion_ids for r in rows], pad_id, torch.long),
        "completion_mask": right([[1] * len(r.completion_ids) for r in rows], 0, torch.long),
        "tool_mask": tool_mask,
        "sampling_per_token_logps": right([r.logprobs for r in rows], 0, torch.float32),
        "owner": owner,
    }


def rollout_weights(
    loss_type: str, owner: torch.Tensor, loss_mask: torch.Tensor, rollouts: int, rollouts_per_rank: float
) -> torch.Tensor:
    """(B, 1) factors on the rows' advantages that weigh each of the ``rollouts`` (this rank's) as one of trl's
    completions in the row-normalised losses (module docstring): trl divides by the rows of a micro-batch, padding
    included, where a rollout should count as one of all ranks' rollouts (``rollouts_per_rank``: their total over
    the world size); and under ``grpo``/``sapo`` a row's token-mean counts for its share of the rollout's trained
    tokens. 1 for the token-normalised losses."""
    weights = torch.ones(owner.size(0), 1, device=owner.device)
    if loss_type not in ROW_NORMALISED_LOSSES:
        return weights
    weights *= owner.size(0) / max(rollouts_per_rank, 1e-9) if rollouts else 1.0
    if loss_type in ("grpo", "sapo"):
        tokens = loss_mask.sum(dim=1).float()
        per_rollout = torch.zeros(rollouts + 1, device=owner.device).index_add_(0, owner + 1, tokens)
        weights *= (tokens / per_rollout[owner + 1].clamp(min=1.0)).unsqueeze(1)
    return weights


def per_rollout_sums(values: torch.Tensor, owner: torch.Tensor, rollouts: int) -> torch.Tensor:
    """(B, 1): each row's rollout's sum of ``values`` (B, T) over all its rows (padding rows, owner -1: their
    own sum)."""
    row_sums = values.sum(dim=1)
    totals = torch.zeros(rollouts + 1, device=values.device, dtype=row_sums.dtype).index_add_(0, owner + 1, row_sums)
    return torch.where(owner >= 0, totals[owner + 1], row_sums).unsqueeze(1)


def importance_sampling_ratio(
    diff: torch.Tensor,
    mode: str,
    low: float | None,
    high: float | None,
    owner: torch.Tensor | None = None,
    rollouts: int = 0,
) -> torch.Tensor:
    """trl's importance-sampling ratio for ``vllm_importance_sampling_mode`` ``mode`` and its clip bounds, from each
    token's ``trainer - sampler`` logprob (0 where no loss): (B, T) in the token modes, (B, 1) in the sequence
    modes, where a row's sequence is its whole rollout (``owner``: the rows' rollouts, -1 for padding)."""
    if mode.startswith("sequence"):
        assert owner is not None, "a sequence-level ratio needs the rows' rollouts"
        diff = per_rollout_sums(diff, owner, rollouts)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
    return ratio.masked_fill(outside, 0.0)


def part_scale(loss_type: str, rows: list[int], mask: torch.Tensor, real: bool) -> float:
    """The factor on trl's loss of micro-batch ``rows`` that makes the micro-batches sum to the chunk's loss
    (``mask``: the chunk's trained tokens); 0 for a padding pass."""
    if not real:
        return 0.0
    if loss_type in ROW_NORMALISED_LOSSES:  # trl: mean over the micro-batch's rows
        return len(rows) / mask.size(0)
    if loss_type == "bnpo":  # trl: over the micro-batch's trained tokens
        return max(1.0, float(mask[rows].sum())) / max(1.0, float(mask.sum()))
    total = float(mask.sum())  # dapo, cispo, vespo: the micro-batch's share, num_items_in_batch scaled alike
    return float(mask[rows].sum()) / total if total else len(rows) / mask.size(0)


def part_items(loss_type: str, num_items: torch.Tensor, scale: float) -> torch.Tensor:
    """The micro-batch's ``num_items_in_batch``: under ``dapo``/``cispo``/``vespo`` x its ``part_scale``, so that
    trl's policy term, divided by it, comes back unscaled (module docstring); the others do not read it."""
    return num_items * scale if loss_type in TOKEN_SHARED_LOSSES and scale > 0 else num_items


def merge_metrics(metrics: dict[str, list[float]], marks: dict[str, int], weights: list[float]) -> None:
    """Merge the entries trl logged per micro-batch pass into one per chunk: min/max keys by min/max,
    ``entropy_coef`` its last, the others weighted by each pass's trained tokens over all ranks (``weights``).
    A balancing pass trains no token (``balancing_pass``): its entries are NaN or weigh 0."""
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

"""``scored_positions_only``: trl's logprobs, entropies and gradients, with the LM head run on the completion
positions only (a tiny random model; left-padded prompts and right-padded completions of different lengths)."""

from __future__ import annotations

import torch
from trl import GRPOTrainer

from aitlrt.training.rows import Row

ROWS = [
    Row([5, 6, 7, 8, 9], [10, 11, 12], [1, 1, 1], [0.0] * 3),
    Row([13, 14], [15, 16, 17, 18, 19, 20], [1, 0, 1, 1, 1, 1], [0.0] * 6),
    Row([21, 22, 23], [24], [1], [0.0]),
]


def scored(trainer, fn) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    batch = trainer.builder.build(ROWS, [0, 1, 2], [1.0, -1.0, 0.5])[0]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    model = trainer.model
    model.zero_grad()
    logps, entropies, _ = fn(model, ids, attention, batch["completion_ids"].size(1), compute_entropy=True)
    mask = batch["completion_mask"]
    ((logps * mask).sum() + (entropies * mask).sum()).backward()
    return logps * mask, entropies * mask, [p.grad.clone() for p in model.parameters()]


def test_only_the_scored_positions_reach_the_lm_head_and_nothing_changes(trainer, lm_head_positions):
    ours = scored(trainer, trainer._get_per_token_logps_and_entropies)
    trls = scored(trainer, lambda *a, **k: GRPOTrainer._get_per_token_logps_and_entropies(trainer, *a, **k))
    assert lm_head_positions == [3 * 6, 3 * (5 + 6 - 1)]  # 3 rows x 6 completion positions; trl: every position (CPU)
    torch.testing.assert_close(ours[0], trls[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], trls[1], rtol=1e-5, atol=1e-6)
    for x, y in zip(ours[2], trls[2], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
    assert ours[0].abs().sum() > 0

"""``max_tokens_per_forward``: a chunk's rows split into token-bounded micro-batches give trl's loss, gradients,
old logprobs and metrics of the whole chunk in one pass, for every loss type (crafted rows on a tiny random model;
no server needed)."""

from __future__ import annotations

import random

import pytest
import torch

from aitlrt.training.batching import micro_batches
from aitlrt.training.rows import Row

ADVANTAGES = [1.0, -0.5, 0.25, -1.5]
LOSS_TYPES = ["dapo", "bnpo", "grpo", "dr_grpo", "sapo", "luspo", "cispo"]
TINY = 40  # padded tokens per pass: several micro-batches


def crafted_rows() -> tuple[list[Row], list[int]]:
    """Nine rows of 4 rollouts, prompts 2-14 and completions 2-11 tokens long, some tokens untrained."""
    rng = random.Random(0)
    rows, owners = [], []
    for i in range(9):
        prompt = [rng.randrange(2, 2048) for _ in range(rng.randint(2, 14))]
        completion = [rng.randrange(2, 2048) for _ in range(rng.randint(2, 11))]
        mask = [int(rng.random() > 0.2) for _ in completion]
        rows.append(Row(prompt, completion, mask, [-7.5 + 0.05 * rng.random() for _ in completion]))
        owners.append(i % 4)
    return rows, owners


def run(trainer, budget: int | None) -> tuple[float, list[torch.Tensor], dict, dict[str, float]]:
    """Loss, gradients, the batch and the metrics logged for one chunk under ``budget``."""
    trainer.args.max_tokens_per_forward = budget
    trainer._metrics["train"].clear()
    batch = trainer.builder.build(*crafted_rows(), ADVANTAGES)[0]
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()  # the Trainer's backward of the last micro-batch
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    metrics = {key: values[-1] for key, values in trainer._metrics["train"].items() if values}
    return loss.item(), grads, batch, metrics


def test_micro_batches_fit_the_budget_and_cover_every_row_once():
    prompts, completions = [3, 12, 2, 30, 5, 5, 9], [4, 1, 7, 40, 5, 6, 2]
    groups = micro_batches(prompts, completions, 24)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert [3] in groups  # 70 tokens: over the budget, alone
    for g in groups:
        width = max(prompts[i] for i in g) + max(completions[i] for i in g)
        assert len(g) == 1 or len(g) * width <= 24
    assert micro_batches(prompts, completions, None) == [list(range(7))]


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])  # ratio in the loss forward / before
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_give_the_whole_chunk_loss_and_gradients(trainer, loss_type, mode, monkeypatch):
    trainer.loss_type = loss_type
    monkeypatch.setattr(trainer.args, "vllm_importance_sampling_mode", mode)
    batch_rows = crafted_rows()[0]
    passes = micro_batches([len(r.prompt_ids) for r in batch_rows], [len(r.completion_ids) for r in batch_rows], TINY)
    assert len(passes) >= 4
    whole = run(trainer, None)
    split = run(trainer, TINY)
    assert whole[0] != 0.0
    assert split[0] == pytest.approx(whole[0], rel=1e-5, abs=1e-7)
    assert len(whole[1]) == len(split[1]) > 0
    for x, y in zip(whole[1], split[1], strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-7)
    trained = (whole[2]["completion_mask"] * whole[2]["tool_mask"]).bool()
    if mode.startswith("sequence"):
        torch.testing.assert_close(
            split[2]["old_per_token_logps"][trained], whole[2]["old_per_token_logps"][trained], rtol=1e-5, atol=1e-5
        )
    else:  # logged per pass in the loss forward, merged per chunk
        assert {"logprob_gap/mean", "sampling/importance_sampling_ratio/max"} <= whole[3].keys()
    ratio = [f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")]
    for key in ["entropy", "clip_ratio/region_mean", "clip_ratio/high_max", "logprob_gap/mean", *ratio]:
        if key in whole[3]:
            assert split[3][key] == pytest.approx(whole[3][key], rel=1e-4, abs=1e-6), key

"""A rollout weighs the same in trl's loss whether it became one row or several, and zero-loss padding rows
change no normaliser, for every loss type (crafted rows on a tiny random model; no server needed)."""

from __future__ import annotations

import pytest
import torch

import aitlrt.training.batch_builder as builder_module
from aitlrt.training.rows import Row
from tests.helpers.multirank_run import tiny_trainer

P, C1, CTX, C2 = [11, 12, 13], [21, 22, 23, 24, 25], [31, 32], [41, 42]
ADVANTAGES = [1.0, -0.5, 0.25, 0.0]  # the rank's 4 rollouts (rollouts 2 and 3 left no rows)
LOSS_TYPES = ["grpo", "sapo", "luspo", "dr_grpo", "dapo", "bnpo", "cispo"]


def lp(n: int, start: float) -> list[float]:
    return [start - 0.1 * i for i in range(n)]  # near the random model's log(1/2048)


def one_row() -> tuple[list[Row], list[int]]:
    """Rollout 0 (two calls) as one row, rollout 1 as one row."""
    merged = Row(P, C1 + CTX + C2, [1] * 5 + [0] * 2 + [1] * 2, [*lp(5, -7.4), 0.0, 0.0, *lp(2, -7.5)])
    return [merged, Row([51, 52], [61, 62, 63], [1, 1, 1], lp(3, -7.3))], [0, 1]


def split_rows() -> tuple[list[Row], list[int]]:
    """The same calls, rollout 0 as two rows (the second call's prompt carries the first's tokens)."""
    first = Row(P, C1, [1] * 5, lp(5, -7.4))
    second = Row(P + C1 + CTX, C2, [1, 1], lp(2, -7.5))
    return [first, second, Row([51, 52], [61, 62, 63], [1, 1, 1], lp(3, -7.3))], [0, 0, 1]


def loss_and_grads(trainer, batch) -> tuple[float, list[torch.Tensor]]:
    model = trainer.model
    model.zero_grad()
    loss = trainer._compute_loss(model, batch)
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same(a, b) -> None:
    assert a[0] == pytest.approx(b[0], rel=1e-4, abs=1e-7)
    assert len(a[1]) == len(b[1]) > 0
    for x, y in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_rollout_split_into_rows_weighs_as_one_row(trainer, loss_type):
    trainer.loss_type = loss_type
    whole = loss_and_grads(trainer, trainer.builder.build(*one_row(), ADVANTAGES)[0])
    split = loss_and_grads(trainer, trainer.builder.build(*split_rows(), ADVANTAGES)[0])
    assert whole[0] != 0.0
    assert_same(whole, split)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padding_rows_change_no_normaliser(trainer, loss_type, monkeypatch):
    trainer.loss_type = loss_type
    rows, owners = split_rows()
    alone = loss_and_grads(trainer, trainer.builder.build(rows, owners, ADVANTAGES)[0])

    def another_rank_holds_seven_rows(tensor):  # the (rows, rollouts) gather sees a second rank: 7 rows of 4
        return torch.cat([tensor, tensor.new_tensor([[7, 4]])]) if tensor.shape == (1, 2) else tensor

    monkeypatch.setattr(builder_module, "gather", another_rank_holds_seven_rows)
    batch, _ = trainer.builder.build(rows, owners, ADVANTAGES)
    assert batch["completion_ids"].size(0) == 7  # 4 padding rows
    assert_same(alone, loss_and_grads(trainer, batch))


def test_kl_term_weighs_tokens_alike_however_rows_split(tmp_path):
    trainer = tiny_trainer(
        "http://127.0.0.1:9", str(tmp_path / "repo"), str(tmp_path / "run"), per_device_train_batch_size=4, beta=0.5
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():  # move the policy off the reference so that the KL term and its gradient are not zero
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    whole = loss_and_grads(trainer, trainer.builder.build(*one_row(), [0.0] * 4)[0])  # the KL term alone
    assert whole[0] > 0
    assert_same(whole, loss_and_grads(trainer, trainer.builder.build(*split_rows(), [0.0] * 4)[0]))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_rank_without_rollouts_gets_zero_loss_padding(trainer, loss_type):
    """A step whose groups all lacked reward variance (dynamic sampling skips its update), or a rank with no row."""
    trainer.loss_type = loss_type
    batch, _ = trainer.builder.build([], [], [])
    assert batch["completion_ids"].size(0) >= 1
    assert not batch["advantages"].any() and int(batch["num_items_in_batch"]) == 0

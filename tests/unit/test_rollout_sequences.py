"""A rollout is trl's completion however its ranks, rows and micro-batches split it: every rank's rollouts share one
normaliser, trl's per-call additive terms count once per chunk, and trl's sequence-level ratio and off-policy mask
see the whole rollout (crafted rows on a tiny random model; no server needed)."""

from __future__ import annotations

import pytest
import torch

import aitlrt.training.batch_builder as builder_module
from aitlrt.training import batching
from tests.helpers.multirank_run import tiny_trainer
from tests.unit.test_loss_normalisation import ADVANTAGES, assert_same, loss_and_grads, one_row, split_rows
from tests.unit.test_micro_batches import TINY, crafted_rows


def run(trainer, rows, owners, advantages=ADVANTAGES, budget=None):
    trainer.args.max_tokens_per_forward = budget
    trainer._metrics["train"].clear()
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, trainer.builder.build(rows, owners, advantages)[0])
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "luspo", "dr_grpo"])
def test_every_ranks_rollouts_share_one_normaliser_under_the_row_normalised_losses(loss_type):
    """Rank 0 kept 1 rollout, rank 1 kept 3 (dynamic sampling): DDP averages the ranks' gradients, so each of the 4
    rollouts must weigh 1/4 of the step, not 1/2 on rank 0 and 1/6 on rank 1."""
    world = 2
    for rollouts, rows in ((1, 2), (3, 3)):  # (rollouts, rows incl. padding) of each rank: one row per rollout
        owner = torch.tensor(list(range(rollouts)) + [-1] * (rows - rollouts))
        mask = torch.ones(rows, 4)
        weights = batching.rollout_weights(loss_type, owner, mask, rollouts, rollouts_per_rank=4 / world)
        # trl: the mean over the micro-batch's rows, then DDP's mean over ranks
        effective = weights[:rollouts, 0] / rows / world
        torch.testing.assert_close(effective, torch.full((rollouts,), 1 / 4))


def test_the_step_counts_every_ranks_rollouts(trainer, monkeypatch):
    """Through the batch: a second rank holding 3 rollouts halves each of this rank's 4 rollouts' row factor
    under grpo (8 rollouts over 2 ranks: 4 per rank, as this rank alone), and 8 of 2 ranks double it."""
    trainer.loss_type = "grpo"
    rows, owners = split_rows()
    alone = trainer.builder.build(rows, owners, ADVANTAGES)[0]["advantages"]

    def second_rank(kept):
        def gather(tensor):
            return torch.cat([tensor, tensor.new_tensor([[1, kept]])]) if tensor.shape == (1, 2) else tensor

        return gather

    monkeypatch.setattr(builder_module, "gather", second_rank(4))
    torch.testing.assert_close(trainer.builder.build(rows, owners, ADVANTAGES)[0]["advantages"], alone)
    monkeypatch.setattr(builder_module, "gather", second_rank(12))  # 16 rollouts, 8 per rank
    torch.testing.assert_close(trainer.builder.build(rows, owners, ADVANTAGES)[0]["advantages"], alone / 2)


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
def test_the_entropy_bonus_counts_once_per_chunk_however_many_micro_batches(trainer, monkeypatch, loss_type):
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "entropy_coef", 0.5)
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", True)
    rows, owners = crafted_rows()
    whole = run(trainer, rows, owners, [1.0, -0.5, 0.25, -1.5])
    split = run(trainer, rows, owners, [1.0, -0.5, 0.25, -1.5], budget=TINY)
    assert_same(whole, split)


def test_a_per_forward_entropy_threshold_over_several_micro_batches_is_refused(trainer, monkeypatch):
    monkeypatch.setattr(trainer, "top_entropy_quantile", 0.5)
    with pytest.raises(ValueError, match=r"top_entropy_quantile 0\.5 takes its entropy threshold over each forward"):
        run(trainer, *crafted_rows(), [1.0, -0.5, 0.25, -1.5], budget=TINY)
    run(trainer, *crafted_rows(), [1.0, -0.5, 0.25, -1.5])  # one micro-batch: trl's own threshold


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo", "sapo", "bnpo", "dr_grpo"])
def test_a_sequence_level_ratio_weighs_a_split_rollout_as_one_row(trainer, monkeypatch, loss_type):
    """GSPO with token-level sampler weights: the gradient of a rollout's sequence weight reaches all its tokens
    alike, as when it is one row."""
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "importance_sampling_level", "sequence")
    monkeypatch.setattr(trainer.args, "vllm_importance_sampling_clip_max", 1e6)  # the ratios differ per token
    whole = loss_and_grads(trainer, trainer.builder.build(*one_row(), ADVANTAGES)[0])
    split = loss_and_grads(trainer, trainer.builder.build(*split_rows(), ADVANTAGES)[0])
    assert whole[0] != 0.0
    assert_same(whole, split)


def test_the_off_policy_mask_drops_or_keeps_a_rollout_whole(trainer, monkeypatch):
    """Rollout 0 (advantage -1) as one row or two rows of different sampler drift: one mask for both."""
    monkeypatch.setattr(trainer, "loss_type", "dapo")
    rows_whole, owners_whole = one_row()
    rows_split, owners_split = split_rows()
    advantages = [-1.0, 0.5, 0.25, 0.0]
    monkeypatch.setattr(trainer, "off_policy_mask_threshold", 1e9)  # keeps all; the policy's logprobs computed
    drift = trainer.builder.build(rows_whole, owners_whole, advantages)[0]
    policy = drift["old_per_token_logps"]
    sampler = drift["sampling_per_token_logps"]
    mask = drift["completion_mask"] * drift["tool_mask"]
    mean_kl = float(((sampler - policy) * mask)[0].sum() / mask[0].sum())
    monkeypatch.setattr(trainer, "off_policy_mask_threshold", mean_kl + 1e-3)  # the rollout's mean: kept whole
    assert_same(
        loss_and_grads(trainer, trainer.builder.build(rows_whole, owners_whole, advantages)[0]),
        loss_and_grads(trainer, trainer.builder.build(rows_split, owners_split, advantages)[0]),
    )
    monkeypatch.setattr(trainer, "off_policy_mask_threshold", mean_kl - 1e-3)  # dropped whole
    batch = trainer.builder.build(rows_split, owners_split, advantages)[0]
    assert not batch["advantages"][:2].any() and batch["advantages"][2].any()


@pytest.mark.parametrize("options", [{"importance_sampling_level": "sequence"}, {"off_policy_mask_threshold": 0.5}])
def test_rollout_level_sequences_are_refused_off_policy(tmp_path, options):
    with pytest.raises(ValueError, match="weigh a rollout, all its rows, as one sequence: off-policy"):
        settings = dict(per_device_train_batch_size=4, num_iterations=2, max_staleness=0)
        tiny_trainer("http://127.0.0.1:9", str(tmp_path), str(tmp_path / "run"), **settings, **options)


def test_a_balancing_pass_trains_and_reports_no_token(trainer, monkeypatch):
    """This rank runs two extra passes (another rank has more micro-batches): loss, gradients and every merged
    metric are this rank's alone."""
    monkeypatch.setattr(trainer, "loss_type", "dapo")
    rows, owners = crafted_rows()
    advantages = [1.0, -0.5, 0.25, -1.5]
    plain = run(trainer, rows, owners, advantages, budget=TINY)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    real = len(trainer.builder.passes(trainer.builder.build(rows, owners, advantages)[0])[0])

    def more_passes(tensor):
        return tensor + 2 if tensor.shape == (1,) and int(tensor) == real else tensor

    monkeypatch.setattr(builder_module, "gather", more_passes)
    assert_same(plain, run(trainer, rows, owners, advantages, budget=TINY))
    balanced = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    assert balanced.keys() == metrics.keys()
    for key, value in metrics.items():
        assert balanced[key] == pytest.approx(value, rel=1e-6, nan_ok=True), key
    part = batching.slice_rows(trainer.builder.build(rows, owners, advantages)[0], [0])
    assert not batching.balancing_pass(part)["tool_mask"].any()

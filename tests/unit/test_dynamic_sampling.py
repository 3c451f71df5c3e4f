"""Dynamic sampling on crafted outcomes (no servers, no agents): groups without reward variance are not trained on,
further rounds of new task groups are rolled out until enough groups are informative or the round cap is hit, and
with none informative the update is skipped (no forward, no backward, no weight change)."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch

from aitlrt.report.metric_names import MEMORY_PEAK
from aitlrt.rollout.runner import RolloutOutcome
from aitlrt.training.collector import informative_groups
from tests.helpers.multirank_run import tiny_trainer
from tests.helpers.processes import held_after_freeing_gib, resident_gib


def call(i: int, completion: tuple[int, ...] = (5, 6)) -> dict:
    return {
        "call_index": i,
        "prompt_token_ids": [3, 4],
        "completion_token_ids": list(completion),
        "logprobs": [-0.5] * len(completion),
        "status": 200,
        "tag": None,
        "weight_version": 0,
    }


def outcome(i: int, patch: str, status: str = "ok") -> RolloutOutcome:
    return RolloutOutcome(f"r{i}", "task", status, "", patch, 1, 0, 2, "", trace=[call(0, (5 + i % 7, 6))])


def by_patch(prompts, completions, completion_ids=None, **kwargs):
    return [{"good": 1.0, "half": 0.5}.get(c, 0.0) for c in completions]


def make_trainer(tmp_path, **config):
    settings = dict(
        per_device_train_batch_size=4,
        num_generations=2,  # two groups of 2 per round
        vllm_importance_sampling_correction=False,
        save_rollouts=True,
        max_sampling_rounds=3,
        min_informative_groups=1,
    )
    t = tiny_trainer(
        "http://127.0.0.1:1", str(tmp_path), str(tmp_path / "run"), reward_funcs=[by_patch], **{**settings, **config}
    )
    t.weight_version = 0
    t.server.connect = lambda: None
    t.model.train()
    t.current_gradient_accumulation_steps = 1
    return t


def scripted(trainer, rounds: list[list[str]]) -> list[list[dict]]:
    """Each call to ``_rollouts`` answers the next round's patches; returns the inputs of every call."""
    script, seen = iter(rounds), []

    def rollouts(inputs):
        seen.append(inputs)
        return [outcome(i, p) for i, p in zip(itertools.count(), next(script), strict=False)]

    trainer.collector.rollouts = rollouts
    return seen


def test_informative_groups_need_variance_among_two_scorable_rollouts():
    nan = float("nan")
    weighted = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, nan, nan, nan])
    zero_std = torch.tensor([False, False, True, True, False, False, False, False])
    assert informative_groups(weighted, zero_std, 2).tolist() == [True, True] + [False] * 6


def test_zero_variance_groups_are_not_trained_and_rounds_stop_at_the_first_informative(tmp_path):
    trainer = make_trainer(tmp_path)
    seen = scripted(trainer, [["", "", "", ""], ["good", "", "half", "half"], ["good"] * 4])
    batch = trainer._generate_and_score_completions([dict(trainer.train_dataset[0]) for _ in range(4)])
    assert len(seen) == 2, "stops once min_informative_groups=1 group is informative"
    assert len(seen[1]) == 4 and all(len({r["instance_id"] for r in seen[1][g : g + 2]}) == 1 for g in (0, 2))
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    trained = [batch["completion_ids"][r][mask[r]].tolist() for r in range(len(mask)) if mask[r].any()]
    assert trained == [[5, 6], [6, 6]], "only the informative group's two rollouts (ids 5+i) are trained"
    m = trainer._metrics["train"]
    assert m["sampling/groups"] == [4] and m["sampling/informative_groups"] == [1] and m["sampling/rounds"] == [2]
    assert m["sampling/skipped_update"] == [0] and not trainer.ctx.skip_update
    assert m["zero_variance_groups"] == [3]
    records = [line for line in (tmp_path / "run" / "rollouts" / "step_0000.jsonl").read_text().splitlines()]
    assert len(records) == 8 and sum('"informative": true' in r for r in records) == 2


def test_min_informative_groups_keeps_sampling_up_to_the_round_cap(tmp_path):
    trainer = make_trainer(tmp_path, min_informative_groups=3, max_sampling_rounds=2)
    seen = scripted(trainer, [["good", "", "", ""], ["half", "", "good", "good"], ["good", ""] * 2])
    trainer._generate_and_score_completions([dict(trainer.train_dataset[0]) for _ in range(4)])
    assert len(seen) == 2, "the round cap wins over min_informative_groups"
    m = trainer._metrics["train"]
    assert m["sampling/informative_groups"] == [2] and m["sampling/rounds"] == [2] and m["sampling/groups"] == [4]


def test_no_informative_group_skips_the_update_without_forward_or_weight_change(tmp_path):
    trainer = make_trainer(tmp_path, max_sampling_rounds=2)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    seen = scripted(trainer, [[""] * 4, ["good"] * 4])
    forwards = 0
    forward = trainer._get_per_token_logps_and_entropies

    def counted(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return forward(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counted
    before = [p.detach().clone() for p in trainer.model.parameters()]
    loss = trainer.training_step(trainer.model, [dict(trainer.train_dataset[0]) for _ in range(4)], None)
    assert len(seen) == 2 and trainer.ctx.skip_update
    assert loss.item() == 0.0 and forwards == 0
    assert all(p.grad is None for p in trainer.model.parameters()), "no backward: the optimizer has nothing to apply"
    assert trainer._get_grad_norm(trainer.model, trainer._clip_grad_norm(trainer.model)) == 0.0
    trainer.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    m = trainer._metrics["train"]
    assert m["sampling/skipped_update"] == [1] and m["sampling/informative_groups"] == [0]
    assert not trainer.server.weights_changed, "nothing to sync after a skipped update"


def test_an_informative_step_runs_the_update(tmp_path):
    trainer = make_trainer(tmp_path)
    scripted(trainer, [["good", "", "", ""]])
    trainer.training_step(trainer.model, [dict(trainer.train_dataset[0]) for _ in range(4)], None)
    assert not trainer.ctx.skip_update and trainer.server.weights_changed
    # On-policy, GRPO's loss value of two equally long rollouts of advantages +a and -a is 0: the gradient is not.
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())
    # the step's peak memory is logged: at least what the process holds now (the reset was at the step's start)
    peaks = trainer._metrics["train"][MEMORY_PEAK]
    assert len(peaks) == 1 and peaks[0] >= resident_gib() - 0.01
    if sys.platform.startswith("linux"):  # a CPU trainer fixes glibc's mmap threshold: freed tensors leave
        assert held_after_freeing_gib() < 0.05


def test_the_trainer_draws_tasks_and_extra_rounds_by_the_difficulty_sidecar(tmp_path):
    from aitlrt.tasks.difficulty import TaskDifficulty, write_difficulty

    def tests_pass(prompts, completions, completion_ids=None, **kwargs):
        return by_patch(prompts, completions)

    sidecar = tmp_path / "tasks.difficulty.jsonl"
    write_difficulty(sidecar, [TaskDifficulty("task-0", 40, 1.5, 1.0, 1.0, "m", "t")])  # always solved, 40 times
    trainer = make_trainer(tmp_path, task_difficulty_file=str(sidecar), max_sampling_rounds=1)
    trainer.reward_funcs, trainer.reward_func_names = [tests_pass], ["tests_pass"]
    drawn = [row["instance_id"] for batch in trainer.get_train_dataloader() for row in batch]
    assert len(drawn) >= 4 and set(drawn) == {"task-1"}, "an always-solved task is never drawn"
    assert {row["instance_id"] for row in trainer.collector.more_inputs(4, 2, [])} == {"task-1"}
    # Online update from the training rollouts' weighted rewards: task-1's group all solved, task-0's all failed.
    curriculum = trainer.collector.curriculum
    assert curriculum is not None
    scripted(trainer, [["good", "good", "", ""]])
    inputs = [dict(trainer.train_dataset[i]) for i in (1, 1, 0, 0)]
    trainer._generate_and_score_completions(inputs)
    learned = curriculum.state_dict()["estimates"]
    assert set(learned) == {"task-0", "task-1"}, "each group updated its task's estimate"
    # A checkpoint keeps what the curriculum learned online; a run resumed from it goes on from there.
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.state.global_step = 1
    trainer._save_checkpoint(trainer.model, trial=None)
    saved = tmp_path / "run" / "checkpoint-1"
    assert (saved / "curriculum.json").is_file()
    again = make_trainer(tmp_path, task_difficulty_file=str(sidecar), max_sampling_rounds=1)
    again.reward_funcs, again.reward_func_names = [tests_pass], ["tests_pass"]
    again._load_from_checkpoint(str(saved))
    again.get_train_dataloader()
    assert again.collector.curriculum is not None and again.collector.curriculum.state_dict()["estimates"] == learned


def test_uninformative_steps_run_no_forward_and_no_optimizer_step_from_a_runs_first_micro_step(tmp_path, monkeypatch):
    """The skip holds whatever mode the model is in when a micro-step starts (eval at a run's first micro-step, as
    after an evaluation): no forward, no optimizer step (fp16's grad scaler fails on an optimizer without
    gradients), a gradient norm of 0, and the LR schedule advances as the steps count."""
    trainer = make_trainer(tmp_path, max_sampling_rounds=1, max_steps=2, lr_scheduler_type="linear")
    scripted(trainer, [[""] * 4, [""] * 4])
    forwards, steps = [], []
    forward = trainer._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: forwards.append(1) or forward(*a, **k)
    adamw_step = torch.optim.AdamW.step
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(1) or adamw_step(self, *a, **k))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.model.eval()
    trainer.train()
    assert forwards == [] and steps == [], "an uninformative step trains nothing"
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e] == [0.0, 0.0]
    assert trainer.lr_scheduler.last_epoch == 2


def test_rows_per_rollout_counts_the_trained_rollouts_and_staleness_the_updates_the_server_lacks(tmp_path):
    """``rows/per_rollout`` is over the rollouts the rows came from (not every round's); under ``weight_sync: none``
    the server keeps the initial weights, so the second step's rows lag the first update."""
    trainer = make_trainer(tmp_path, max_sampling_rounds=2)
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    scripted(trainer, [[""] * 4, ["good", "", "half", "half"], ["good", "", "", "good"]])
    inputs = [dict(trainer.train_dataset[0]) for _ in range(4)]
    trainer.training_step(trainer.model, inputs, None)  # 8 rollouts in 2 rounds, 2 trained: one row each
    m = trainer._metrics["train"]
    assert m["rows/count"] == [2] and m["rows/per_rollout"] == [1.0]
    trainer.optimizer.step()
    trainer.state.global_step = 1
    trainer.training_step(trainer.model, inputs, None)
    assert m["staleness/max"] == [0.0, 1.0] and m["staleness/0"] == [1.0, 0.0]


GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16's grad scaler and bf16 need a CUDA GPU")


@pytest.mark.parametrize(
    "precision", ["fp32", pytest.param("fp16", marks=GPU_ONLY), pytest.param("bf16", marks=GPU_ONLY)]
)
def test_skipped_steps_around_an_update_pass_the_grad_scaler_and_the_schedule(tmp_path, precision):
    """A skipped first step, an update, a skipped step, through ``train()`` (on a GPU in fp16, with the Trainer's grad
    scaler, and in bf16). The skipped steps change no weight and log a gradient norm of 0, the update changes them,
    and the LR schedule counts all three steps."""
    from transformers import TrainerCallback

    flags = {} if precision == "fp32" else {precision: True}
    trainer = make_trainer(tmp_path, max_sampling_rounds=1, max_steps=3, lr_scheduler_type="linear", **flags)
    scripted(trainer, [[""] * 4, ["good", "", "half", "half"], [""] * 4])
    snapshots = [[p.detach().clone() for p in trainer.model.parameters()]]

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append([p.detach().clone() for p in trainer.model.parameters()])

    trainer.add_callback(Snapshot())
    trainer.train()
    assert next(trainer.model.parameters()).is_cuda == (precision != "fp32" or torch.cuda.is_available())
    changed = [any(not torch.equal(a, b) for a, b in zip(x, y, strict=True)) for x, y in itertools.pairwise(snapshots)]
    assert changed == [False, True, False]
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert norms[0] == 0.0 and norms[1] > 0 and norms[2] == 0.0
    assert trainer.lr_scheduler.last_epoch == 3

"""Checkpoint save and resume: a run resumed from its checkpoint continues at the saved step with the saved weights
(a tiny model and the scripted upstream: this checks the trainer's bookkeeping, not the model)."""

from __future__ import annotations

import json

import torch
from transformers import TrainerCallback

from tests.helpers.multirank_run import tiny_trainer

ONE_RANK = {"per_device_train_batch_size": 4}  # a whole group of num_generations=4 on the one rank


def test_resume_from_a_checkpoint_continues_the_run(scripted_upstream, start_proxy, make_repo, tmp_path):
    repo = make_repo({"README": "tiny\n"})
    proxy = start_proxy(scripted_upstream).url
    out = tmp_path / "run"
    first = tiny_trainer(proxy, str(repo), str(out), max_steps=2, save_strategy="steps", save_steps=1, **ONE_RANK)
    first.train()
    saved = {k: v.clone() for k, v in first.model.state_dict().items()}
    assert (out / "checkpoint-2" / "trainer_state.json").exists()

    again = tiny_trainer(proxy, str(repo), str(out), max_steps=3, save_strategy="steps", save_steps=1, **ONE_RANK)
    fresh = {k: v.clone() for k, v in again.model.state_dict().items()}
    assert any(not torch.equal(fresh[k], saved[k]) for k in saved)  # the steps changed the weights
    at_start = {}

    class WeightsAtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            at_start.update({k: v.clone() for k, v in model.state_dict().items()})

    again.add_callback(WeightsAtStart())
    again.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert all(torch.equal(at_start[k], saved[k]) for k in saved)  # resumed with the checkpoint's weights
    assert again.state.global_step == 3
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    steps = sorted(p.name for p in (out / "rollouts").glob("step_*.jsonl"))
    assert steps == ["step_0000.jsonl", "step_0001.jsonl", "step_0002.jsonl"]  # no step ran twice

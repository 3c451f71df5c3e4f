"""Pipelined steps (``max_staleness`` 1) on a tiny model and the scripted upstream: the next step's rollouts run
while the trainer updates, every step trains the batch the dataloader gave it (straight, across the epoch's end
and across a resume), and a failure of the rollouts run ahead stops training with its reason."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from aitlrt.common.workspace import workspaces_root
from aitlrt.training.pipeline import BackgroundRolloutError
from aitlrt.training.trainer import AgentGRPOTrainer
from tests.helpers.multirank_run import tiny_trainer

ONE_RANK = {"per_device_train_batch_size": 4}  # one whole group of num_generations=4 per step


class Timed(AgentGRPOTrainer):
    """Keeps when each batch of rollouts and each training step ran, and on which thread."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int, str, float, float]] = []
        plain = self.collector.rollouts

        def rollouts(inputs, step=None):
            started = time.monotonic()
            outcomes = plain(inputs, step)
            done = self.state.global_step + 1 if step is None else step
            self.events.append(("rollouts", done, threading.current_thread().name, started, time.monotonic()))
            return outcomes

        self.collector.rollouts = rollouts

    def training_step(self, model, inputs, num_items_in_batch):
        started = time.monotonic()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.events.append(("update", self.state.global_step + 1, "", started, time.monotonic()))
        return loss


def first_round_tasks(out) -> list[str]:
    """Each step's first-round task (the dataloader's batch), from the saved rollouts."""
    steps = sorted((out / "rollouts").glob("step_*.jsonl"))
    firsts = []
    for path in steps:
        records = [json.loads(line) for line in path.open()]
        firsts.append({r["instance_id"] for r in records if r["round"] == 0}.pop())
    return firsts


@pytest.fixture
def proxy(scripted_upstream, start_proxy):
    return start_proxy(scripted_upstream).url


def test_next_steps_rollouts_run_while_the_trainer_updates(proxy, make_repo, tmp_path):
    repo = str(make_repo({"README": "tiny\n"}))
    runs = {}
    for staleness in (0, 1):
        out = tmp_path / f"staleness{staleness}"
        t = tiny_trainer(
            proxy, repo, str(out), tasks=3, max_steps=4, max_staleness=staleness, trainer=Timed, **ONE_RANK
        )
        t.train()
        t.close()
        runs[staleness] = (t, first_round_tasks(out))
    serial, pipelined = runs[0][0], runs[1][0]
    assert runs[0][1] == runs[1][1] and len(runs[1][1]) == 4  # the same batch per step, none lost or repeated
    assert all(thread != "rollouts-ahead" for kind, _, thread, _, _ in serial.events if kind == "rollouts")
    ahead = {step: (a, b) for kind, step, thread, a, b in pipelined.events if thread.startswith("rollouts-ahead")}
    updates = {step: (a, b) for kind, step, _, a, b in pipelined.events if kind == "update"}
    # 3 tasks, 4 steps: epoch 1 is steps 1-3; nothing is read across the epoch's end, nothing after the last step
    assert sorted(ahead) == [2, 3]
    for step, (started, _) in ahead.items():
        assert started < updates[step - 1][1]  # started while step - 1 was still being trained
    staleness = [e for e in pipelined.state.log_history if "staleness/max" in e]
    # weight_sync none: the server keeps the initial weights, so step k's rows lag the k - 1 updates before it
    assert [e["staleness/max"] for e in staleness] == [0, 1, 2, 3]


def test_a_failure_of_the_rollouts_run_ahead_stops_training_with_its_reason(proxy, make_repo, tmp_path):
    class Failing(AgentGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            plain = self.collector.rollouts

            def rollouts(inputs, step=None):
                if step is not None:
                    raise RuntimeError("the agents' virtualenv vanished")
                return plain(inputs, step)

            self.collector.rollouts = rollouts

    t = tiny_trainer(proxy, str(make_repo({"README": "tiny\n"})), str(tmp_path / "run"), tasks=4, max_steps=3,
                     trainer=Failing, **ONE_RANK)  # fmt: skip
    root = workspaces_root()
    before = set(root.glob(f"{os.getpid()}-pool-*"))  # other tests' trainers in this process may keep theirs
    started = time.monotonic()
    with pytest.raises(BackgroundRolloutError, match=r"step 2 failed.*virtualenv vanished"):
        t.train()
    assert t.state.global_step == 1
    assert t.collector._runner is not None and t.collector._runner.pool.root == root
    t.close()
    assert time.monotonic() - started < 120
    assert set(root.glob(f"{os.getpid()}-pool-*")) <= before  # no workspace of this run left behind


def test_a_resumed_pipelined_run_trains_every_batch_once(proxy, make_repo, tmp_path):
    """Killed in step 3 while step 3's rollouts had run ahead: resumed from checkpoint-2, steps 3 and 4 train the
    batches an uninterrupted run trains."""
    repo = str(make_repo({"README": "tiny\n"}))
    straight = tmp_path / "straight"
    tiny_trainer(proxy, repo, str(straight), tasks=5, max_steps=4, **ONE_RANK).train()

    class Killed(AgentGRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch):
            if self.state.global_step == 2:
                raise KeyboardInterrupt
            return super().training_step(model, inputs, num_items_in_batch)

    out = tmp_path / "resumed"
    first = tiny_trainer(proxy, repo, str(out), tasks=5, max_steps=4, save_strategy="steps", save_steps=1,
                         trainer=Killed, **ONE_RANK)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        first.train()
    first.close()
    assert first.collector.ahead is not None
    again = tiny_trainer(proxy, repo, str(out), tasks=5, max_steps=4, save_strategy="steps", save_steps=1, **ONE_RANK)
    again.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    again.close()
    assert first_round_tasks(out) == first_round_tasks(straight)

"""One GRPO step with real mini-swe-agent rollouts on CPU: ``AgentGRPOTrainer`` with ``agent: mini-swe-agent`` (its
warm workers, every command in the sandbox) on a generated cachetools task, through the session's real aitlrt-serve +
vLLM CPU server. Every trained token is one the server sampled in a mini-swe-agent call, with its sampler logprob,
in the rows the proxy's trace makes; the update changes the weights. (The whole main job of
``configs/cpu_demo_miniswe.yaml`` is run by hand: ``aitlrt/train.py --config configs/cpu_demo_miniswe.yaml``.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from aitlrt.rollout.agents.mini_swe import miniswe_venv
from aitlrt.training.rows import build_rows
from tests.conftest import cachetools_tasks
from tests.helpers.recording import Recording, first_of_pair

pytestmark = pytest.mark.skipif(not (miniswe_venv() / "bin" / "mini").exists(), reason="run jobs/setup.sh first")

MAX_CALLS = 2


@pytest.mark.timeout(600)
def test_one_grpo_step_with_mini_swe_agent_rollouts(served, tokenizer, tmp_path, restore_weights):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from aitlrt.rewards.builtin import non_empty_patch
    from aitlrt.tasks.loader import load_tasks
    from aitlrt.training.config import AgentGRPOConfig

    (task,) = load_tasks(cachetools_tasks(2), limit=1).tasks
    config = AgentGRPOConfig(
        output_dir=str(tmp_path / "run"),
        proxy_url=served.url,
        agent="mini-swe-agent",
        rollout_max_calls=MAX_CALLS,  # mini's step limit too
        rollout_timeout_s=240,
        rollout_concurrency=2,
        max_steps=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_staleness=0,
        learning_rate=1e-4,
        temperature=1.0,
        top_p=0.95,  # the served fixture's sampling: the trainer checks it at connect
        max_completion_length=48,
        max_row_tokens=4096,
        gradient_checkpointing=False,
        reward_weights=[1.0, 0.01],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = Recording(
        model=model,
        reward_funcs=[first_of_pair, non_empty_patch],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": task.problem_statement, **task.as_row()}]),
        processing_class=tokenizer,
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    assert trainer.state.global_step == 1 and len(trainer.batches) == 1
    (outcomes,), (batch,) = trainer.outcomes, trainer.batches

    # Real mini-swe-agent rollouts: its text-mode prompt, at most its step limit of calls, its commands sandboxed.
    assert len(outcomes) == 2 and not any(o.unscorable for o in outcomes), [(o.status, o.reason) for o in outcomes]
    journal: dict[str, list[dict]] = {}
    for line in (served.run_dir / "calls.jsonl").read_text().splitlines():
        if "deleted" not in (entry := json.loads(line)):
            journal.setdefault(entry["rollout_id"], []).append(entry)
    expected_tokens, expected_logprobs, rows_expected = [], [], 0
    for outcome in outcomes:
        calls = sorted(journal[outcome.rollout_id], key=lambda c: c["call_index"])
        assert 1 <= outcome.calls <= MAX_CALLS and len(calls) <= MAX_CALLS
        assert "mswea_bash_command" in calls[0]["request"]["messages"][0]["content"]  # mini's text-mode system prompt
        assert "isolation: bwrap" in outcome.log_tail, outcome.log_tail[-500:]
        rows, _ = build_rows(calls, config.max_row_tokens)
        rows_expected += len(rows)
        for call in calls:
            if call["status"] == 200 and not call["tag"]:
                expected_tokens += call["completion_token_ids"]
                expected_logprobs += call["logprobs"]

    # Every trained token is one the server sampled, with the sampler's own logprob, and nothing else is.
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    assert batch["completion_ids"][mask].tolist() == expected_tokens
    assert batch["sampling_per_token_logps"][mask].tolist() == pytest.approx(expected_logprobs, abs=1e-6)
    assert int(mask.any(dim=1).sum()) == rows_expected  # the other rows are zero-loss padding

    # The update ran: a finite loss, a gradient, changed weights; the step's rollouts were saved with their rewards.
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and math.isfinite(logged[0]["loss"]) and logged[0].get("grad_norm", 0) > 0, logged
    assert any(not torch.equal(before[name], p.detach()) for name, p in trainer.model.named_parameters())
    saved = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_0000.jsonl").open()]
    assert [s["rollout_id"] for s in saved] == [o.rollout_id for o in outcomes]
    assert [s["rewards"]["first_of_pair"] for s in saved] == [1.0, 0.0]

"""One rank of the multi-rank check (run by ``tests/test_multirank.py`` under torchrun, CPU/gloo).

A tiny random Llama is trained for two steps; a small agent of ours opens a new conversation per call, so every
call is its own row, and its rollouts make 1-2 calls on rank 0 and 6-7 on rank 1: the ranks hold very different row
counts, and each group of ``num_generations`` rollouts straddles the ranks.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from pathlib import Path

import httpx
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from aitlrt.rollout.agents import AgentExit
from aitlrt.tasks.task import task_from_row
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.trainer import AgentGRPOTrainer


class CountingAgent:
    """Makes 1-2 calls per rollout on rank 0 and 6-7 on rank 1 (alternately; one-message conversations), then
    writes how many into the repository."""

    name = "counting"

    def __init__(self) -> None:
        self._runs = itertools.count()

    def run(self, task, ws, endpoint, timeout_s):
        started = time.monotonic()
        calls = 1 + 5 * int(os.environ.get("RANK", "0")) + next(self._runs) % 2
        for j in range(calls):
            body = {"model": endpoint.model, "messages": [{"role": "user", "content": f"{task.task_id} call {j}"}]}
            headers = {"Authorization": f"Bearer {endpoint.api_key}"}
            httpx.post(f"{endpoint.base_url}/chat/completions", json=body, headers=headers, timeout=60)
        (ws.repo / "answer.txt").write_text(f"{calls}\n")
        return AgentExit(0, False, "", time.monotonic() - started)


def calls_reward(prompts, completions, completion_ids=None, **kwargs):
    return [c / 6 for c in kwargs["rollout_calls"]]


def tiny_trainer(proxy: str, repo: str, out: str, *, reward_funcs=None, peft_config=None, **config) -> AgentGRPOTrainer:
    """A tiny random Llama, two tasks on ``repo``, the counting agent, the scripted upstream behind ``proxy``
    (``reward_funcs``: default ``calls_reward``; ``peft_config``: trl's)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=2048,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    )
    if config.get("beta") and peft_config is None:  # trl loads the reference model from the policy's name_or_path
        model.save_pretrained(Path(out) / "initial")
        model.config._name_or_path = str(Path(out) / "initial")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, "<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )
    rows = [
        task_from_row({"instance_id": f"task-{k}", "problem_statement": f"task {k}", "repo_path": repo}).as_row()
        for k in range(2)
    ]
    settings = dict(
        output_dir=out,
        proxy_url=proxy,
        max_steps=2,
        per_device_train_batch_size=2,
        num_generations=4,
        learning_rate=1e-3,
        weight_sync="none",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        rollout_concurrency=2,
        max_completion_length=None,  # as the scripted upstream's proxies: no --max-tokens
        weight_probe=False,  # the scripted upstream is no model to probe
    )
    return AgentGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs or [calls_reward],
        peft_config=peft_config,
        args=AgentGRPOConfig(**{**settings, **config}),
        processing_class=tok,
        agent=CountingAgent(),
        train_dataset=Dataset.from_list([{"prompt": r["problem_statement"], **r} for r in rows]),
    )


def main(proxy: str, repo: str, out: str) -> None:
    trainer = tiny_trainer(proxy, repo, out)
    trainer.train()
    rank = trainer.accelerator.process_index
    counts = [entry["rows/count"] for entry in trainer.state.log_history if "rows/count" in entry]
    Path(out, f"rank{rank}.done").write_text(f"{trainer.state.global_step} {counts}\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])

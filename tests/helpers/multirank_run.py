"""One rank of the multi-rank checks (run by ``tests/integration/test_multirank.py`` under torchrun, CPU/gloo).

``main``: a tiny random Llama is trained for two steps; a small agent of ours opens a new conversation per call, so
every call is its own row, and its rollouts make 1-2 calls on rank 0 and 6-7 on rank 1: the ranks hold very
different row counts, and each group of ``num_generations`` rollouts straddles the ranks.

``dynamic_main``: dynamic sampling over two ranks, one group of 2 per rank per round (crafted outcomes, no server):
step 1's first round has no informative group, its second one only on rank 1; step 2 has none in either round
(update skipped). Saves each rank's logged sampling metrics and whether the weights changed in each step.

``update_main``: two GRPO steps on crafted informative rollouts of 1-3 calls each under a tiny
``max_tokens_per_forward`` (several micro-batches per chunk), plain SGD, in trl's default precision or fp32;
launched plainly or under one of ``configs/accelerate``'s DeepSpeed configs. Saves what the reload sync would
send after training and the weight probe's logprobs.

``micro_batch_main``: one chunk of crafted rows (rank 0: 2 short rows, rank 1: 9 rows; one rank: all of them)
under a tiny ``max_tokens_per_forward``; saves the loss, the rank-averaged gradients (as DDP's) and the number of
forward passes each rank ran and its own micro-batches.
"""

from __future__ import annotations

import itertools
import os
import random
import sys
import time
from pathlib import Path

import httpx
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from aitlrt.common.shared_prefix import prefix_batches
from aitlrt.rollout.agents import AgentExit
from aitlrt.tasks.task import task_from_row
from aitlrt.training.batching import micro_batches, row_tokens
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.rows import Row
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


def tiny_llama(vocab_size: int, max_positions: int) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama of width 32 (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    return LlamaForCausalLM(config)


def tiny_trainer(
    proxy: str, repo: str, out: str, *, reward_funcs=None, peft_config=None, tasks: int = 2, trainer=None, **config
) -> AgentGRPOTrainer:
    """A tiny random Llama, ``tasks`` tasks on ``repo``, the counting agent, the scripted upstream behind ``proxy``
    (``reward_funcs``: default ``calls_reward``; ``peft_config``: trl's; ``trainer``: a subclass to build)."""
    model = tiny_llama(2048, 256)
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
        for k in range(tasks)
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
        bf16=False,  # fp32 on every CPU: the tests compare losses and gradients to 1e-4 (bf16 autocast is the CPU's
        # choice where bf16 is native, AVX512-BF16 or AMX: there split and whole rows differed by up to 1e-3)
    )
    return (trainer or AgentGRPOTrainer)(
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


MICRO_ADVANTAGES = [1.0, -0.5, 0.25, -1.5]


def micro_rows(rollouts: list[int]) -> tuple[list[Row], list[int]]:
    """The rows of ``rollouts`` (of 4) and their owners, local indices: rollouts 0 and 1 one short row each,
    2 and 3 four and five rows of 4-20 prompt and 3-12 completion tokens."""
    rng = random.Random(0)
    rows, owners = [], []
    for rollout, count in enumerate([1, 1, 4, 5]):
        for _ in range(count):
            prompt = [rng.randrange(2, 2048) for _ in range(rng.randint(4, 20) if rollout > 1 else 2)]
            completion = [rng.randrange(2, 2048) for _ in range(rng.randint(3, 12) if rollout > 1 else 3)]
            row = Row(prompt, completion, [1] * len(completion), [-7.5 + 0.05 * rng.random() for _ in completion])
            if rollout in rollouts:
                rows.append(row)
                owners.append(rollouts.index(rollout))
    return rows, owners


def by_patch(prompts, completions, completion_ids=None, **kwargs):
    return [1.0 if c == "good" else 0.0 for c in completions]


def dynamic_main(repo: str, out: str) -> None:
    from transformers import TrainerCallback

    from aitlrt.rollout.runner import RolloutOutcome

    trainer = tiny_trainer(
        "http://127.0.0.1:9",
        repo,
        str(Path(out) / "run"),
        reward_funcs=[by_patch],
        per_device_train_batch_size=2,
        num_generations=2,
        max_sampling_rounds=2,
        vllm_importance_sampling_correction=False,
    )
    trainer.server.connect = lambda: None  # type: ignore[method-assign]
    trainer.weight_version = 0
    rank, rounds = trainer.accelerator.process_index, itertools.count()

    def rollouts(inputs, step=None):
        informative = next(rounds) == 1 and rank == 1  # step 1, round 2, rank 1 only

        def trace(i: int) -> list[dict]:
            """One call; the two rollouts' completions differ (identical rows with opposite advantages would
            cancel to an exactly zero gradient)."""
            completion = [5 + rank, 6 + i]
            return [
                {
                    "call_index": 0,
                    "prompt_token_ids": [3, 4],
                    "completion_token_ids": completion,
                    "logprobs": [-0.5, -0.5],
                    "status": 200,
                    "tag": None,
                    "weight_version": 0,
                }
            ]

        patches = ["good", ""] if informative else ["", ""]
        made = enumerate(patches)
        return [RolloutOutcome(f"r{rank}{i}", "t", "ok", "", p, 1, 0, 2, "", trace=trace(i)) for i, p in made]

    trainer.collector.rollouts = rollouts  # type: ignore[method-assign]
    snapshots = [[p.detach().clone() for p in trainer.model.parameters()]]

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append([p.detach().clone() for p in trainer.model.parameters()])

    trainer.add_callback(Snapshot())
    trainer.train()
    changed = [any(not torch.equal(a, b) for a, b in zip(x, y, strict=True)) for x, y in itertools.pairwise(snapshots)]
    keys = ("sampling/rounds", "sampling/groups", "sampling/informative_groups", "sampling/skipped_update")
    logs = [{k: e[k] for k in keys} for e in trainer.state.log_history if "sampling/rounds" in e]
    norms = [e.get("grad_norm") for e in trainer.state.log_history if "sampling/rounds" in e]
    torch.save({"changed": changed, "logs": logs, "grad_norms": norms}, Path(out) / f"dynamic{rank}.pt")


def update_main(repo: str, out: str, accumulation: str, lora: str, precision: str = "default") -> None:
    from peft import LoraConfig

    from aitlrt.rollout.runner import RolloutOutcome
    from aitlrt.training.probe import policy_logprobs
    from aitlrt.training.weight_sync import host_state_dict, zero3

    trainer = tiny_trainer(
        "http://127.0.0.1:9",
        repo,
        str(Path(out) / "run"),
        reward_funcs=[by_patch],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora == "lora" else None,
        tasks=8,
        per_device_train_batch_size=2,
        num_generations=2,
        gradient_accumulation_steps=int(accumulation),
        max_tokens_per_forward=24,
        optim="sgd",  # Adam would magnify the last bits of near-zero gradients into visible weight differences
        learning_rate=1.0,
        loss_type="grpo",
        vllm_importance_sampling_correction=False,
        **({"bf16": False} if precision == "fp32" else {}),  # else trl's default: bf16 where the GPU has it
    )
    trainer.server.connect = lambda: None  # type: ignore[method-assign]
    trainer.weight_version = 0
    rank, tokens = trainer.accelerator.process_index, itertools.count()

    def rollouts(inputs, step=None):
        made = []
        for i in range(len(inputs)):
            trace = []
            for call in range(1 + (rank + i) % 3):
                k = next(tokens)
                trace.append(
                    {
                        "call_index": call,
                        "prompt_token_ids": [3 + (7 * k + j) % 500 for j in range(4 + k % 5)],
                        "completion_token_ids": [5 + (11 * k + j) % 700 for j in range(3 + k % 4)],
                        "logprobs": [-7.0] * (3 + k % 4),
                        "status": 200,
                        "tag": None,
                        "weight_version": 0,
                    }
                )
            patch = "good" if i % 2 == 0 else ""
            made.append(RolloutOutcome(f"r{rank}{i}", "t", "ok", "", patch, 1, 0, len(trace), "", trace=trace))
        return made

    trainer.collector.rollouts = rollouts  # type: ignore[method-assign]
    trainer.train()
    sent = host_state_dict(trainer)  # every rank: under ZeRO-3 the others join the main process's gathers
    probe = policy_logprobs(trainer, [3, 14, 15, 92, 65, 35])  # the weight probe's forward: collective under ZeRO-3
    norms = [e["grad_norm"] for e in trainer.state.log_history if "sampling/rounds" in e]
    saved = {"sent": sent, "probe": probe, "grad_norms": norms, "deepspeed": trainer.is_deepspeed_enabled}
    saved["zero3"] = zero3(trainer)
    torch.save(saved, Path(out) / f"update{rank}.pt")


def micro_batch_main(repo: str, out: str, loss_type: str, budget: str) -> None:
    trainer = tiny_trainer(
        "http://127.0.0.1:9",
        repo,
        str(Path(out) / "run"),
        per_device_train_batch_size=4,
        max_completion_length=64,
        loss_type=loss_type,
        max_tokens_per_forward=int(budget),
    )
    world, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
    rollouts = [0, 1, 2, 3] if world == 1 else [2 * rank, 2 * rank + 1]
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    forwards = 0
    forward = trainer._get_per_token_logps_and_entropies

    def counted(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return forward(*args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counted  # type: ignore[method-assign]
    rows, owners = micro_rows(rollouts)
    batch = trainer.builder.build(rows, owners, [MICRO_ADVANTAGES[r] for r in rollouts])[0]
    if trainer._shared_prefix():  # the rank's own micro-batches, before padding passes
        own = len(prefix_batches(row_tokens(batch), int(budget), trainer.builder.min_shared))
    elif trainer.builder.min_shared:  # on CPU without a shared prefix: one row per pass
        own = len(batch["prompt_ids"])
    else:
        own = len(
            micro_batches(batch["prompt_mask"].sum(1).tolist(), batch["completion_mask"].sum(1).tolist(), int(budget))
        )
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters()]
    if world > 1:
        for grad in grads:
            torch.distributed.all_reduce(grad)
            grad /= world
        torch.distributed.all_reduce(loss := loss.detach())
        loss /= world
    saved = {"loss": loss.item(), "grads": grads, "forwards": forwards, "own": own}
    torch.save(saved, Path(out) / f"w{world}r{rank}.pt")


if __name__ == "__main__":
    if sys.argv[1] == "--micro-batches":
        micro_batch_main(*sys.argv[2:6])
    elif sys.argv[1] == "--dynamic":
        dynamic_main(*sys.argv[2:4])
    elif sys.argv[1] == "--update":
        update_main(*sys.argv[2:7])
    else:
        main(*sys.argv[1:4])
    if torch.distributed.is_initialized():  # else gloo can abort the exiting rank (pytorch#190489)
        torch.distributed.destroy_process_group()

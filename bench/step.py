"""Benchmark of a training step's update against the machine's own limit (issue 14).

``update_vs_bare``: the rows of one real training step of the main job (``bench/data/cpu_demo_calls.jsonl``: the
recorded calls of ``configs/cpu_demo.yaml``'s GRPO steps, real Aider rollouts through aitlrt-serve and vLLM CPU;
token ids and sampler logprobs as recorded) trained by ``AgentGRPOTrainer`` with the main job's settings (the
bundled SmolLM2-135M in fp32 with bf16 autocast, no gradient checkpointing, ``max_tokens_per_forward`` 4096: one row
per pass), against a bare PyTorch loop on the same rows: per row one forward (logits of the completion only), a
policy-gradient loss, backward; one AdamW step. Timed side by side, alternating which goes first, median of
``ROUNDS``; AITLRT's update is everything from the rows to the new weights (``_batch``, ``training_step``, the
optimizer step). For contrast, today's separate importance-sampling forward before the update (``fused`` off).

Run: ``python bench/step.py`` (no arguments).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from aitlrt.common.model import resolve_model
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.rows import Row, build_rows
from aitlrt.training.trainer import AgentGRPOTrainer

CALLS = Path(__file__).with_name("data") / "cpu_demo_calls.jsonl"
ROLLOUTS = 4  # one training step of the main job: one group of 4
ROUNDS = 2
MAX_ROW, PER_FORWARD = 6144, 4096  # configs/cpu_demo.yaml's max_row_tokens and max_tokens_per_forward
UPDATE_GOAL = 0.8


def step_rows() -> list[Row]:
    """The rows of the first ``ROLLOUTS`` recorded rollouts (``build_rows``, as the trainer builds them)."""
    calls: dict[str, list[dict]] = defaultdict(list)
    for line in CALLS.open():
        call = json.loads(line)
        calls[call["rollout_id"]].append(call)
    rows = []
    for rollout in list(calls.values())[:ROLLOUTS]:
        rows += build_rows(sorted(rollout, key=lambda c: c["call_index"]), MAX_ROW)[0]
    return rows


def trainer_update(model, tokenizer, rows: list[Row], advantages: list[float], tmp: str, fused: bool) -> Callable:
    """One AITLRT update per call: ``_batch`` (rows to tensors, and without ``fused`` the importance-sampling
    forward), the Trainer's ``training_step`` (bf16 autocast), the optimizer step."""
    args = AgentGRPOConfig(
        output_dir=tmp,
        proxy_url="http://unused",
        per_device_train_batch_size=ROLLOUTS,
        num_generations=ROLLOUTS,
        bf16=True,
        gradient_checkpointing=False,
        max_tokens_per_forward=PER_FORWARD,
        learning_rate=5e-6,
        report_to=[],
        max_steps=1,
    )
    data = Dataset.from_list([{"prompt": "p", "instance_id": "x", "problem_statement": "p"}] * ROLLOUTS)
    trainer = AgentGRPOTrainer(
        model=model,
        reward_funcs=[lambda **k: [0.0] * len(k["prompts"])],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        agent=object(),
    )
    trainer._fuses_ratio = lambda: fused  # type: ignore[method-assign]
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this bench bypasses
    owners = list(range(len(rows)))

    def update() -> None:
        batch, _ = trainer._batch(rows, owners, advantages, "train")
        trainer._prepared = batch
        trainer.training_step(model, {}, batch["num_items_in_batch"])
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    return update


def bare_update(model, rows: list[Row], advantages: list[float]) -> Callable:
    """The machine's limit for these rows: per row a forward under bf16 autocast (logits of the completion only),
    ``-advantage x logprob`` over the sampled tokens, backward; then one AdamW step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-6)
    tensors = []
    for row, adv in zip(rows, advantages, strict=True):
        ids = torch.tensor([row.prompt_ids + row.completion_ids])
        mask = torch.tensor(row.mask, dtype=torch.float32)
        tensors.append((ids, torch.tensor(row.completion_ids), mask, adv))
    total = sum(float(m.sum()) for _, _, m, _ in tensors)

    def update() -> None:
        for ids, completion, mask, adv in tensors:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids, logits_to_keep=len(completion) + 1).logits[0, :-1]
            logps = torch.log_softmax(logits.float(), dim=-1).gather(1, completion.unsqueeze(1)).squeeze(1)
            (-(adv * logps * mask).sum() / total).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return update


def timed(update: Callable) -> float:
    started = time.perf_counter()
    update()
    return time.perf_counter() - started


def main() -> int:
    torch.manual_seed(0)
    path = resolve_model("bundled")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = step_rows()
    advantages = [1.0, -1.0] * (len(rows) // 2) + [0.5] * (len(rows) % 2)
    tokens = sum(len(r.tokens) for r in rows)
    sampled = sum(r.sampled for r in rows)
    print(
        f"rows: {len(rows)} of {ROLLOUTS} recorded rollouts, {tokens} tokens ({sampled} sampled); threads "
        f"{torch.get_num_threads()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        updates = {
            "bare PyTorch": bare_update(model, rows, advantages),
            "AITLRT (ratio in the loss forward)": trainer_update(model, tokenizer, rows, advantages, tmp, True),
            "AITLRT, separate IS forward (before)": trainer_update(model, tokenizer, rows, advantages, tmp, False),
        }
        times: dict[str, list[float]] = {name: [] for name in updates}
        for k in range(ROUNDS):
            order = list(updates) if k % 2 == 0 else list(reversed(updates))
            for name in order:
                times[name].append(timed(updates[name]))
                print(f"  round {k + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    bare = tokens / medians["bare PyTorch"]
    print(f"\n{'update':<40}{'seconds':>9}{'tokens/s':>10}{'vs bare':>9}")
    for name, seconds in medians.items():
        print(f"{name:<40}{seconds:>9.1f}{tokens / seconds:>10.0f}{tokens / seconds / bare:>9.2f}")
    ratio = tokens / medians["AITLRT (ratio in the loss forward)"] / bare
    print(f"TARGET update_vs_bare {ratio:.2f} >={UPDATE_GOAL} {'PASS' if ratio >= UPDATE_GOAL else 'MISS'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

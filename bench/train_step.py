"""Benchmark of the update: ``AgentGRPOTrainer`` vs plain trl ``GRPOTrainer`` on the same rows and model, side by
side in one run (alternating rounds), plus the time split of one full agent step.

- CPU (no GPU): the bundled SmolLM2-135M in fp32, 4 rows of 512 tokens; then one real step of the CPU demo
  (vLLM CPU + aitlrt-serve + Aider) for the time split (about 5 minutes).
- GPU: a randomly initialised Qwen2-0.5B-shaped model in bf16, 16 rows of 2,048 tokens (no vLLM needed).

Rows look like agent rows: a prompt, then completions with context blocks (mask 0) between sampled blocks.
Run: ``python bench/train_step.py`` (no arguments).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from aitlrt.config import AgentGRPOConfig
from aitlrt.rows import Row
from aitlrt.trainer import AgentGRPOTrainer

GPU = torch.cuda.is_available()
ROWS, PROMPT, COMPLETION, ROUNDS = (16, 512, 1536, 6) if GPU else (4, 128, 384, 4)
RATIO_GOAL = 0.95


def model_and_tokenizer():
    if GPU:
        from transformers import Qwen2Config

        config = Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, "<pad>")),
            pad_token="<pad>",
            eos_token="<eos>",
        )
        return model, tok, "Qwen2-0.5B-shaped (random), bf16"
    from aitlrt.model import resolve_model

    path = resolve_model("bundled")
    return (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        AutoTokenizer.from_pretrained(path),
        ("SmolLM2-135M, fp32"),
    )


def agent_rows(vocab: int, generator: torch.Generator) -> list[Row]:
    """Rows of a prompt and three sampled blocks with environment context (mask 0) between them."""
    block = COMPLETION // 5
    rows = []
    for _ in range(ROWS):
        row = Row(torch.randint(3, vocab, (PROMPT,), generator=generator).tolist())
        for k in range(3):
            context = torch.randint(3, vocab, (block if k else 0,), generator=generator).tolist()
            row.append(context, torch.randint(3, vocab, (block,), generator=generator).tolist(), [-1.0] * block, 0)
        rows.append(row)
    return rows


def updater(trainer, model):
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this bench bypasses
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step(batch) -> float:
        sync = torch.cuda.synchronize if GPU else (lambda: None)
        sync()
        started = time.perf_counter()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - started

    return step


def main() -> None:
    model, tok, label = model_and_tokenizer()
    device = "cuda" if GPU else "cpu"
    model.to(device).train()
    data = Dataset.from_list([{"prompt": "p", "instance_id": "x", "problem_statement": "p"}] * 2)
    common = dict(
        per_device_train_batch_size=ROWS,
        num_generations=2,
        report_to=[],
        bf16=GPU,
        max_steps=1,
        gradient_checkpointing=False,
        logging_steps=1,
    )
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentGRPOTrainer(
            model=model,
            reward_funcs=[lambda **k: [0.0] * len(k["prompts"])],
            args=AgentGRPOConfig(
                output_dir=f"{tmp}/a", proxy_url="http://unused", importance_sampling_cap=None, **common
            ),
            train_dataset=data,
            processing_class=tok,
            agent=object(),
        )
        plain = GRPOTrainer(
            model=model,
            reward_funcs=[lambda **k: [0.0] * len(k["prompts"])],
            args=GRPOConfig(output_dir=f"{tmp}/p", use_vllm=False, **common),
            train_dataset=data,
            processing_class=tok,
        )
        gen = torch.Generator().manual_seed(0)
        rows = agent_rows(model.config.vocab_size, gen)
        advantages = torch.randn(ROWS, generator=gen).tolist()
        agent_batch = agent._batch(rows, list(range(ROWS)), advantages, "train")
        plain_batch = {k: agent_batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        plain_batch["advantages"] = torch.tensor(advantages, device=device)
        plain_batch["num_items_in_batch"] = plain_batch["completion_mask"].sum()
        step_agent, step_plain = updater(agent, model), updater(plain, model)
        step_agent(agent_batch), step_plain(plain_batch)  # warm-up
        t_agent, t_plain = [], []
        for k in range(ROUNDS):  # alternate which goes first, so neither always runs on a warmer cache
            if k % 2:
                t_plain.append(step_plain(plain_batch))
            t_agent.append(step_agent(agent_batch))
            if not k % 2:
                t_plain.append(step_plain(plain_batch))
    tokens = ROWS * (PROMPT + COMPLETION)
    trained = int((agent_batch["completion_mask"] * agent_batch["tool_mask"]).sum())
    a, p = statistics.median(t_agent), statistics.median(t_plain)
    print(f"\nupdate: {label}, {ROWS} rows x {PROMPT + COMPLETION} tokens, median of {ROUNDS}, {device}")
    print(f"{'trainer':<18} {'s/update':>9} {'row tok/s':>10} {'trained tok/s':>14}")
    print(f"{'AgentGRPOTrainer':<18} {a:>9.3f} {tokens / a:>10.0f} {trained / a:>14.0f}")
    print(f"{'GRPOTrainer':<18} {p:>9.3f} {tokens / p:>10.0f} {ROWS * COMPLETION / p:>14.0f}")
    split = {} if GPU else full_step_split()
    if split:
        print("\none full step of the CPU demo (2 rollouts, real Aider, vLLM CPU):")
        for key, value in split.items():
            print(f"  {key:<18} {value:>8.1f} s")
    ratio = p / a
    print(f"TARGET update_throughput_ratio {ratio:.3f} {RATIO_GOAL} {'PASS' if ratio >= RATIO_GOAL else 'MISS'}")


def full_step_split() -> dict[str, float]:
    """Run one step of configs/cpu_demo.yaml and return its time split."""
    from aitlrt.train import main as train_main

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--config", "configs/cpu_demo.yaml", "--max_steps", "1", "--output_dir", tmp, "--save_strategy", "no"]
        trainer = train_main(argv)
        logs = next(entry for entry in trainer.state.log_history if "time/rollouts_s" in entry)
    keys = ("time/sync_s", "time/rollouts_s", "time/rewards_s", "time/rows_s", "time/update_s", "step_time")
    return {key.removeprefix("time/"): logs[key] for key in keys if key in logs}


if __name__ == "__main__":
    main()

"""Benchmark of the update: ``AgentGRPOTrainer`` vs plain trl ``GRPOTrainer`` on the same rows and model, side by
side in one run (alternating rounds), plus the time split of a step.

Rows are built by ``aitlrt.training.rows.build_rows`` from real traces (``bench/data/aider_traces.jsonl``: real Aider
rollouts through aitlrt-serve and vLLM CPU with the bundled SmolLM2, as ``aitlrt rollout --out`` writes them),
repeated to fill the batch.

- CPU (no GPU): the bundled SmolLM2-135M in fp32, 2 rows (up to 1,200 tokens); then one real step of the CPU demo
  (vLLM CPU + aitlrt-serve + Aider) for the time split (about 5 minutes).
- GPU: a randomly initialised Qwen2.5-Coder-1.5B-shaped model in bf16 (no Hub, no vLLM needed), 16 rows, full
  fine-tuning and LoRA (r 16, all linear layers), gradient checkpointing; the split of the trainer's side of a
  step: rows, the importance-sampling forward, the update, and the weight export for the sync (merged LoRA); then
  three whole GRPO steps per mode through ``trainer.train()`` with the recorded rollouts replayed.

- Memory (CPU or GPU): peak memory and time of one update (IS forward + forward/backward) of 4, 16 and 64 rows of
  about 2k tokens on a tiny random Llama, each in a fresh subprocess, with ``max_tokens_per_forward=8192`` (and, for
  contrast, 4 and 16 rows without it): the growth of the peak over the process's state before the update (CPU: peak
  RSS, ``ru_maxrss``; GPU: ``torch.cuda.max_memory_allocated``) should not follow the row count.

Run: ``python bench/train_step.py`` (no arguments).
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from functools import cache
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from aitlrt.common.procs import die_with_parent
from aitlrt.rollout.runner import RolloutOutcome
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.rows import Row, build_rows
from aitlrt.training.trainer import AgentGRPOTrainer
from aitlrt.training.weight_sync import host_state_dict

GPU = torch.cuda.is_available()
ROWS, MAX_ROW, ROUNDS = (16, 4096, 6) if GPU else (2, 1200, 2)
RATIO_GOAL = 0.95
MEMORY_ROWS, MEMORY_BUDGET, MEMORY_GOAL = (4, 16, 64), 8192, 1.3
TRACES = Path(__file__).with_name("data") / "aider_traces.jsonl"


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def tokenizer_for():
    """A word-level tokenizer with a pad and an eos token: the bench feeds token ids, never text."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, "<pad>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )


def model_and_tokenizer():
    if GPU:
        from transformers import Qwen2Config

        config = Qwen2Config(  # Qwen2.5-Coder-1.5B-Instruct's shape
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        return (
            AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16),
            tokenizer_for(),
            "Qwen2.5-Coder-1.5B-shaped",
        )
    from aitlrt.common.model import resolve_model

    path = resolve_model("bundled")
    return (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        AutoTokenizer.from_pretrained(path),
        "SmolLM2-135M",
    )


@cache
def recorded_outcomes() -> list[RolloutOutcome]:
    """The recorded rollouts of ``TRACES`` (``aitlrt rollout --out`` lines), with their traces."""
    names = {f.name for f in fields(RolloutOutcome)}
    return [RolloutOutcome(**{k: v for k, v in json.loads(line).items() if k in names}) for line in TRACES.open()]


def trace_rows() -> tuple[list[Row], float]:
    """Rows of the recorded rollouts (``build_rows``, cut to ``MAX_ROW``), repeated to ``ROWS``; and the seconds
    ``build_rows`` took for all of them."""
    started = time.perf_counter()
    rows = [row for outcome in recorded_outcomes() for row in build_rows(outcome.trace, MAX_ROW)[0]]
    built_s = time.perf_counter() - started
    if not rows:
        raise SystemExit(f"{TRACES}: no usable call fits in {MAX_ROW} tokens")
    return [rows[i % len(rows)] for i in range(ROWS)], built_s


def updater(trainer, model):
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this bench bypasses
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

    def step(batch) -> float:
        sync()
        started = time.perf_counter()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - started

    return step


def compare(model, tok, rows: list[Row], tmp: str) -> dict[str, float]:
    """Median update of both trainers on the same rows (alternating), the IS forward and the export, in seconds."""
    device = "cuda" if GPU else "cpu"
    model.to(device).train()
    if GPU:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = Dataset.from_list([{"prompt": "p", "instance_id": "x", "problem_statement": "p"}] * 2)
    common = dict(
        per_device_train_batch_size=ROWS,
        num_generations=2,
        report_to=[],
        bf16=GPU,
        max_steps=1,
        logging_steps=1,
    )
    zero = [lambda **k: [0.0] * len(k["prompts"])]
    agent = AgentGRPOTrainer(
        model=model,
        reward_funcs=zero,
        args=AgentGRPOConfig(
            output_dir=f"{tmp}/a",
            proxy_url="http://unused",
            max_tokens_per_forward=None,  # one pass over all rows, as trl's own update (the budget: memory_report)
            weight_probe=False,  # the GPU's word-level tokenizer makes the probe text one token
            **common,
        ),
        train_dataset=data,
        processing_class=tok,
        agent=object(),
    )
    plain = GRPOTrainer(
        model=model,
        reward_funcs=zero,
        args=GRPOConfig(output_dir=f"{tmp}/p", use_vllm=False, **common),
        train_dataset=data,
        processing_class=tok,
    )
    advantages = torch.randn(ROWS, generator=torch.Generator().manual_seed(0)).tolist()
    agent.builder.build(rows, list(range(ROWS)), advantages)  # warm-up (kernels, allocator)
    sync()
    started = time.perf_counter()
    agent_batch, _ = agent.builder.build(rows, list(range(ROWS)), advantages)  # with the IS forward
    sync()
    batch_s = time.perf_counter() - started
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
    started = time.perf_counter()
    state = host_state_dict(agent)  # what the reload sync writes (merged weights for LoRA)
    from safetensors.torch import save_file

    save_file(state, f"{tmp}/model.safetensors")
    export_s = time.perf_counter() - started
    return {
        "agent": statistics.median(t_agent),
        "plain": statistics.median(t_plain),
        "batch_is": batch_s,
        "export": export_s,
        "export_gb": sum(t.numel() * t.element_size() for t in state.values()) / 1e9,
        "trained": int((agent_batch["completion_mask"] * agent_batch["tool_mask"]).sum()),
        "tokens": int(agent_batch["prompt_mask"].sum() + agent_batch["completion_mask"].sum()),
    }


def main() -> None:
    rows, rows_s = trace_rows()
    results = {}
    for mode in ("full", "lora") if GPU else ("full",):
        model, tok, label = model_and_tokenizer()
        if mode == "lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
            )
        with tempfile.TemporaryDirectory() as tmp:
            results[mode] = compare(model, tok, rows, tmp)
        del model
        if GPU:
            torch.cuda.empty_cache()
    dtype, device = ("bf16", torch.cuda.get_device_name()) if GPU else ("fp32", "CPU")
    lengths = [len(r.tokens) for r in rows]
    print(f"\n{label}, {dtype}, {device}: {ROWS} rows from {TRACES.name} ({min(lengths)}-{max(lengths)} tokens)")
    print(f"update, median of {ROUNDS} alternating rounds:")
    print(f"{'mode':<5} {'trainer':<17} {'s/update':>9} {'tok/s':>8} {'sampled tok/s':>14}")
    for mode, r in results.items():
        for name, key in (("AgentGRPOTrainer", "agent"), ("GRPOTrainer", "plain")):
            sampled = f"{r['trained'] / r[key]:>14.0f}" if key == "agent" else f"{'-':>14}"
            print(f"{mode:<5} {name:<17} {r[key]:>9.3f} {r['tokens'] / r[key]:>8.0f} {sampled}")
    print("\ntrainer side of one step (s):")
    print(f"{'mode':<5} {'rows':>6} {'IS fwd':>7} {'update':>7} {'export':>7} {'export GB':>10}")
    for mode, r in results.items():
        times = f"{rows_s:>6.3f} {r['batch_is']:>7.3f} {r['agent']:>7.3f} {r['export']:>7.2f}"
        print(f"{mode:<5} {times} {r['export_gb']:>10.2f}")
    if GPU:
        replay_report()
    split = {} if GPU else full_step_split()
    if split:
        print("\none full step of the CPU demo (2 rollouts, real Aider, vLLM CPU):")
        for key, value in split.items():
            print(f"  {key:<18} {value:>8.1f} s")
    memory = memory_report()
    for mode, r in results.items():
        ratio = r["plain"] / r["agent"]
        verdict = "PASS" if ratio >= RATIO_GOAL else "MISS"
        print(f"TARGET update_throughput_ratio_{mode} {ratio:.3f} {RATIO_GOAL} {verdict}")
    ratio = memory[(MEMORY_ROWS[-1], MEMORY_BUDGET)]["grown"] / memory[(MEMORY_ROWS[0], MEMORY_BUDGET)]["grown"]
    verdict = "PASS" if ratio <= MEMORY_GOAL else "MISS"
    print(f"TARGET peak_mem_{MEMORY_ROWS[-1]}_over_{MEMORY_ROWS[0]} {ratio:.3f} {MEMORY_GOAL} {verdict}")


def peak_bytes() -> int:
    if GPU:
        return torch.cuda.max_memory_allocated()
    # VmHWM: the peak RSS of this process's own memory. Not ru_maxrss, which Linux carries over from the parent
    # across fork + exec (a parent of 9 GB made every child's peak 9 GB).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no procfs: KiB on Linux


def memory_step(count: int, budget: int | None) -> dict[str, float]:
    """One update of ``count`` random rows of about 2k tokens on a tiny random Llama under ``budget`` (run in a
    fresh process): the peak memory, its growth over the state before the update, and the seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).to("cuda" if GPU else "cpu").train()
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        prompt, completion = rng.randint(1400, 1600), rng.randint(400, 500)
        ids = [rng.randrange(2, 2048) for _ in range(prompt + completion)]
        rows.append(Row(ids[:prompt], ids[prompt:], [1] * completion, [-7.6] * completion))
    with tempfile.TemporaryDirectory() as tmp:
        trainer = AgentGRPOTrainer(
            model=model,
            reward_funcs=[lambda **k: [0.0] * len(k["prompts"])],
            args=AgentGRPOConfig(
                output_dir=tmp,
                proxy_url="http://unused",
                per_device_train_batch_size=count,
                num_generations=2,
                report_to=[],
                bf16=False,
                max_tokens_per_forward=budget,
                weight_probe=False,
            ),
            train_dataset=Dataset.from_list([{"prompt": "p", "instance_id": "x", "problem_statement": "p"}] * 2),
            processing_class=tokenizer_for(),
            agent=object(),
        )
        trainer.current_gradient_accumulation_steps = 1
        advantages = torch.randn(count, generator=torch.Generator().manual_seed(0)).tolist()
        sync()
        before = peak_bytes()
        started = time.perf_counter()
        batch, _ = trainer.builder.build(rows, list(range(count)), advantages)
        trainer.compute_loss(model, batch).backward()
        sync()
        seconds = time.perf_counter() - started
    peak = peak_bytes()
    return {"peak": peak / 1e6, "grown": (peak - before) / 1e6, "seconds": seconds}


def memory_report() -> dict[tuple[int, int | None], dict[str, float]]:
    """The memory table: one fresh process per (rows, budget)."""
    runs: list[tuple[int, int | None]] = [(n, MEMORY_BUDGET) for n in MEMORY_ROWS] + [(4, None), (16, None)]
    results = {}
    for count, budget in runs:
        cmd = [sys.executable, __file__, "--memory", str(count), str(budget)]
        # glibc keeps freed large blocks in its heap (RSS stays at their high-water mark); mmap them instead, so the
        # CPU peak RSS follows the live tensors
        env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run(
            cmd, capture_output=True, text=True, check=True, env=env, preexec_fn=die_with_parent(signal.SIGTERM)
        )
        results[(count, budget)] = json.loads(done.stdout.strip().splitlines()[-1])
    unit = "max_memory_allocated" if GPU else "peak RSS"
    print(f"\none update (IS forward + loss) of rows of ~2k tokens, tiny random Llama, fresh process each ({unit}):")
    print(f"{'rows':>5} {'budget':>7} {'peak MB':>8} {'grown MB':>9} {'s/update':>9}")
    for (count, budget), r in results.items():
        print(f"{count:>5} {budget or '-':>7} {r['peak']:>8.0f} {r['grown']:>9.0f} {r['seconds']:>9.2f}")
    return results


class ReplayTrainer(AgentGRPOTrainer):
    """``AgentGRPOTrainer`` whose rollouts are the recorded ones (no vLLM, no Aider): the rest of each step (rewards,
    advantages, rows, IS forward, update) is the real trainer's."""

    def _connect(self) -> None:
        self._served_model, self.weight_version = "replay", 0

    def _rollouts(self, inputs, step=None):
        recorded = recorded_outcomes()
        start = (self.state.global_step if step is None else step - 1) * len(inputs)
        return [recorded[(start + i) % len(recorded)] for i in range(len(inputs))]


def replay_steps(lora: bool, steps: int = 3) -> dict[str, float]:
    """``trainer.train()`` for ``steps`` GRPO steps on replayed rollouts; the trainer's own time split (medians over
    the steps after the first) and whether the weights moved."""
    model, tok, _ = model_and_tokenizer()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
        )
    before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}
    tasks = [  # a task needs a source; replayed rollouts never check it out
        {"prompt": f"t{i}", "instance_id": f"t{i}", "problem_statement": f"t{i}", "repo_path": "."} for i in range(64)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = ReplayTrainer(
            model=model,
            reward_funcs=[
                lambda prompts, completions, **kw: [min(1.0, t / 256) for t in kw["rollout_completion_tokens"]]
            ],
            args=AgentGRPOConfig(
                output_dir=tmp,
                proxy_url="http://replay",
                weight_probe=False,
                weight_sync="none",
                per_device_train_batch_size=ROWS,
                num_generations=4,
                max_steps=steps,
                learning_rate=1e-4 if lora else 1e-5,
                bf16=GPU,
                gradient_checkpointing=GPU,
                max_row_tokens=MAX_ROW,
                logging_steps=1,
                save_strategy="no",
                report_to=[],
                disable_tqdm=True,
            ),
            train_dataset=Dataset.from_list(tasks),
            processing_class=tok,
            agent=object(),
        )
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "time/update_s" in entry][1:]
    moved = max(
        (p.detach().float() - before[n].to(p.device)).abs().max().item()
        for n, p in model.named_parameters()
        if n in before
    )
    keys = ("time/rewards_s", "time/rows_s", "time/update_s", "step_time")
    return {k.removeprefix("time/"): statistics.median(e[k] for e in logs) for k in keys} | {"moved": moved}


def replay_report() -> None:
    """The GPU's GRPO steps table (full and LoRA)."""
    print(f"\n{ROWS} rollouts per step replayed from {TRACES.name}, trainer.train(), medians of steps 2-3 (s):")
    print(f"{'mode':<5} {'rewards':>8} {'rows+IS':>8} {'update':>7} {'step':>6} {'max |dW|':>9}")
    for mode in ("full", "lora"):
        r = replay_steps(mode == "lora")
        times = f"{r['rewards_s']:>8.3f} {r['rows_s']:>8.3f} {r['update_s']:>7.3f} {r['step_time']:>6.2f}"
        print(f"{mode:<5} {times} {r['moved']:>9.2e}")
        if GPU:
            torch.cuda.empty_cache()


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
    if sys.argv[1:2] == ["--memory"]:
        print(json.dumps(memory_step(int(sys.argv[2]), None if sys.argv[3] == "None" else int(sys.argv[3]))))
    else:
        from results import recorded

        recorded("train_step", main)

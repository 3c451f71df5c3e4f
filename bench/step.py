"""Benchmark of a training step (issue 14): the update against the machine's own limit, and the serial loop against
pipelined steps on the embedded defaults. ``python bench/step.py`` (no arguments; ``--update``: the update tables
alone).

1. ``update_vs_bare``: the rows of one real training step of the main job (``bench/data/cpu_demo_calls.jsonl``: the
   recorded calls of ``configs/cpu_demo.yaml``'s GRPO steps, real Aider rollouts through aitlrt-serve and vLLM CPU;
   token ids and sampler logprobs as recorded) trained by ``AgentGRPOTrainer`` with the main job's settings (the
   bundled SmolLM2-135M in fp32 with bf16 autocast, no gradient checkpointing, ``max_tokens_per_forward`` 4096: one
   row per pass), against a bare PyTorch loop on the same rows: per row one forward (logits of the completion
   only), a policy-gradient loss, backward; one AdamW step. Timed side by side, alternating which goes first,
   median of ``ROUNDS``; AITLRT's update is everything from the rows to the new weights (``builder.build``,
   ``training_step``, the optimizer step). For contrast, the update with a separate importance-sampling forward
   before it (what a sequence-level ratio or an off-policy generation still needs).
   ``update_vs_bare_multiturn``: the same on multi-turn rows (``bench/data/miniswe_calls.jsonl``: the recorded calls
   of 4 real mini-swe-agent rollouts through aitlrt-serve on the main job's cachetools tasks, answered by the oracle
   teacher with ``aitlrt trajectories --agent mini-swe-agent --test_feedback_rounds 1``: inspect, patch,
   ``run-tests``, submit; an append-only history, so each rollout is one ~1.5k-token row whose ~370 sampled tokens
   lie in 4 turns between the prompts' tokens). The oracle's recorded logprobs are 0: the importance-sampling
   ratio is clipped, which costs what a real one costs.
2. Steps: ``aitlrt/train.py`` on the main job's training tasks from its (cached) warm start, ``STEPS`` GRPO steps
   with ``max_staleness`` 0 (the serial loop: roll out, then update) and then 1 (the next step's rollouts run during
   the update), same seed, each with its own server. From each run's ``metrics.jsonl``, over the steps after the
   first (the first has nothing to overlap and pays the warm-ups): the step wall time, the time the trainer waited
   for rollouts, the update, and the model server's busy time (the union of the recorded calls, at the proxy).
   ``rollout_overhead``: the serial run's rollout wall time over the server's busy time for the same calls.
   ``trainer_idle``: the share of the pipelined steps the trainer spent waiting for rollouts.
   The machine's limit: the share of the CPU left idle during the serial run's steps (``/proc/stat``, sampled every
   second). Overlapping can at best fill that idle time, so on this machine pipelined ÷ serial step time cannot go
   below 1 - idle share, whatever the pipelining does.

Runs go under ``runs/bench_step/<time>/``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from aitlrt.common.model import resolve_model
from aitlrt.common.procs import die_with_parent
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.rows import Row, build_rows
from aitlrt.training.trainer import AgentGRPOTrainer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "cpu_demo.yaml"
CALLS = Path(__file__).with_name("data") / "cpu_demo_calls.jsonl"
MULTI_TURN_CALLS = Path(__file__).with_name("data") / "miniswe_calls.jsonl"
ROLLOUTS = 4  # one training step of the main job: one group of 4
ROUNDS = 2
MAX_ROW, PER_FORWARD = 6144, 4096  # configs/cpu_demo.yaml's max_row_tokens and max_tokens_per_forward
UPDATE_GOAL, PIPELINED_GOAL, OVERHEAD_GOAL, IDLE_GOAL = 0.8, 0.7, 1.3, 0.3
STEPS = 6  # the first of each run is left out of the means: 5 steps each are compared


def step_rows(path: Path) -> list[Row]:
    """The rows of the first ``ROLLOUTS`` rollouts recorded in ``path`` (``build_rows``, as the trainer builds
    them)."""
    calls: dict[str, list[dict]] = defaultdict(list)
    for line in path.open():
        call = json.loads(line)
        calls[call["rollout_id"]].append(call)
    rows = []
    for rollout in list(calls.values())[:ROLLOUTS]:
        rows += build_rows(sorted(rollout, key=lambda c: c["call_index"]), MAX_ROW)[0]
    return rows


def trainer_update(
    model, tokenizer, rows: list[Row], advantages: list[float], tmp: str, fused: bool, shared: bool = True
) -> Callable:
    """One AITLRT update per call: ``builder.build`` (rows to tensors, and without ``fused`` the importance-sampling
    forward), the Trainer's ``training_step`` (bf16 autocast), the optimizer step; ``shared``: ``shared_prefix``."""
    args = AgentGRPOConfig(
        output_dir=tmp,
        proxy_url="http://unused",
        per_device_train_batch_size=ROLLOUTS,
        num_generations=ROLLOUTS,
        bf16=True,
        gradient_checkpointing=False,
        max_tokens_per_forward=PER_FORWARD,
        shared_prefix=shared,
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
    trainer.builder.fused_ratio = fused
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this bench bypasses
    owners = list(range(len(rows)))

    def update() -> None:
        batch, _ = trainer.builder.build(rows, owners, advantages)
        trainer.ctx.prepared = batch
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


def update_vs_bare(calls: Path) -> float:
    """The update table of the rows recorded in ``calls``; AITLRT's update tokens/s over the bare loop's."""
    torch.manual_seed(0)
    path = resolve_model("bundled")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = step_rows(calls)
    advantages = [1.0, -1.0] * (len(rows) // 2) + [0.5] * (len(rows) % 2)
    tokens = sum(len(r.tokens) for r in rows)
    sampled = sum(r.sampled for r in rows)
    turns = sum(_turns(r) for r in rows)
    print(f"\nupdate on {calls.name}: {len(rows)} rows of {ROLLOUTS} recorded rollouts, {turns} sampled turns, "
          f"{tokens} tokens ({sampled} sampled); {torch.get_num_threads()} threads", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        updates = {
            "bare PyTorch": bare_update(model, rows, advantages),
            "AITLRT": trainer_update(model, tokenizer, rows, advantages, tmp, True),
            "AITLRT, separate IS forward": trainer_update(model, tokenizer, rows, advantages, tmp, False),
            "AITLRT, no shared prefix": trainer_update(model, tokenizer, rows, advantages, tmp, True, False),
        }
        times: dict[str, list[float]] = {name: [] for name in updates}
        for k in range(ROUNDS):
            order = list(updates) if k % 2 == 0 else list(reversed(updates))
            for name in order:
                times[name].append(timed(updates[name]))
                print(f"  round {k + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    bare = tokens / medians["bare PyTorch"]
    print(f"\n{'update':<32}{'seconds':>9}{'tokens/s':>10}{'vs bare':>9}")
    for name, seconds in medians.items():
        print(f"{name:<32}{seconds:>9.1f}{tokens / seconds:>10.0f}{tokens / seconds / bare:>9.2f}")
    return tokens / medians["AITLRT"] / bare


def _turns(row: Row) -> int:
    """The runs of sampled tokens in ``row`` (its model calls' answers)."""
    return sum(1 for i, m in enumerate(row.mask) if m and (i == 0 or not row.mask[i - 1]))


class CpuSampler:
    """``/proc/stat``'s (idle, total) jiffies every second in a thread, stamped with the wall clock."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            self.samples.append((time.time(), fields[3] + fields[4], sum(fields[:8])))  # idle + iowait; no guests
            if self._stop.wait(1.0):
                return

    def idle_share(self, start: float, end: float) -> float:
        """The share of all cores' time left idle between two wall-clock times."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / max(1, inside[-1][2] - inside[0][2])


def training_run(
    staleness: int, tasks: Path, warm: str, out: Path, serve_args: str, cpu: CpuSampler | None = None
) -> list[dict]:
    """``aitlrt/train.py`` for ``STEPS`` steps with ``max_staleness``; its logged steps, the steps after the first
    carrying ``cpu/idle_share`` (their window: the last step's log back by their summed step times)."""
    from learning import rl_config  # bench/learning.py: the recipe less its warm-start keys

    cmd = [sys.executable, str(ROOT / "aitlrt" / "train.py"), "--config", str(rl_config(out.parent)),
           "--tasks", str(tasks), "--heldout_share", "0", "--model_name_or_path", warm, "--max_steps", str(STEPS),
           "--max_staleness", str(staleness), "--seed", "0", "--output_dir", str(out),
           "--save_strategy", "no",
           "--serve_args", f"{serve_args} --seed 0"]  # fmt: skip
    print(f"steps: max_staleness {staleness} -> {out} (log {out}.log)", flush=True)
    with open(f"{out}.log", "w") as log:
        done = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=die_with_parent(signal.SIGTERM)
        )
    if done.returncode:
        raise SystemExit(f"the run with max_staleness {staleness} failed ({done.returncode}): see {out}.log")
    metrics = out / "metrics.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    logged = [s for s in logged if "time/step_s" in s]
    if cpu is not None and len(logged) > 1:
        end = metrics.stat().st_mtime
        idle = cpu.idle_share(end - sum(s["time/step_s"] for s in logged[1:]), end)
        for s in logged[1:]:
            s["cpu/idle_share"] = idle
    return logged


def steps() -> dict[str, dict[str, float]]:
    """Serial and pipelined runs; per mode the means over the steps after the first."""
    from learning import warm_and_rl  # bench/learning.py: the recipe's warm start and its GRPO tasks
    from trl import ModelConfig, TrlParser

    from aitlrt.common.logs import setup_logging
    from aitlrt.tasks.split import split_heldout
    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments
    from aitlrt.training.dataset import load_task_rows

    setup_logging()
    parser = TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig))  # type: ignore[arg-type]
    script, config, model_args = parser.parse_args_and_config(["--config", str(CONFIG), "--output_dir", "/tmp/x"])
    out = ROOT / "runs" / "bench_step" / time.strftime("%Y%m%d-%H%M%S")
    train, _ = split_heldout(load_task_rows(script), script.heldout_share, script.heldout_files, script.heldout_seed)
    base = resolve_model(model_args.model_name_or_path or "bundled")
    warm, rl_tasks = warm_and_rl(train, script.warm_start_share, out, base, script, config)
    means = {}
    for name, staleness in (("serial", 0), ("pipelined", 1)):
        with CpuSampler() as cpu:
            logged = training_run(staleness, rl_tasks, str(warm), out / name, script.serve_args, cpu)[1:]
        keys = ("time/step_s", "time/rollouts_s", "time/update_s", "time/model_busy_s", "cpu/idle_share")
        means[name] = {k: statistics.fmean(s[k] for s in logged if k in s) for k in keys}  # update: when one ran
        means[name]["steps"] = len(logged)
    header = f"{'steps (2..' + str(STEPS) + ')':<14}{'step s':>8}{'waiting':>9}{'update':>8}{'busy':>7}{'idle':>7}"
    print(f"\n{header}{'n':>3}")
    for name, m in means.items():
        print(f"{name:<14}{m['time/step_s']:>8.1f}{m['time/rollouts_s']:>9.1f}{m['time/update_s']:>8.1f}"
              f"{m['time/model_busy_s']:>7.1f}{m['cpu/idle_share']:>7.2f}{m['steps']:>3.0f}")  # fmt: skip
    print(f"the machine's limit: the serial steps left {means['serial']['cpu/idle_share']:.0%} of the CPU idle, so "
          f"no overlap can bring pipelined/serial below {1 - means['serial']['cpu/idle_share']:.2f} here")  # fmt: skip
    return means


def target(name: str, measured: float, goal: float, higher: bool) -> None:
    ok = measured >= goal if higher else measured <= goal
    print(f"TARGET {name} {measured:.2f} {'>=' if higher else '<='}{goal} {'PASS' if ok else 'MISS'}")


def main() -> int:
    ratio = update_vs_bare(CALLS)
    multi_turn = update_vs_bare(MULTI_TURN_CALLS)
    if "--update" in sys.argv[1:]:  # the two update tables alone (no warm start, no training runs: ~19 min)
        target("update_vs_bare", ratio, UPDATE_GOAL, True)
        target("update_vs_bare_multiturn", multi_turn, UPDATE_GOAL, True)
        return 0
    means = steps()
    serial, pipelined = means["serial"], means["pipelined"]
    target("update_vs_bare", ratio, UPDATE_GOAL, True)
    target("update_vs_bare_multiturn", multi_turn, UPDATE_GOAL, True)
    target("pipelined_step_ratio", pipelined["time/step_s"] / serial["time/step_s"], PIPELINED_GOAL, False)
    target("rollout_overhead", serial["time/rollouts_s"] / serial["time/model_busy_s"], OVERHEAD_GOAL, False)
    target("trainer_idle", pipelined["time/rollouts_s"] / pipelined["time/step_s"], IDLE_GOAL, False)
    return 0


if __name__ == "__main__":
    from results import recorded

    sys.exit(recorded("step", main))

"""Agent-in-the-loop GRPO: ``accelerate launch aitlrt/train.py --config configs/cpu_demo.yaml`` (or ``python``).

Arguments follow trl's ``TrlParser`` convention: ``AgentScriptArguments`` (tasks, serving, rewards),
``AgentGRPOConfig`` (trl's GRPOConfig plus the rollout knobs) and trl's ``ModelConfig``; a YAML ``--config`` sets
any field and command-line flags override it. ``--model_name_or_path bundled`` is the bundled SmolLM2-135M.

With ``--serve managed`` (the default) the main process starts vLLM behind ``aitlrt-serve`` on the same model
and the run's sampling parameters, and stops both at the end; otherwise ``--serve`` is the URL of a running
``aitlrt-serve`` that can see ``weight_sync_dir``.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def load_task_rows(script, out_dir: Path) -> list[dict]:
    """Task rows for the dataset: loaded (bad rows reported), or generated offline once and reused."""
    from aitlrt.common.paths import aitlrt_home
    from aitlrt.tasks.loader import load_tasks, parse_overrides

    spec = script.tasks
    if spec == "generate":
        from aitlrt.tasks.generate import generate_tasks
        from aitlrt.tasks.sources import parse_source

        name = script.generate_from.replace(":", "-").replace("/", "_").replace("==", "-")
        name += f"-max{script.generate_max_file_lines}" if script.generate_max_file_lines else ""
        path = aitlrt_home() / "tasks" / f"{name}.jsonl"
        want = script.num_tasks or 8
        have = len(path.read_text().splitlines()) if path.exists() else 0
        if have < want:
            print(f"[aitlrt] generating {want - have} tasks from {script.generate_from} into {path}", flush=True)
            generate_tasks(
                parse_source(script.generate_from),
                path,
                max_tasks=want - have,
                seed=have,
                max_file_lines=script.generate_max_file_lines,
            )
        spec = str(path)
    loaded = load_tasks(
        spec, split=script.task_split, overrides=parse_overrides(script.task_source), limit=script.num_tasks
    )
    for problem in loaded.problems:
        print(f"[aitlrt] skipping bad task row: {problem}", flush=True)
    tasks = loaded.require()
    rows = []
    for task in tasks:
        try:
            task.checkout()  # fetch and cache the repository now, not in the middle of a step
        except (OSError, RuntimeError, ValueError) as exc:
            print(f"[aitlrt] skipping task {task.instance_id}: {exc}", flush=True)
            continue
        rows.append({"prompt": task.problem_statement, **task.as_row()})
    if not rows:
        raise SystemExit("aitlrt train: no task could be prepared")
    print(f"[aitlrt] {len(rows)} tasks from {spec}", flush=True)
    return rows


def start_server(script, config, model_path: str):
    """aitlrt-serve + vLLM on ``model_path`` with the run's sampling parameters (managed mode)."""
    from aitlrt.common.procs import free_port
    from aitlrt.serving.process import ServeProcess

    run_dir = Path(config.output_dir) / "serve"
    args = [
        "--model",
        model_path,
        "--run-dir",
        str(run_dir),
        "--temperature",
        str(config.temperature),
        "--top-p",
        str(config.top_p),
        "--top-k",
        str(config.top_k or -1),
        "--max-tokens",
        str(config.max_completion_length),
        *shlex.split(script.serve_args),
    ]
    if config.weight_sync == "nccl" and "--weight-transfer-config" not in args:
        args += ["--weight-transfer-config", '{"backend": "nccl"}']  # vLLM's engine that trl's client streams into
    serve = ServeProcess(args, port=free_port(), log_path=run_dir / "serve.log")
    print(f"[aitlrt] starting aitlrt-serve + vLLM on {model_path}; log: {serve.log_path}", flush=True)
    serve.start()
    took = serve.wait_ready(progress=True)
    print(f"[aitlrt] server ready in {took:.0f} s at {serve.url}", flush=True)
    return serve


def main(argv: list[str] | None = None):
    from trl import ModelConfig, TrlParser, get_peft_config

    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments

    parser = TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig))
    script, config, model_args = parser.parse_args_and_config(argv)
    return run(script, config, model_args, get_peft_config(model_args))


def run(script, config, model_args, peft_config=None):
    import torch
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aitlrt.common.model import resolve_model
    from aitlrt.report.step_table import use_step_table
    from aitlrt.rewards.builtin import REWARDS
    from aitlrt.training.trainer import AgentGRPOTrainer

    unknown = [name for name in script.rewards if name not in REWARDS]
    if unknown:
        raise SystemExit(f"aitlrt train: unknown rewards {unknown} (known: {', '.join(REWARDS)})")
    model_path = resolve_model(model_args.model_name_or_path or "bundled")
    state = PartialState()
    with state.main_process_first():
        rows = load_task_rows(script, Path(config.output_dir))
    serve = None
    if script.serve == "managed":
        if state.num_processes > 1 and not config.proxy_url:
            raise SystemExit("aitlrt train: with several processes start aitlrt-serve yourself and pass --serve URL")
        serve = start_server(script, config, model_path)
        config.proxy_url = serve.url
    else:
        config.proxy_url = script.serve
    try:
        dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or "auto")
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        trainer = AgentGRPOTrainer(
            model=model,
            reward_funcs=[REWARDS[name] for name in script.rewards],
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        use_step_table(trainer)
        started = time.monotonic()
        try:
            trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
        finally:
            trainer.close()
        trainer.save_model(config.output_dir)
        if state.is_main_process:
            print(
                f"[aitlrt] done in {time.monotonic() - started:.0f} s; checkpoint: {config.output_dir}; "
                f"rollouts: {Path(config.output_dir) / 'rollouts'}",
                flush=True,
            )
        return trainer
    finally:
        if serve is not None:
            serve.stop()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()

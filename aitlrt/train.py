"""Agent-in-the-loop GRPO: ``accelerate launch aitlrt/train.py --config configs/cpu_demo.yaml`` (or ``python``).

Arguments follow trl's ``TrlParser`` convention: ``AgentScriptArguments`` (tasks, held-out evaluation, warm start,
rewards, serving), ``AgentGRPOConfig`` (trl's GRPOConfig plus the rollouts', the server link's, the step's and the
curriculum's parameters; ``aitlrt.training.config``) and trl's ``ModelConfig``; a YAML ``--config`` sets any field
and command-line flags override it (``docs/training.md`` tabulates them). ``--model_name_or_path bundled`` is the
bundled SmolLM2-135M.

With ``--serve managed`` (the default) the main process starts vLLM behind ``aitlrt-serve`` on the same model
and the run's sampling parameters, and stops both at the end; otherwise ``--serve`` is the URL of a running
``aitlrt-serve`` that can see ``weight_sync_dir``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trl import ModelConfig

    from aitlrt.evaluation.checkpoints import CheckpointResult
    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments
    from aitlrt.training.trainer import AgentGRPOTrainer

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

log = logging.getLogger("aitlrt.train")


def main(argv: list[str] | None = None) -> AgentGRPOTrainer:
    from aitlrt.common.keys import env_key
    from aitlrt.common.logs import setup_logging
    from aitlrt.common.procs import exit_on_sigterm

    env_key()  # $AITLRT_API_KEY (a server started elsewhere) is taken out of the environment before any child starts
    exit_on_sigterm()  # scancel, kill: stop the agents and aitlrt-serve + vLLM on the way out
    setup_logging()  # before trl is imported
    from trl import ModelConfig, TrlParser, get_peft_config

    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments

    # trl annotates the dataclass types as NewType("DataClassType", Any), which no class is
    parser = TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig))  # type: ignore[arg-type]
    script, config, model_args = parser.parse_args_and_config(argv)
    trainer = run(script, config, model_args, get_peft_config(model_args), argv=sys.argv[1:] if argv is None else argv)
    # Every rank leaves the process group, as torch asks: a gloo rank that exits without it can abort in the
    # interpreter's teardown (SIGABRT, "terminate called without an active exception": pytorch#190489) and fail
    # the job after training succeeded. Only on success: after an error the other ranks may be in a collective.
    trainer.accelerator.end_training()
    return trainer


def resume_checkpoint(value: str | bool | None, output_dir: str | Path) -> str | None:
    """What ``Trainer.train(resume_from_checkpoint=...)`` gets for ``--resume_from_checkpoint VALUE``.

    ``true`` (any case; YAML's ``true`` arrives as a bool) means, as in trl and transformers, the newest checkpoint
    in ``output_dir``: here the newest ``checkpoint-N`` whose ``trainer_state.json`` parses as a JSON object (one
    cut off while being saved has none, or an empty or torn one: transformers would pick it and fail, and so would
    every requeue; each one passed over is logged), and None, a fresh start, when there is none (where
    transformers raises): a job that resumes whatever it saved, such as a requeued SLURM job (jobs/lib.sh), passes
    ``true`` before its first checkpoint exists. ``false`` or empty: None. Anything else: a checkpoint path.
    """
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "false")):
        return None
    if value is not True and str(value).strip().lower() != "true":
        return str(value)
    root = Path(output_dir)
    steps = {c: c.name.removeprefix("checkpoint-") for c in root.glob("checkpoint-*")} if root.is_dir() else {}
    for ckpt in sorted((c for c, step in steps.items() if step.isdigit()), key=lambda c: -int(steps[c])):
        state = ckpt / "trainer_state.json"
        if not state.is_file():
            continue  # cut off before its state was written: the usual end of a killed save
        try:
            if isinstance(json.loads(state.read_text()), dict):
                return str(ckpt)
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
        log.warning("%s: its trainer_state.json is not a JSON object (empty or torn?): not resuming from it", ckpt)
    return None


def run(
    script: AgentScriptArguments,
    config: AgentGRPOConfig,
    model_args: ModelConfig,
    peft_config: Any = None,
    argv: Sequence[str] = (),
) -> AgentGRPOTrainer:
    """Train ``model_args.model_name_or_path`` on the tasks of ``script`` with ``config``; return the trainer.
    ``argv``, the command line, goes into the saved model's card (``aitlrt.training.model_card``)."""
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoTokenizer

    from aitlrt.common.model import resolve_model
    from aitlrt.common.procs import kill_sessions
    from aitlrt.report.html import write_run_report
    from aitlrt.report.metrics_log import MetricsLog
    from aitlrt.report.step_table import use_step_table
    from aitlrt.rewards.builtin import REWARDS
    from aitlrt.serving.process import ServeProcess, managed_server
    from aitlrt.tasks.loader import TaskLoadError
    from aitlrt.tasks.sandbox import require_isolation
    from aitlrt.training.config import (
        heldout_weights,
        managed_serve_args,
        model_init_kwargs,
        refuse_unsupported_model_args,
        training_weights,
    )
    from aitlrt.training.dataset import run_tasks
    from aitlrt.training.model_card import recipe_file, write_model_card
    from aitlrt.training.trainer import AgentGRPOTrainer

    refuse_unsupported_model_args(model_args)
    unknown = [name for name in script.rewards if name not in REWARDS]
    if unknown:
        raise SystemExit(f"aitlrt train: unknown rewards {unknown} (known: {', '.join(REWARDS)})")
    try:
        require_isolation(script.allow_unisolated_tests)
    except RuntimeError as exc:
        raise SystemExit(f"aitlrt train: {exc}") from None
    assert config.output_dir is not None  # TrainingArguments.__post_init__ sets its default
    out_dir = Path(config.output_dir)
    state = PartialState()
    with state.main_process_first():  # the main process prepares (bundled) or merges (an adapter) the model once
        model_path = resolve_model(model_args.model_name_or_path or "bundled")
        try:
            tasks = run_tasks(script)
        except (TaskLoadError, ValueError) as exc:
            raise SystemExit(f"aitlrt train: {exc}") from None
        load = config.model_init_kwargs = model_init_kwargs(config, model_args)  # trl's, for policy and reference
        if script.warm_start != "none":
            model_path = warm_start_model(script, config, tasks.warm_start, model_path, load)
    rows, heldout = tasks.grpo, tasks.heldout
    server: contextlib.AbstractContextManager[ServeProcess | None] = contextlib.nullcontext()
    if script.serve == "managed":
        if state.num_processes > 1 and not config.proxy_url:
            raise SystemExit("aitlrt train: with several processes start aitlrt-serve yourself and pass --serve URL")
        extra_args = managed_serve_args(shlex.split(script.serve_args), config, load)
        server = managed_server(
            model_path,
            out_dir / "serve",
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k or -1,
            max_tokens=config.max_completion_length,
            extra_args=extra_args,
        )
    with server as serve:
        config.proxy_url = serve.url if serve is not None else script.serve
        tokenizer = AutoTokenizer.from_pretrained(
            model_path, revision=load["revision"], trust_remote_code=load["trust_remote_code"]
        )
        trainer = AgentGRPOTrainer(
            model=model_path,  # trl loads it with model_init_kwargs, as its reference model
            reward_funcs=[REWARDS[name] for name in script.rewards],
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        use_step_table(trainer)
        trainer.add_callback(MetricsLog(out_dir / "metrics.jsonl"))
        evaluations = []
        if heldout and state.is_main_process:
            evaluations += heldout_evaluation("before", heldout, script, config)
        resume = resume_checkpoint(config.resume_from_checkpoint, out_dir)
        if state.is_main_process and str(config.resume_from_checkpoint).strip().lower() == "true":
            if resume:
                log.info("resuming from %s, the newest complete checkpoint in %s", resume, out_dir)
            else:
                log.info("no complete checkpoint in %s to resume from: starting fresh", out_dir)
        started = time.monotonic()
        try:
            trainer.train(resume_from_checkpoint=resume)
        except BaseException:  # SIGTERM, Ctrl-C, an error: rollouts running ahead are stopped, not waited out
            if stopped := kill_sessions():
                log.warning("stopping: stopped %d agent process(es)", stopped)
            raise
        finally:
            trainer.close()
        trainer.save_model(config.output_dir)
        if heldout:
            trainer.sync_final_weights()  # every rank: the server then serves the trained policy
        if state.is_main_process:
            log.info(
                "done in %.0f s; checkpoint: %s; rollouts: %s",
                time.monotonic() - started,
                out_dir,
                out_dir / "rollouts",
            )
            table = None
            if heldout:
                evaluations += heldout_evaluation("after", heldout, script, config)
                evaluations += heldout_evaluation("trivial", heldout, script, config)
                table = finish_heldout(
                    evaluations, out_dir, dict(zip(script.rewards, heldout_weights(script, config), strict=True))
                )
            write_run_report(out_dir)  # logs its path
            write_model_card(
                out_dir,
                model_args.model_name_or_path or "bundled",
                recipe=recipe_file(argv),
                command=argv,
                reward_weights=dict(zip(script.rewards, training_weights(script, config), strict=True)),
                warm_start=model_path if script.warm_start != "none" else None,
                heldout=table,
            )
        return trainer


def heldout_evaluation(
    label: str, rows: list[dict[str, Any]], script: AgentScriptArguments, config: AgentGRPOConfig
) -> list[CheckpointResult]:
    """The served policy (``label``: ``before``/``after`` training) on the held-out tasks, with the run's agent,
    sampling and rewards and the measures of ``aitlrt.evaluation.scoring.MEASURES``; ``trivial``: the trivial
    policies instead (``aitlrt.evaluation.heldout.evaluate_trivial``), one rollout per task."""
    from aitlrt.evaluation.heldout import evaluate_served, evaluate_trivial, prepare_rows
    from aitlrt.evaluation.scoring import measure_funcs, reward_funcs
    from aitlrt.training.config import heldout_weights, training_weights

    settings = config.rollout_settings(script.heldout_rollouts, seed=config.seed)  # before and after pair up
    weights = dict(zip(script.rewards, heldout_weights(script, config), strict=True))
    training = dict(zip(script.rewards, training_weights(script, config), strict=True))
    funcs = {**reward_funcs(script.rewards), **measure_funcs()}
    if label == "trivial":
        log.info("held-out evaluation of the trivial policies: %d tasks, one rollout each", len(rows))
        return evaluate_trivial(prepare_rows(rows), config.proxy_url, settings, funcs, weights, training)
    log.info("held-out evaluation (%s training): %d tasks x %d rollouts", label, len(rows), settings.n)
    return [evaluate_served(label, prepare_rows(rows), config.proxy_url, settings, funcs, weights, training)]


def finish_heldout(evaluations: list[CheckpointResult], out_dir: Path, weights: dict[str, float]) -> str:
    """Write the held-out rollouts beside the run (the report reads them), print the before/after table and
    return it."""
    from aitlrt.common.logs import write_line
    from aitlrt.evaluation.checkpoints import write_results
    from aitlrt.evaluation.heldout import summary_table

    rollouts, _ = write_results(evaluations, out_dir / "heldout", weights=weights)
    table = summary_table(evaluations, weights)
    write_line(table)
    log.info("held-out rollouts: %s", rollouts)
    return table


def warm_start_model(
    script: AgentScriptArguments,
    config: AgentGRPOConfig,
    rows: list[dict[str, Any]],
    model: str,
    load: dict[str, Any],
) -> str:
    """The warm-start checkpoint (``aitlrt.warmstart.recipe``) that RL starts from: fine-tuned on the oracle
    teacher's trajectories of ``rows`` (its share of the training tasks and ``warm_start_from``'s tasks; cached),
    or on the given trajectories file; the model loaded at ``load``'s revision and ``trust_remote_code`` (the
    policy's ``model_init_kwargs``)."""
    from aitlrt.tasks.task import task_from_row
    from aitlrt.warmstart.recipe import warm_start

    tasks = [task_from_row(row) for row in rows]
    flags = shlex.split(script.warm_start_args)
    return str(
        warm_start(
            script.warm_start,
            tasks,
            model,
            config.rollout_settings(),
            flags,
            revision=load.get("revision"),
            trust_remote_code=bool(load.get("trust_remote_code")),
        )
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()

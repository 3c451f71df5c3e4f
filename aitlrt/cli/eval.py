"""``aitlrt eval``: run agents on tasks without training and report resolve rate, similarity, non-empty patches,
calls and tokens, for one checkpoint or two side by side (``aitlrt.evaluation.checkpoints``). Writes the rollouts
as JSON lines and a static HTML report."""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path
from typing import Any

from aitlrt.cli.rollout import (
    add_rollout_arguments,
    prepared_tasks,
    print_outcomes,
    print_rewards,
    progress_printer,
    reward_weights,
    rollout_settings,
)

REWARDS = "tests_pass,patch_similarity,non_empty_patch"


def add_parser(verbs: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = verbs.add_parser("eval", help="evaluate one checkpoint, or compare two, on tasks (no training)")
    add_rollout_arguments(p)
    p.add_argument(
        "--config",
        default=None,
        help="a training config (YAML, as aitlrt/train.py takes): its agent, call limit, context window, rollout "
        "timeout and concurrency, sampling, serve args and rewards with their weights become the defaults here, so "
        "a checkpoint is measured as its run measured it; flags given here override them",
    )
    p.add_argument(
        "--checkpoint",
        default="bundled",
        help="weights folder (or 'bundled'; with --proxy: 'served'), or a trivial policy (trivial:no-edit, "
        "trivial:comment, trivial:whitespace, trivial:oracle: a scripted edit, one rollout per task)",
    )
    p.add_argument("--compare", default=None, help="a second weights folder or trivial policy, evaluated the same way")
    p.add_argument(
        "--proxy",
        default=None,
        help="a running aitlrt-serve, its admin key in $AITLRT_API_KEY (default: start one on --checkpoint)",
    )
    p.add_argument(
        "--rewards",
        default=REWARDS,
        help="built-in rewards to score with, NAME[=WEIGHT],...; with any weight given (the others count 1) also the "
        "weighted reward, as a run's reward_funcs and reward_weights score it, and its paired gain",
    )
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per model call (managed server)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (managed server)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's top_p (managed server)")
    p.add_argument("--top-k", type=int, default=-1, help="top_k sampling, -1 for none (managed server)")
    p.add_argument("--serve-args", default="--enforce-eager", help="extra aitlrt-serve/vLLM flags (managed server)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/eval"), help="rollouts and report.html go here")
    p.set_defaults(seed=0)  # seeded by default: with --compare the two checkpoints' rollouts pair up
    return p


def config_defaults(path: str) -> dict[str, Any]:
    """The settings of training config ``path`` that a run's held-out evaluation uses, by this command's argument
    names (the run's reward weights as ``--rewards NAME=WEIGHT``)."""
    from trl import ModelConfig, TrlParser

    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments, heldout_weights

    parser = TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig))  # type: ignore[arg-type]
    try:
        script, config, _ = parser.parse_args_and_config(["--config", path, "--output_dir", tempfile.gettempdir()])
    except (OSError, ValueError) as exc:
        raise SystemExit(f"aitlrt eval: --config {path}: {exc}") from None
    weights = heldout_weights(script, config)
    return {
        "agent": config.agent,
        "edit_format": config.edit_format,
        "aider_reminder": config.aider_reminder,
        "concurrency": config.rollout_concurrency,
        "timeout": config.rollout_timeout_s,
        "max_calls": config.rollout_max_calls,
        "context_window": config.context_window,
        "test_feedback_rounds": config.test_feedback_rounds,
        "test_feedback_max_chars": config.test_feedback_max_chars,
        "test_feedback_timeout": config.test_feedback_timeout_s,
        "fresh_workspaces": not config.recycle_workspaces,
        "max_tokens": config.max_completion_length,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k or -1,
        "serve_args": script.serve_args,
        "rewards": ",".join(f"{name}={weight:g}" for name, weight in zip(script.rewards, weights, strict=True)),
    }


def run(args: argparse.Namespace) -> None:
    from aitlrt.evaluation.checkpoints import evaluate, paired_gain, write_results
    from aitlrt.evaluation.scoring import paired, paired_difference, reward_funcs, same_patch_share, summarise

    checkpoints = [args.checkpoint] + ([args.compare] if args.compare else [])
    try:
        weights = reward_weights(args.rewards)
        funcs = reward_funcs(list(weights))
        settings = rollout_settings(args)
        prepared = prepared_tasks(args, "eval")
    except ValueError as exc:  # unknown reward or agent, bad --source, no usable task
        raise SystemExit(f"aitlrt eval: {exc}") from None
    results = evaluate(
        checkpoints,
        prepared,
        settings,
        funcs,
        proxy=args.proxy,
        serve_dir=args.out_dir / "serve",
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        serve_args=shlex.split(args.serve_args),
        on_progress=progress_printer(),
    )
    weighted = weights if "=" in args.rewards else None
    for result in results:
        result.summary = summarise(result.batch, result.rewards, weighted)
        print(f"\n== {result.label} ==")
        print_outcomes(result.batch.outcomes)
        print_rewards(result.batch.outcomes, result.rewards)
    rollouts, report = write_results(results, args.out_dir, weighted)
    print("\n" + f"{'metric':<22}" + "".join(f" {Path(r.label).name[:24]:>24}" for r in results))
    for key in results[0].summary:
        print(f"{key:<22}" + "".join(f" {r.summary[key]:>24.3f}" for r in results))
    if len(results) == 2 and paired(results[0].batch, results[1].batch):
        print(f"\npaired by seed ({len(results[0].batch.outcomes)} rollouts): --compare minus --checkpoint")
        tasks = [t.instance_id for t in results[0].batch.tasks]
        for name in results[0].rewards:
            gain, se = paired_difference(results[0].rewards[name], results[1].rewards[name], clusters=tasks)
            print(f"{name:<22} {gain:>+24.3f}  (std error {se:.3f})")
        if weighted and (pair := paired_gain(results[0], results[1], weighted)):
            print(f"{'reward (weighted)':<22} {pair.gain:>+24.3f}  (std error {pair.se:.3f})")
        print(f"{'same patch':<22} {same_patch_share(results[0].batch, results[1].batch):>24.3f}")
    print(f"[aitlrt] rollouts: {rollouts}; report: {report}")

"""``aitlrt eval``: run agents on tasks without training and report resolve rate, similarity, non-empty patches,
calls and tokens, for one checkpoint or two side by side (``aitlrt.evaluation.checkpoints``). Writes the rollouts
as JSON lines and a static HTML report."""

from __future__ import annotations

import argparse
import shlex
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

from aitlrt.cli.rollout import (
    prepared_tasks,
    print_outcomes,
    print_rewards,
    progress_printer,
    reward_weights,
    rollout_flags,
    rollout_settings,
)
from aitlrt.rollout.arguments import RolloutArguments

REWARDS = "tests_pass,patch_similarity,non_empty_patch"


def add_parser(verbs: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = verbs.add_parser(
        "eval",
        parents=[rollout_flags()],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="evaluate one checkpoint, or compare two, on tasks (no training)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a training config (YAML, as aitlrt/train.py takes): its rollout knobs, sampling, serve args and "
        "rewards with their held-out weights become the defaults here, so a checkpoint is measured as its run "
        "measured it; flags given here override them",
    )
    p.add_argument(
        "--checkpoint",
        default="bundled",
        help="weights folder (or 'bundled'; with --proxy: 'served'), or a trivial policy (trivial:no-edit, "
        "trivial:comment, trivial:whitespace, trivial:reject-file, trivial:no-op-code, trivial:oracle: a scripted "
        "edit, one rollout per task)",
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
    p.add_argument(
        "--training-rewards",
        "--training_rewards",
        default="",
        help="NAME=WEIGHT,... of a run's training reward (--config: its reward_weights): the table's "
        "training_reward, what GRPO would pay each checkpoint or trivial policy (those rewards are scored too)",
    )
    add_sampling_flags(p)
    p.add_argument("--top-p", "--top_p", type=float, default=1.0, help="nucleus sampling's top_p (managed server)")
    p.add_argument("--top-k", "--top_k", type=int, default=0, help="top_k sampling, 0 or -1: none (managed server)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/eval"), help="rollouts and report.html go here")
    p.set_defaults(seed=0)  # seeded by default: with --compare the two checkpoints' rollouts pair up
    return p


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """The managed server's sampling flags of ``eval`` and ``tasks probe``, under the training config's names (so
    that ``--config`` fills them by name)."""
    p.add_argument(
        "--max-completion-length",
        "--max_completion_length",
        "--max-tokens",
        type=int,
        default=512,
        help="tokens per model call (managed server)",
    )
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (managed server)")
    p.add_argument("--serve-args", "--serve_args", default="--enforce-eager", help="extra aitlrt-serve/vLLM flags")


CONFIG_FLAGS = (
    *(f.name for f in fields(RolloutArguments)),
    *("max_completion_length", "temperature", "top_p", "top_k", "serve_args"),
)
"""The flags of ``eval`` that ``--config`` sets from the training config's field of the same name."""


def config_defaults(path: str) -> dict[str, Any]:
    """The settings of training config ``path`` that a run's held-out evaluation uses, by field name: its rollout
    knobs, sampling and serve args, its rewards with the held-out weights as ``--rewards NAME=WEIGHT``, and with its
    ``reward_weights`` as ``--training-rewards``."""
    from trl import ModelConfig, TrlParser

    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments, heldout_weights, training_weights

    parser = TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig))  # type: ignore[arg-type]
    try:
        script, config, _ = parser.parse_args_and_config(["--config", path, "--output_dir", tempfile.gettempdir()])
    except (OSError, ValueError) as exc:
        raise SystemExit(f"aitlrt eval: --config {path}: {exc}") from None
    fields_ = {**vars(script), **vars(config)}

    def spec(weights: list[float]) -> str:
        return ",".join(f"{name}={weight:g}" for name, weight in zip(script.rewards, weights, strict=True))

    return {
        **{name: fields_[name] for name in CONFIG_FLAGS},
        "rewards": spec(heldout_weights(script, config)),
        "training_rewards": spec(training_weights(script, config)),
    }


def run(args: argparse.Namespace) -> None:
    from aitlrt.evaluation.checkpoints import evaluate, paired_gain, write_results
    from aitlrt.evaluation.scoring import paired, paired_difference, reward_funcs, same_patch_share, summarise

    checkpoints = [args.checkpoint] + ([args.compare] if args.compare else [])
    try:
        weights = reward_weights(args.rewards)
        training = reward_weights(args.training_rewards) or None
        funcs = reward_funcs(list(dict.fromkeys([*weights, *(training or {})])))
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
        max_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k or -1,
        serve_args=shlex.split(args.serve_args),
        on_progress=progress_printer(),
    )
    weighted = weights if "=" in args.rewards else None
    for result in results:
        result.summary = summarise(result.batch, result.rewards, weighted, training)
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

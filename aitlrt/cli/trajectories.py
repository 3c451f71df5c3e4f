"""``aitlrt trajectories``: successful rollouts of the real agent with a teacher answering (the oracle, or any
OpenAI-compatible server), as trl conversational prompt-completion rows for ``aitlrt sft``
(``aitlrt.warmstart.trajectories``). With the oracle and ``--test-feedback-rounds`` > 0, each Aider task also gets
multi-turn rollouts (decoy first, then the fix once the tests' output came back); with ``--agent mini-swe-agent``
the oracle answers in shell commands (inspect, patch, submit), every call a row."""

from __future__ import annotations

import argparse
from pathlib import Path

from aitlrt.cli.rollout import prepared_tasks, print_outcomes, progress_printer, rollout_flags, rollout_settings
from aitlrt.warmstart.trajectories import DEFAULT_REWARDS, ORACLE, collect, oracle_format, reward_funcs, teacher_from


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser(
        "trajectories",
        parents=[rollout_flags()],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="record an agent's successful rollouts with a teacher model (oracle or URL) for SFT",
    )
    p.add_argument(
        "--teacher",
        required=True,
        help=f"'{ORACLE}' (writes each task's oracle fix in the agent's edit format; for mini-swe-agent's text mode, "
        "shell commands: inspect, patch, submit) or an OpenAI-compatible "
        "server's root URL (e.g. http://host:8000; a trailing /v1 is dropped)",
    )
    p.add_argument(
        "--teacher-model", "--teacher_model", default=None, help="model to ask the URL for (default: its first)"
    )
    p.add_argument(
        "--teacher-api-key-env",
        "--teacher_api_key_env",
        default=None,
        metavar="VAR",
        help="env var with the URL's API key",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="with the oracle: the policy's tokenizer (path, Hub id or 'bundled', the default) for the token ids it "
        "records in the proxy's journal",
    )
    p.add_argument("--rewards", default=",".join(DEFAULT_REWARDS), help="comma-separated built-in rewards")
    p.add_argument(
        "--reward-weights",
        "--reward_weights",
        default=None,
        help="comma-separated weights, one per reward (default: tests_pass 1.0, patch_similarity 0.5, others 1.0)",
    )
    p.add_argument(
        "--min-reward",
        "--min_reward",
        type=float,
        default=None,
        help="keep rollouts whose weighted reward is at least this (default: 1.5 with the oracle, resolved with its "
        "own patch; 1.0 with a URL, resolved)",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="JSON lines, one per policy call of each kept rollout (of a multi-turn oracle rollout, only the calls "
        "that answer the tests' output: the decoy is not trained on)",
    )
    p.add_argument(
        "--serve-dir",
        type=Path,
        default=Path("runs/trajectories/serve"),
        help="aitlrt-serve's journal and log (of the multi-turn rollouts: in its folder multi-turn)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        names = [name for name in args.rewards.split(",") if name]
        funcs = reward_funcs(names)
        if args.reward_weights:
            weights = [float(w) for w in args.reward_weights.split(",")]
        else:
            weights = [DEFAULT_REWARDS.get(name, 1.0) for name in names]
        if len(weights) != len(names):
            raise ValueError(f"{len(weights)} --reward-weights for {len(names)} --rewards")
        teacher = teacher_from(args.teacher, args.teacher_model, args.teacher_api_key_env, args.tokenizer)
        settings = rollout_settings(args)
        if teacher.url is None:
            oracle_format(settings)  # an agent the oracle cannot answer
        prepared = prepared_tasks(args, "trajectories")
    except ValueError as exc:  # unknown reward or agent, bad weights or teacher, no usable task
        raise SystemExit(f"aitlrt trajectories: {exc}") from None
    min_reward = teacher.default_min_reward if args.min_reward is None else args.min_reward
    report = collect(
        [p.task for p in prepared],
        teacher,
        settings,
        funcs,
        weights,
        min_reward,
        args.out,
        serve_dir=args.serve_dir,
        on_progress=progress_printer(),
    )
    print_outcomes(report.outcomes)
    print(f"\n{'rollout':<40} {'turns':<20} {'weighted reward':>15}  kept")
    for o, m, r, k in zip(report.outcomes, report.multi_turn, report.weighted, report.kept, strict=True):
        turns = "multi (decoy first)" if m else "single"
        print(f"{o.rollout_id[:40]:<40} {turns:<20} {r:>15.3f}  {'yes' if k else 'no'}")
    print("\nkept per task:")
    for task_id, (kept, run) in report.kept_per_task().items():
        print(f"  {task_id}: {kept}/{run}")
    print(
        f"[aitlrt] teacher {teacher.label}: {len(report.outcomes)} rollouts, {sum(report.kept)} kept "
        f"(weighted reward >= {min_reward:g}), {report.calls_written} calls written to {report.out} "
        f"in {report.seconds:.0f}s"
    )
    return 0 if report.calls_written else 1

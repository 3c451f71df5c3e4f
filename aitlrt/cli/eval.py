"""``aitlrt eval``: run agents on tasks without training and report resolve rate, similarity, non-empty patches,
calls and tokens, for one checkpoint or two side by side (the second is loaded into the same server with
``POST /weights/reload``, so both see the same tasks, agent and sampling). Writes the rollouts as JSON lines and a
static HTML report."""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from pathlib import Path

import httpx

from aitlrt.cli.rollout import add_rollout_arguments
from aitlrt.cli.rollout import run as run_rollouts
from aitlrt.report.html import write_report

REWARDS = "tests_pass,patch_similarity,non_empty_patch"


def add_parser(verbs) -> None:
    p = verbs.add_parser("eval", help="evaluate one checkpoint, or compare two, on tasks (no training)")
    add_rollout_arguments(p)
    p.add_argument("--checkpoint", default="bundled", help="weights folder (or 'bundled'); with --proxy: 'served'")
    p.add_argument("--compare", default=None, help="a second weights folder, evaluated the same way")
    p.add_argument("--proxy", default=None, help="a running aitlrt-serve (default: start one on --checkpoint)")
    p.add_argument("--rewards", default=REWARDS, help="built-in rewards to score with")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per model call (managed server)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (managed server)")
    p.add_argument("--serve-args", default="--enforce-eager", help="extra aitlrt-serve/vLLM flags (managed server)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/eval"), help="rollouts and report.html go here")


def summarise(outcomes, rewards: dict[str, list[float]]) -> dict[str, float]:
    out = {name: statistics.fmean(values) for name, values in rewards.items()}
    out["calls"] = statistics.fmean(o.calls for o in outcomes)
    out["completion_tokens"] = statistics.fmean(o.completion_tokens for o in outcomes)
    out["status_ok"] = statistics.fmean(o.status == "ok" for o in outcomes)
    return out


def run(args) -> int:
    from aitlrt.common.model import resolve_model

    checkpoints = [args.checkpoint] + ([args.compare] if args.compare else [])
    serve = None
    if args.proxy is None:
        from aitlrt.common.procs import free_port
        from aitlrt.serving.process import ServeProcess

        run_dir = args.out_dir / "serve"
        flags = [
            "--model",
            resolve_model(args.checkpoint),
            "--run-dir",
            str(run_dir),
            "--max-tokens",
            str(args.max_tokens),
            "--temperature",
            str(args.temperature),
            *shlex.split(args.serve_args),
        ]
        serve = ServeProcess(flags, port=free_port(), log_path=run_dir / "serve.log")
        print(f"[aitlrt] starting aitlrt-serve + vLLM on {args.checkpoint}; log {serve.log_path}", flush=True)
        serve.start()
        serve.wait_ready(progress=True)
    proxy = args.proxy or serve.url
    summaries, records = {}, []
    try:
        for label in checkpoints:
            if label != checkpoints[0] or (args.proxy and label != "served"):
                path = resolve_model(label)
                print(f"[aitlrt] loading {path} into the server", flush=True)
                httpx.post(f"{proxy}/weights/reload", json={"path": str(path)}, timeout=600).raise_for_status()
            rollout_args = argparse.Namespace(**vars(args), model=None, out=None)
            rollout_args.proxy = proxy
            outcomes, rewards, tasks = run_rollouts(rollout_args)
            summaries[label] = summarise(outcomes, rewards)
            for i, (outcome, task) in enumerate(zip(outcomes, tasks, strict=True)):
                last = outcome.trace[-1] if outcome.trace else {}
                conversation = list((last.get("request") or {}).get("messages") or [])
                conversation += [last["message"]] if last.get("message") else []
                records.append(
                    {
                        **outcome.summary(),
                        "checkpoint": label,
                        "instance_id": task.instance_id,
                        "step": checkpoints.index(label),
                        "conversation": conversation,
                        "rewards": {name: values[i] for name, values in rewards.items()},
                    }
                )
    finally:
        if serve is not None:
            serve.stop()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / "rollouts.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    report = write_report(records, args.out_dir / "report.html", f"aitlrt eval: {' vs '.join(checkpoints)}")
    keys = list(next(iter(summaries.values())))
    print("\n" + f"{'metric':<22}" + "".join(f" {Path(c).name[:24]:>24}" for c in checkpoints))
    for key in keys:
        print(f"{key:<22}" + "".join(f" {summaries[c][key]:>24.3f}" for c in checkpoints))
    print(f"[aitlrt] rollouts: {args.out_dir / 'rollouts.jsonl'}; report: {report}")
    return 0

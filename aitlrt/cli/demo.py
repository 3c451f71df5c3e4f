"""``aitlrt demo``: the quick start (``aitlrt.serving.demo``), printed as the agent saw it and as the proxy
recorded it."""

from __future__ import annotations

import argparse
from pathlib import Path

from aitlrt.serving.demo import PROMPT, run_demo


def add_parser(verbs: argparse._SubParsersAction) -> None:
    p = verbs.add_parser("demo", help="serve the bundled model via aitlrt-serve, send a request, show the trace")
    p.add_argument("--run-dir", type=Path, default=Path("runs/demo"))
    p.add_argument("--max-tokens", type=int, default=96)


def run(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    run_dir = args.run_dir
    result = run_demo(run_dir, args.max_tokens)
    trace = result.trace
    call = trace["calls"][0]
    tok = AutoTokenizer.from_pretrained(result.model)
    print(f"\n== the agent's view: POST {result.base_url}/chat/completions ({result.latency_s:.1f}s) ==")
    print(f"user: {PROMPT}\nassistant: {result.reply}\n")
    print(f"== what aitlrt-serve recorded for rollout {result.rollout} ==")
    print(
        f"calls: {len(trace['calls'])}  weight_version: {call['weight_version']}  "
        f"finish_reason: {call['finish_reason']}"
    )
    print(
        f"forced sampling: temperature={call['request'].get('temperature')} (agent asked 0), "
        f"top_p={call['request'].get('top_p')}, max_tokens={call['request'].get('max_tokens')}"
    )
    print(
        f"prompt tokens: {len(call['prompt_token_ids'])}  sampled tokens: {len(call['completion_token_ids'])}  "
        f"logprobs: {len(call['logprobs'])}"
    )
    print(f"{'#':>3}  {'token id':>8}  {'logprob':>8}  token")
    for i, (tid, lp) in enumerate(zip(call["completion_token_ids"][:12], call["logprobs"][:12], strict=False)):
        print(f"{i:>3}  {tid:>8}  {lp:>8.3f}  {tok.decode([tid])!r}")
    decoded = tok.decode(call["completion_token_ids"], skip_special_tokens=True)
    print(f"decoded sampled ids == text the agent received: {decoded == result.reply}")
    print(f"journal: {run_dir / 'calls.jsonl'}")

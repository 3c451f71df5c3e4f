"""``aitlrt demo``: the quick start. Serve the bundled model behind ``aitlrt-serve``, send one real chat
request as a rollout, and show what the proxy recorded (token ids, sampler logprobs, weight version)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from aitlrt.common.model import prepare_bundled_model
from aitlrt.common.procs import free_port
from aitlrt.serving.process import ServeProcess

PROMPT = "Write a Python function `add(a, b)` that returns the sum of a and b."


def run_demo(run_dir: Path, max_tokens: int = 96) -> dict:
    model = prepare_bundled_model()
    port = free_port()
    serve = ServeProcess(
        ["--model", str(model), "--run-dir", str(run_dir), "--max-tokens", str(max_tokens), "--enforce-eager"],
        port=port,
        log_path=run_dir / "serve.log",
    )
    print(f"[aitlrt] starting aitlrt-serve + vLLM (CPU) with {model.name}; log: {serve.log_path}", flush=True)
    serve.start()
    try:
        took = serve.wait_ready(progress=True)
        print(f"[aitlrt] ready in {took:.0f}s at {serve.url}", flush=True)
        rollout = f"demo-{int(time.time())}"
        base = f"{serve.url}/rollouts/{rollout}/v1"
        t0 = time.perf_counter()
        reply = (
            httpx.post(
                f"{base}/chat/completions",
                timeout=300,
                json={
                    "model": "any",
                    "messages": [{"role": "user", "content": PROMPT}],
                    "temperature": 0,
                },
            )
            .raise_for_status()
            .json()
        )
        latency = time.perf_counter() - t0
        trace = httpx.get(f"{serve.url}/rollouts/{rollout}", timeout=30).raise_for_status().json()
    finally:
        serve.stop()
    _show(rollout, base, reply, trace, latency, run_dir)
    return trace


def _show(rollout: str, base: str, reply: dict, trace: dict, latency: float, run_dir: Path) -> None:
    from transformers import AutoTokenizer

    call = trace["calls"][0]
    tok = AutoTokenizer.from_pretrained(prepare_bundled_model())
    content = reply["choices"][0]["message"]["content"]
    print(f"\n== the agent's view: POST {base}/chat/completions ({latency:.1f}s) ==")
    print(f"user: {PROMPT}\nassistant: {content}\n")
    print(f"== what aitlrt-serve recorded for rollout {rollout} ==")
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
    print(f"decoded sampled ids == text the agent received: {decoded == content}")
    print(f"journal: {run_dir / 'calls.jsonl'}")

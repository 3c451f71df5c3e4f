"""The quick start (``aitlrt demo``): serve the bundled model behind ``aitlrt-serve``, send one real chat request as
a rollout, and fetch what the proxy recorded for it (token ids, sampler logprobs, weight version)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from aitlrt.common.model import prepare_bundled_model
from aitlrt.serving.process import managed_server

PROMPT = "Write a Python function `add(a, b)` that returns the sum of a and b."


@dataclass(frozen=True)
class DemoResult:
    model: Path
    """The bundled model's folder (its tokenizer decodes the recorded ids)."""
    rollout: str
    base_url: str
    """The rollout's OpenAI base URL, as an agent would be given it."""
    reply: str
    """The assistant's text, as the agent received it."""
    latency_s: float
    trace: dict[str, Any]
    """The proxy's record of the rollout (``GET /rollouts/<id>``)."""


def run_demo(run_dir: Path, max_tokens: int = 96) -> DemoResult:
    """Serve the bundled model (journal in ``run_dir``), ask it ``PROMPT`` at temperature 0 (the proxy forces its
    own sampling), and return the reply with the proxy's trace; the server is stopped before returning."""
    model = prepare_bundled_model()
    with managed_server(model, run_dir, max_tokens=max_tokens, extra_args=["--enforce-eager"]) as serve:
        rollout = f"demo-{int(time.time())}"
        base = f"{serve.url}/rollouts/{rollout}/v1"
        body = {"model": "any", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0}
        t0 = time.perf_counter()
        headers = serve.rollout_headers(rollout)  # the rollout's own token, as an agent has it
        reply = httpx.post(f"{base}/chat/completions", headers=headers, timeout=300, json=body).raise_for_status()
        latency = time.perf_counter() - t0
        trace = httpx.get(f"{serve.url}/rollouts/{rollout}", headers=serve.headers, timeout=30).raise_for_status()
    return DemoResult(model, rollout, base, reply.json()["choices"][0]["message"]["content"], latency, trace.json())

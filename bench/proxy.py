"""Benchmark of aitlrt-serve: direct-to-vLLM vs through the proxy, side by side in one run.

1. Real vLLM CPU server with the bundled model, keys on as in a run (vLLM takes its key; the proxy arm sends a
   rollout's token): tokens/s and p50/p99 latency at concurrency 1, 8, 32,
   direct, through the proxy, and direct with the extras the proxy asks for (token ids, logprobs), in rounds of
   one wave of requests per arm (60, 24 and 12 rounds), the order rotating between rounds (this machine is noisy;
   ratios are medians over rounds of the arms' throughput in the same round).
2. Null upstream (the scripted, instant vLLM-shaped server): the proxy's own cost, requests/s and the
   added p50/p99 milliseconds per call; and the proxy's memory (RSS) after MEMORY_CALLS one-call rollouts of an
   agent-sized prompt, their records kept vs each rollout deleted once read (as AITLRT's rollout runner does).

Run: ``python bench/proxy.py`` (no arguments; ``--quick`` for a short smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import mkdtemp

import httpx

from aitlrt.common import keys
from aitlrt.common.model import prepare_bundled_model
from aitlrt.common.procs import free_port, wait_http
from aitlrt.serving.process import ServeProcess
from aitlrt_server.upstream import VLLMServer

MAX_TOKENS = 16
VLLM_KEY_ENV = "AITLRT_BENCH_VLLM_KEY"
MEMORY_CALLS = 1000
MEMORY_PROMPT_TOKENS = 2300
"""An Aider request of the CPU recipe: ~2,300 prompt tokens."""


Arm = tuple[str, dict, dict[str, str]]
"""An arm of a comparison: URL, body, headers (the key each side takes)."""


async def _round(arm: Arm, concurrency: int, requests: int) -> tuple[float, list[float], int]:
    """Send ``requests`` calls, ``concurrency`` at a time; return (wall s, latencies s, completion tokens)."""
    url, body, headers = arm
    latencies: list[float] = []
    tokens = 0
    queue = list(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:

        async def worker() -> None:
            nonlocal tokens
            while queue:
                queue.pop()
                t0 = time.perf_counter()
                resp = await client.post(url, json=body)
                latencies.append(time.perf_counter() - t0)
                resp.raise_for_status()
                tokens += resp.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies, tokens


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def compare(arms: dict[str, Arm], concurrency: int, requests: int, rounds: int) -> dict:
    """Run every arm (name -> (url, body, headers)) once per round, the order rotating and reversing from round to round
    so that a drift of the machine favours none. Per arm: median per-round throughput, pooled latency
    percentiles, and ``ratio``: the median over rounds of its throughput / the first arm's in the same round."""
    names = list(arms)
    stats = {name: {"tps": [], "rps": [], "lat": []} for name in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order if r % 2 == 0 else order[::-1]:
            wall, lat, tokens = asyncio.run(_round(arms[name], concurrency, requests))
            stats[name]["tps"].append(tokens / wall)
            stats[name]["rps"].append(requests / wall)
            stats[name]["lat"].extend(lat)
    base = stats[names[0]]["tps"]
    return {
        name: {
            "tps": statistics.median(s["tps"]),
            "rps": statistics.median(s["rps"]),
            "p50": _pct(s["lat"], 50) * 1e3,
            "p99": _pct(s["lat"], 99) * 1e3,
            "ratio": statistics.median(t / b for t, b in zip(s["tps"], base, strict=True)),
        }
        for name, s in stats.items()
    }


def rss_mib(pid: int) -> float:
    """Resident memory of process ``pid`` in MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def proxy_memory(upstream: str, work: Path, calls: int) -> dict[str, float]:
    """A fresh proxy's RSS growth over ``calls`` one-call rollouts (token-id prompts of ``MEMORY_PROMPT_TOKENS``),
    each rollout's trace read and then kept (``kept``) or deleted (``released``)."""
    body = {"model": "m", "prompt": list(range(1000, 1000 + MEMORY_PROMPT_TOKENS)), "max_tokens": MAX_TOKENS}
    growth = {}
    for arm in ("kept", "released"):
        print(f"[bench] proxy memory: {calls} rollouts, {arm}", flush=True)
        args = ["--upstream", upstream, "--max-tokens", str(MAX_TOKENS), "--run-dir", str(work / f"memory-{arm}")]
        with (
            ServeProcess(args, port=free_port(), log_path=work / f"proxy-{arm}.log") as px,
            httpx.Client(base_url=px.url, headers=px.headers, timeout=60) as client,
        ):
            assert px.proc is not None  # started by ``with``
            client.post("/rollouts/warm/v1/completions", json=body).raise_for_status()
            before = rss_mib(px.proc.pid)
            for i in range(calls):
                rollout = f"/rollouts/mem-{i}/v1/completions"
                client.post(rollout, json=body, headers=px.rollout_headers(f"mem-{i}")).raise_for_status()
                client.get(f"/rollouts/mem-{i}").raise_for_status()
                if arm == "released":
                    client.delete(f"/rollouts/mem-{i}").raise_for_status()
            growth[arm] = rss_mib(px.proc.pid) - before
    return growth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run, not for the table)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the `finally`s that stop the servers
    work = Path(mkdtemp(prefix="aitlrt-bench-proxy-"))
    messages = [{"role": "user", "content": "Write a Python function that reverses a linked list."}]
    model = prepare_bundled_model()
    body = {
        "model": model.name,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
    }
    proxy_args = ["--max-tokens", str(MAX_TOKENS), "--run-dir", str(work / "journal")]
    rows = []

    # Keys on, as in a run: vLLM takes its key (both arms pay for its check), the proxy its admin key and each
    # rollout's token (the proxy arm sends the rollout's token).
    admin_key = keys.new_key()
    vllm_key = keys.vllm_key(admin_key)
    vllm = VLLMServer(
        str(model),
        served_model_name=model.name,
        extra_args=["--enforce-eager"],
        log_path=work / "vllm.log",
        api_key=vllm_key,
    )
    print(f"[bench] starting vLLM CPU with {model.name} (log {vllm.log_path})", flush=True)
    vllm.start()
    try:
        vllm.wait_healthy()
        os.environ[VLLM_KEY_ENV] = vllm_key  # read by the proxy (--upstream-api-key-env), not on a command line
        upstream_args = ["--upstream", vllm.url, "--upstream-api-key-env", VLLM_KEY_ENV]
        with ServeProcess(
            [*upstream_args, *proxy_args], port=free_port(), log_path=work / "proxy.log", api_key=admin_key
        ) as px:
            direct, proxied = f"{vllm.url}/v1/chat/completions", f"{px.url}/rollouts/bench/v1/chat/completions"
            to_vllm, to_proxy = keys.bearer(vllm_key), px.rollout_headers("bench")
            # The third arm asks vLLM directly for what the proxy adds (token ids, logprobs): vLLM's share of the gap.
            arms = {
                "direct": (direct, body, to_vllm),
                "proxy": (proxied, body, to_proxy),
                "extras": (direct, {**body, "logprobs": True, "return_token_ids": True}, to_vllm),
            }
            for arm in arms.values():  # warm-up
                asyncio.run(_round(arm, 4, 8))
            # One wave of `conc` requests per round, many short rounds: a drift of the machine favours no arm.
            for conc, rounds in ((1, 2), (8, 2), (32, 2)) if args.quick else ((1, 60), (8, 24), (32, 12)):
                print(f"[bench] vLLM concurrency {conc}: {rounds} rounds x {conc} requests per arm", flush=True)
                rows.append(("vLLM CPU", conc, compare(arms, conc, conc, rounds)))
    finally:
        vllm.stop()

    port = free_port()
    null = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.scripted_upstream", "--port", str(port)], stdin=subprocess.DEVNULL
    )
    try:
        null_url = f"http://127.0.0.1:{port}"
        wait_http(f"{null_url}/health", null)
        with ServeProcess(
            ["--upstream", null_url, *proxy_args], port=free_port(), log_path=work / "proxy-null.log"
        ) as px:
            direct, proxied = f"{null_url}/v1/chat/completions", f"{px.url}/rollouts/bench/v1/chat/completions"
            null_arms: dict[str, Arm] = {
                "direct": (direct, body, {}),
                "proxy": (proxied, body, px.rollout_headers("bench")),
            }
            asyncio.run(_round(null_arms["proxy"], 4, 50))  # warm-up
            rounds = 2 if args.quick else 4
            for conc, requests in ((1, 100 if args.quick else 300), (32, 320 if args.quick else 960)):
                print(f"[bench] null upstream concurrency {conc}", flush=True)
                rows.append(("null", conc, compare(null_arms, conc, requests, rounds)))
        memory_calls = 100 if args.quick else MEMORY_CALLS
        memory = proxy_memory(null_url, work, memory_calls)
    finally:
        null.terminate()
        null.wait(10)

    print(
        f"\n| proxy memory after {memory_calls} one-call rollouts of {MEMORY_PROMPT_TOKENS} prompt tokens | "
        "RSS growth MiB |\n|---|---|"
    )
    for arm, mib in memory.items():
        print(f"| {arm} | {mib:.0f} |")
    print(
        "\n| upstream | conc | direct tok/s | proxy tok/s | proxy / direct | direct + extras / direct | "
        "direct p50 ms | proxy p50 ms | direct p99 ms | proxy p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for upstream, conc, r in rows:
        d, p = r["direct"], r["proxy"]
        extras = f"{r['extras']['ratio']:.3f}" if "extras" in r else ""
        print(
            f"| {upstream} | {conc} | {d['tps']:.0f} | {p['tps']:.0f} | {p['ratio']:.3f} | {extras} | "
            f"{d['p50']:.1f} | {p['p50']:.1f} | {d['p99']:.1f} | {p['p99']:.1f} |"
        )
    print()
    for upstream, conc, r in rows:
        if upstream == "vLLM CPU":
            ratio = r["proxy"]["ratio"]
            print(f"TARGET throughput_ratio_c{conc} {ratio:.3f} 0.97 {'PASS' if ratio >= 0.97 else 'MISS'}")
    null1 = next(r for u, c, r in rows if u == "null" and c == 1)
    added = null1["proxy"]["p50"] - null1["direct"]["p50"]
    print(f"TARGET added_p50_ms {added:.2f} 2.0 {'PASS' if added <= 2.0 else 'MISS'}")


if __name__ == "__main__":
    from results import recorded  # bench/results.py: this run's row in bench/results.jsonl

    recorded("proxy", main)

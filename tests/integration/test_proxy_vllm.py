"""The proxy against the real vLLM CPU server with the bundled model."""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from aitlrt_server.upstream import SMALL_MACHINE_CPUS
from tests.conftest import admin, chat, token, trace


def test_recorded_tokens_decode_to_what_the_agent_received(served, tokenizer):
    resp = chat(served.url, "decode-1", "Write a haiku about git.", temperature=0, max_tokens=5)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    content = data["choices"][0]["message"]["content"]
    assert "prompt_token_ids" not in data and "token_ids" not in data["choices"][0]
    assert "logprobs" not in data["choices"][0], "the agent did not ask for logprobs"

    (call,) = trace(served.url, "decode-1")
    version = httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()["weight_version"]
    assert call["status"] == 200 and call["weight_version"] == version and call["call_index"] == 0
    ids = call["completion_token_ids"]
    assert ids and tokenizer.decode(ids, skip_special_tokens=True) == content == call["text"]
    assert len(call["logprobs"]) == len(ids)
    assert all(lp <= 0.0 for lp in call["logprobs"])
    expected_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about git."}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(expected_prompt, "input_ids"):
        expected_prompt = expected_prompt["input_ids"]
    assert call["prompt_token_ids"] == list(expected_prompt)
    assert call["usage"]["completion_tokens"] == len(ids)


def test_a_seeded_rollout_samples_the_same_tokens_again(served):
    """A rollout opened with a seed: vLLM samples each call from a seed of its own (the rollout's and the call's
    index), so the same seed samples the very same tokens again; another seed does not. (One request at a time: on
    CPU, other requests in vLLM's batch can change the logits' last bits, and so a near-tie's sample.)"""

    def rollout(rollout_id: str, seed: int) -> list[list[int]]:
        httpx.put(
            f"{served.url}/rollouts/{rollout_id}", headers=admin(served.url), json={"seed": seed}
        ).raise_for_status()
        for _ in range(2):
            assert chat(served.url, rollout_id, "Tell me a story about a git merge.").status_code == 200
        return [call["completion_token_ids"] for call in trace(served.url, rollout_id)]

    first = rollout("seeded-a", 11)
    assert chat(served.url, "unseeded", "Count to twenty.").status_code == 200  # vLLM's own generator moves on
    again = rollout("seeded-b", 11)
    other = rollout("seeded-c", 12)
    assert again == first
    assert first[0] != first[1], "the second call of the rollout has a seed of its own"
    assert other[0] != first[0]


def test_a_seeded_request_with_a_long_prompt_is_answered(served, tokenizer):
    """An agent's own ``seed`` on a prompt longer than one prefill chunk (vLLM CPU's default is 2,048 tokens) used
    to kill vLLM CPU's engine; aitlrt-serve starts it without chunked prefill."""
    code = "\n".join(f"def f{i}(x):\n    return x + {i}" for i in range(200))
    prompt = f"Here is some code:\n{code}\nWhat does f7 do?"
    assert len(tokenizer(prompt)["input_ids"]) > 2048
    resp = chat(served.url, "seeded-long", prompt, seed=5, max_tokens=4)
    assert resp.status_code == 200, resp.text
    assert httpx.get(f"{served.url}/health").status_code == 200


def wait_for_log_line(path, needle: str, timeout_s: float = 30.0) -> str:
    """The first line of ``path`` containing ``needle`` (vLLM writes its log asynchronously: poll for it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = next((x for x in path.read_text().splitlines() if needle in x), None)
        if found is not None or time.monotonic() > deadline:
            assert found is not None, f"{needle!r} not in {path} after {timeout_s:.0f} s"
            return found
        time.sleep(0.2)


def test_forced_sampling_params_are_what_vllm_saw(served):
    resp = chat(
        served.url, "forced-1", "Say yes.", temperature=0.0, top_p=0.1, max_tokens=3, top_k=5, presence_penalty=1.5
    )
    assert resp.status_code == 200, resp.text
    (call,) = trace(served.url, "forced-1")
    req = call["request"]
    # the run's sampling; the agent's max_tokens under the run's cap of 48
    assert (req["temperature"], req["top_p"], req["top_k"], req["max_tokens"]) == (1.0, 0.95, -1, 3)
    assert "presence_penalty" not in req
    # vLLM logs the SamplingParams it built for this very request id (--enable-log-requests).
    line = wait_for_log_line(served.vllm_log, f"Received request {call['response_id']}")
    params = re.search(r"SamplingParams\((.*?)\), lora_request", line).group(1)
    assert "temperature=1.0" in params and "top_p=0.95" in params and "max_tokens=3" in params
    assert "presence_penalty=0.0" in params
    assert re.search(r"top_k=(0|-1)\b", params), params


def test_streaming_and_non_streaming_give_equal_records(served, tokenizer):
    body = {"seed": 1234, "max_tokens": 12}
    plain = chat(served.url, "stream-a", "List three colours.", **body)
    assert plain.status_code == 200, plain.text
    with httpx.stream(
        "POST",
        f"{served.url}/rollouts/stream-b/v1/chat/completions",
        headers=token(served.url, "stream-b"),
        timeout=300,
        json={
            "model": "x",
            "messages": [{"role": "user", "content": "List three colours."}],
            "stream": True,
            **body,
        },
    ) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("token_ids" not in c for ch in chunks for c in ch["choices"])
    assert all("prompt_token_ids" not in ch for ch in chunks)
    assert all(ch["choices"] for ch in chunks), "usage-only chunk leaked though the agent did not ask"
    streamed_text = "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])

    (a,) = trace(served.url, "stream-a")
    (b,) = trace(served.url, "stream-b")
    for key in ("prompt_token_ids", "completion_token_ids", "logprobs", "text", "finish_reason", "weight_version"):
        assert a[key] == b[key], key
    assert b["text"] == streamed_text == plain.json()["choices"][0]["message"]["content"]
    assert b["request"]["stream"] is True and b["status"] == 200
    assert tokenizer.decode(b["completion_token_ids"], skip_special_tokens=True) == streamed_text


def test_32_concurrent_requests_over_8_rollouts_do_not_cross(served, tokenizer):
    jobs = [(f"conc-{r}", f"Repeat the word marker{r}x{k}.") for r in range(8) for k in range(4)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda job: chat(served.url, job[0], job[1], max_tokens=4), jobs))
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    listing = httpx.get(f"{served.url}/rollouts", headers=admin(served.url)).json()["rollouts"]
    for r in range(8):
        calls = trace(served.url, f"conc-{r}")
        assert listing[f"conc-{r}"] == 4
        assert sorted(c["call_index"] for c in calls) == [0, 1, 2, 3]
        prompts = [tokenizer.decode(c["prompt_token_ids"]) for c in calls]
        for c, prompt in zip(calls, prompts, strict=True):
            marker = re.search(r"marker(\d+)x(\d+)", c["request"]["messages"][0]["content"])
            assert marker.group(1) == str(r)
            assert marker.group(0) in prompt, "prompt tokens belong to another call"
            assert c["rollout_id"] == f"conc-{r}"
            assert len(c["logprobs"]) == len(c["completion_token_ids"]) > 0
        assert sorted(re.search(r"x(\d+)", p).group(1) for p in prompts) == ["0", "1", "2", "3"]


def test_completions_route_with_token_id_prompt(served, tokenizer):
    prompt_ids = tokenizer("def add(a, b):")["input_ids"]
    resp = httpx.post(
        f"{served.url}/rollouts/compl-1/v1/completions",
        headers=token(served.url, "compl-1"),
        timeout=120,
        json={"model": "x", "prompt": prompt_ids, "max_tokens": 6},
    )
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert "token_ids" not in choice and "logprobs" not in choice and "prompt_token_ids" not in choice
    (call,) = trace(served.url, "compl-1")
    assert call["endpoint"] == "completions"
    assert call["prompt_token_ids"] == prompt_ids
    # vLLM's text leaves out a sampled end-of-sequence token; the recorded ids keep it
    assert tokenizer.decode(call["completion_token_ids"], skip_special_tokens=True) == choice["text"] == call["text"]
    assert len(call["logprobs"]) == len(call["completion_token_ids"])


def test_agent_requested_logprobs_are_kept(served):
    resp = chat(served.url, "lp-1", "Hi", logprobs=True, max_tokens=3)
    assert resp.status_code == 200
    content = resp.json()["choices"][0]["logprobs"]["content"]
    (call,) = trace(served.url, "lp-1")
    assert [t["logprob"] for t in content] == call["logprobs"]


def test_bearer_key_names_the_rollout_on_plain_v1_routes(served):
    body = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    keyed = {"Authorization": f"Bearer keyed-rollout-7:{token(served.url, 'keyed-rollout-7')['Authorization'][7:]}"}
    resp = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120, headers=keyed)
    assert resp.status_code == 200, resp.text
    assert len(trace(served.url, "keyed-rollout-7")) == 1
    assert httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120).status_code == 401
    resp = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120, headers=admin(served.url))
    assert resp.status_code == 200
    assert len(trace(served.url, "_unattributed")) >= 1
    models = httpx.get(f"{served.url}/rollouts/any/v1/models", headers=token(served.url, "any")).json()
    assert models["data"][0]["id"] == served.model_dir.name


def test_vllm_takes_only_its_key_and_no_command_line_shows_a_key(served):
    assert httpx.get(f"{served.vllm_url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{served.vllm_url}/v1/models", headers=served.vllm_headers, timeout=30).status_code == 200
    admin_key = admin(served.url)["Authorization"][7:]
    vllm_key = served.vllm_headers["Authorization"][7:]
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # not a process, or one that has gone
            continue
        assert admin_key not in cmdline and vllm_key not in cmdline, f"a key on {proc.name}'s command line"


def test_bad_input_gets_openai_style_4xx(served):
    url = served.url
    mine = token(url, "bad-1")
    cases = [
        (
            httpx.post(
                f"{url}/rollouts/bad-1/v1/chat/completions",
                content=b"{not json",
                headers={"content-type": "application/json", **mine},
            ),
            400,
            "invalid_json",
        ),
        (httpx.post(f"{url}/rollouts/bad-1/v1/chat/completions", json={"model": "x"}, headers=mine), 400, None),
        (httpx.post(f"{url}/rollouts/bad-1/v1/chat/completions", json={"messages": "hi"}, headers=mine), 400, None),
        (httpx.post(f"{url}/rollouts/bad-1/v1/chat/completions", json=[1, 2], headers=mine), 400, "invalid_json"),
        (
            httpx.post(
                f"{url}/rollouts/bad-1/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], "n": 3},
                headers=mine,
            ),
            400,
            None,
        ),
        (httpx.post(f"{url}/rollouts/bad%20id/v1/chat/completions", json={}), 400, "invalid_rollout_id"),
        (httpx.post(f"{url}/rollouts/{'x' * 200}/v1/chat/completions", json={}), 400, "invalid_rollout_id"),
        (
            httpx.post(f"{url}/v1/chat/completions", json={}, headers={"Authorization": "Bearer a/b c:t"}),
            400,
            "invalid_rollout_id",
        ),
        (httpx.get(f"{url}/no/such/route"), 404, None),
        (httpx.get(f"{url}/rollouts/never-seen", headers=admin(url)), 404, "rollout_not_found"),
        (httpx.put(f"{url}/rollouts/x/v1/chat/completions"), 405, None),
        (httpx.post(f"{url}/weights/reload", headers=admin(url), json={}), 400, None),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, (resp.request.url, resp.text)
        err = resp.json()["error"]
        assert err["message"] and err["type"]
        if code:
            assert err["code"] == code
    # A prompt longer than the model's context: vLLM's own 400 reaches the agent, and is recorded.
    resp = chat(url, "oversize-1", "hello " * 9000)
    assert resp.status_code == 400 and "context length" in resp.json()["error"]["message"]
    (call,) = trace(url, "oversize-1")
    assert call["status"] == 400 and "context length" in call["error"]


def test_delete_and_listing(served):
    assert chat(served.url, "del-1", "Hi", max_tokens=2).status_code == 200
    assert "del-1" in httpx.get(f"{served.url}/rollouts", headers=admin(served.url)).json()["rollouts"]
    assert httpx.delete(f"{served.url}/rollouts/del-1", headers=admin(served.url)).status_code == 200
    assert httpx.get(f"{served.url}/rollouts/del-1", headers=admin(served.url)).status_code == 404
    assert httpx.delete(f"{served.url}/rollouts/del-1", headers=admin(served.url)).status_code == 404
    assert "del-1" not in httpx.get(f"{served.url}/rollouts", headers=admin(served.url)).json()["rollouts"]


def test_health_and_metrics(served):
    health = httpx.get(f"{served.url}/health").json()
    assert health["status"] == "ok"
    assert chat(served.url, "metrics-1", "Hi", max_tokens=2).status_code == 200
    text = httpx.get(f"{served.url}/metrics", headers=admin(served.url)).text
    ok = re.search(r'aitlrt_requests_total\{endpoint="chat",status="200"\} (\d+)', text)
    assert ok and int(float(ok.group(1))) >= 1
    assert re.search(r"aitlrt_completion_tokens_total [1-9]", text)
    assert "aitlrt_request_latency_seconds_bucket" in text and "aitlrt_inflight 0.0" in text


def test_journal_holds_every_call(served):
    assert chat(served.url, "journal-1", "Hi", max_tokens=2).status_code == 200
    lines = [json.loads(x) for x in (served.run_dir / "calls.jsonl").read_text().splitlines()]
    (rec,) = [x for x in lines if x.get("rollout_id") == "journal-1"]
    assert rec == trace(served.url, "journal-1")[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) > SMALL_MACHINE_CPUS, reason="vLLM binds its own CPUs here")
def test_vllm_cpu_computes_on_every_cpu_of_a_small_machine(served):
    """vLLM's own report of the CPUs its OpenMP threads run on (its ``auto`` would leave one to the API server)."""
    bound = re.search(r"core ids=\[([\d, ]+)\]", served.vllm_log.read_text())
    assert bound, "vLLM logged no CPU binding"
    assert [int(c) for c in bound.group(1).split(",")] == sorted(os.sched_getaffinity(0))

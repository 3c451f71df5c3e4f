"""Faults a real vLLM will not produce on demand, with the scripted upstream: upstream down, slow, erroring,
a stream cut mid-way, and a proxy crash with the journal reloaded."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from aitlrt.common.procs import free_port
from tests.conftest import admin, chat, token, trace


def test_upstream_down_gives_502_fast_and_health_503(start_proxy):
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}", wait_upstream=False)
    t0 = time.monotonic()
    resp = chat(proxy.url, "down-1", "hi")
    assert time.monotonic() - t0 < 10
    assert resp.status_code == 502
    assert "unreachable" in resp.json()["error"]["message"]
    health = httpx.get(f"{proxy.url}/health")
    assert health.status_code == 503 and health.json()["status"] == "upstream_unavailable"


def test_slow_upstream_gives_504_not_a_hang(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream, "--request-timeout", "1")
    t0 = time.monotonic()
    resp = chat(proxy.url, "slow-1", "fault:slow:5")
    assert time.monotonic() - t0 < 4
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "upstream_timeout"
    (call,) = trace(proxy.url, "slow-1")
    assert call["status"] == 504 and call["completion_token_ids"] == []
    assert chat(proxy.url, "slow-1", "fault:slow:0.2").status_code == 200
    assert [c["call_index"] for c in trace(proxy.url, "slow-1")] == [0, 1]


def test_upstream_errors_reach_the_agent_openai_style_and_are_recorded(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream)
    r500 = chat(proxy.url, "err-1", "fault:error500")
    assert r500.status_code == 500
    assert "boom" in r500.json()["error"]["message"] and r500.json()["error"]["type"] == "server_error"
    r400 = chat(proxy.url, "err-1", "fault:error400")
    assert r400.status_code == 400 and r400.json()["error"]["message"] == "scripted bad request"
    ok = chat(proxy.url, "err-1", "hello")
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Hello from the script"
    calls = trace(proxy.url, "err-1")
    assert [(c["status"], c["call_index"]) for c in calls] == [(500, 0), (400, 1), (200, 2)]
    assert calls[2]["completion_token_ids"] == [101, 102, 103, 104]


def test_stream_cut_midway_is_recorded_partially_with_the_reason(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream)
    body = {"model": "x", "messages": [{"role": "user", "content": "fault:stream-drop"}], "stream": True}
    url = f"{proxy.url}/rollouts/drop-1/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=token(proxy.url, "drop-1"), timeout=30) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    last = json.loads(lines[-1][6:])
    assert "error" in last and "stream broken" in last["error"]["message"]
    (call,) = trace(proxy.url, "drop-1")
    assert call["status"] == 502 and call["completion_token_ids"] == [101, 102]
    assert call["text"] == "Hello from"


def test_usage_chunk_kept_only_when_the_agent_asked(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream)
    body = {
        "model": "x",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{proxy.url}/rollouts/usage-1/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=token(proxy.url, "usage-1"), timeout=30) as resp:
        chunks = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    (call,) = trace(proxy.url, "usage-1")
    assert call["usage"]["completion_tokens"] == 4 and call["prompt_token_ids"]


def test_body_size_limit_gives_413(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream)
    resp = chat(proxy.url, "big-1", "x" * (17 * 2**20))
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_proxy_crash_and_restart_reloads_the_journal(scripted_upstream, start_proxy, tmp_path):
    run_dir = tmp_path / "journal"
    proxy = start_proxy(scripted_upstream, run_dir=run_dir)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: chat(proxy.url, f"crash-{i % 4}", f"call {i}"), range(16)))
    assert chat(proxy.url, "gone-1", "hi").status_code == 200
    assert httpx.delete(f"{proxy.url}/rollouts/gone-1", headers=admin(proxy.url)).status_code == 200
    before = {f"crash-{i}": trace(proxy.url, f"crash-{i}") for i in range(4)}
    proxy.kill()  # SIGKILL: no shutdown hook runs
    with open(run_dir / "calls.jsonl", "a") as f:
        f.write('{"rollout_id": "torn", "call_in')  # a write torn by the crash

    again = start_proxy(scripted_upstream, run_dir=run_dir)
    for rid, calls in before.items():
        assert trace(again.url, rid) == calls
        assert sorted(c["call_index"] for c in calls) == [0, 1, 2, 3]
    assert httpx.get(f"{again.url}/rollouts/gone-1", headers=admin(again.url)).status_code == 404
    assert chat(again.url, "crash-0", "one more").status_code == 200
    assert [c["call_index"] for c in trace(again.url, "crash-0")] == [0, 1, 2, 3, 4]


def test_pause_holds_calls_until_resume_with_new_version(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream)
    assert httpx.post(f"{proxy.url}/weights/pause", headers=admin(proxy.url)).json()["paused"] is True
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(chat, proxy.url, "pause-1", "hi")
        time.sleep(1.0)
        assert not pending.done(), "a call ran while paused"
        assert (
            httpx.post(f"{proxy.url}/weights/resume", headers=admin(proxy.url), json={"version": 5}).json()[
                "weight_version"
            ]
            == 5
        )
        assert pending.result(timeout=30).status_code == 200
    assert trace(proxy.url, "pause-1")[0]["weight_version"] == 5
    assert httpx.post(f"{proxy.url}/weights/resume", headers=admin(proxy.url), json={"version": -1}).status_code == 400


def test_opening_a_rollout_forgets_its_calls_and_sets_its_call_limit(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream)
    assert chat(proxy.url, "open-1", "hello").status_code == 200
    opened = httpx.put(f"{proxy.url}/rollouts/open-1", headers=admin(proxy.url), json={"max_calls": 1})
    assert opened.json() == {"rollout_id": "open-1", "max_calls": 1, "seed": None, "deleted": True}
    assert httpx.get(f"{proxy.url}/rollouts/open-1", headers=admin(proxy.url)).status_code == 404
    assert chat(proxy.url, "open-1", "hello").status_code == 200
    refused = chat(proxy.url, "open-1", "hello")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "call_limit"
    assert [c["status"] for c in trace(proxy.url, "open-1")] == [200, 400], "the refusal is recorded too"
    reopened = httpx.put(f"{proxy.url}/rollouts/open-1", headers=admin(proxy.url), json={"max_calls": None})
    assert reopened.json()["deleted"] is True and chat(proxy.url, "open-1", "hello").status_code == 200
    bad = httpx.put(f"{proxy.url}/rollouts/open-1", headers=admin(proxy.url), json={"max_calls": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_calls"
    assert len(trace(proxy.url, "open-1")) == 1, "a refused request changes nothing"
    assert httpx.put(f"{proxy.url}/rollouts/bad%20id", headers=admin(proxy.url), json={}).status_code == 400


def test_a_seeded_rollout_sends_each_call_its_own_seed(scripted_upstream, start_proxy):
    from aitlrt_server.exchange import call_seed

    url = start_proxy(scripted_upstream).url
    assert httpx.put(f"{url}/rollouts/seed-1", headers=admin(url), json={"seed": 7}).json()["seed"] == 7
    for _ in range(2):
        assert chat(url, "seed-1", "hello", seed=99).status_code == 200, "the rollout's seed wins over the agent's"
    assert [c["request"]["seed"] for c in trace(url, "seed-1")] == [call_seed(7, 0), call_seed(7, 1)]
    assert call_seed(7, 0) != call_seed(7, 1) and 0 <= call_seed(7, 0) < 2**31
    httpx.put(f"{url}/rollouts/seed-1", headers=admin(url), json={}).raise_for_status()  # opened again unseeded
    assert chat(url, "seed-1", "hello", seed=99).status_code == 200
    assert chat(url, "seed-1", "hello").status_code == 200
    assert [c["request"].get("seed") for c in trace(url, "seed-1")] == [99, None], "unseeded: the agent's own"
    for bad in (-1, 1.5, "7"):
        resp = httpx.put(f"{url}/rollouts/seed-1", headers=admin(url), json={"seed": bad})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "seed", resp.text


def test_deleting_a_rollout_forgets_its_calls_call_limit_and_seed(scripted_upstream, start_proxy):
    url = start_proxy(scripted_upstream).url
    httpx.put(f"{url}/rollouts/done-1", headers=admin(url), json={"max_calls": 1, "seed": 7}).raise_for_status()
    assert httpx.delete(f"{url}/rollouts/done-1", headers=admin(url)).status_code == 200, (
        "opened, no call yet: still forgotten"
    )
    assert httpx.delete(f"{url}/rollouts/done-1", headers=admin(url)).status_code == 404, (
        "nothing left: no limit, no seed"
    )
    # A deleted rollout refuses later calls (an agent's background call after its trace was read) unrecorded...
    closed = chat(url, "done-1", "hello")
    assert closed.status_code == 400 and closed.json()["error"]["code"] == "rollout_closed", closed.text
    assert httpx.get(f"{url}/rollouts/done-1", headers=admin(url)).status_code == 404
    # ... until it is opened again.
    httpx.put(f"{url}/rollouts/done-1", headers=admin(url), json={}).raise_for_status()
    for _ in range(2):
        assert chat(url, "done-1", "hello", seed=99).status_code == 200
    assert [c["request"]["seed"] for c in trace(url, "done-1")] == [99, 99]
    assert httpx.delete(f"{url}/rollouts/done-1", headers=admin(url)).status_code == 200
    assert "done-1" not in httpx.get(f"{url}/rollouts", headers=admin(url)).json()["rollouts"]


def test_a_call_still_running_when_its_rollout_is_deleted_is_not_kept(scripted_upstream, start_proxy):
    url = start_proxy(scripted_upstream).url
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(chat, url, "late-1", "fault:slow:2")  # an agent killed at its timeout leaves this
        time.sleep(0.5)
        assert httpx.delete(f"{url}/rollouts/late-1", headers=admin(url)).status_code == 200, (
            "a running call makes the rollout known"
        )
        assert late.result(timeout=30).status_code == 200
    assert httpx.get(f"{url}/rollouts/late-1", headers=admin(url)).status_code == 404
    assert "late-1" not in httpx.get(f"{url}/rollouts", headers=admin(url)).json()["rollouts"]
    httpx.put(
        f"{url}/rollouts/late-1", headers=admin(url), json={}
    ).raise_for_status()  # opened again while a call is running
    with ThreadPoolExecutor(1) as pool:
        late = pool.submit(chat, url, "late-1", "fault:slow:2")
        time.sleep(0.5)
        httpx.put(f"{url}/rollouts/late-1", headers=admin(url), json={}).raise_for_status()
        assert chat(url, "late-1", "hello").status_code == 200
        assert late.result(timeout=30).status_code == 200
    assert [(c["call_index"], c["request"]["messages"][-1]["content"]) for c in trace(url, "late-1")] == [
        (0, "hello")
    ], "the earlier life's call is not mixed into the new one"


def test_admin_bodies_are_validated_openai_style(scripted_upstream, start_proxy):
    url = start_proxy(scripted_upstream).url
    for resp, param in (
        (httpx.post(f"{url}/weights/reload", headers=admin(url), json={}), "path"),
        (httpx.post(f"{url}/weights/reload", headers=admin(url), json={"path": 3}), "path"),
        (httpx.post(f"{url}/weights/resume", headers=admin(url), json={"version": "2"}), "version"),
        (httpx.put(f"{url}/rollouts/adm-1/limits", headers=admin(url), json={"max_calls": 1.5}), "max_calls"),
    ):
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == param and f"'{param}'" in err["message"], err
    for bad in (b"{nope", b"[1]", b""):
        headers = {"content-type": "application/json", **admin(url)}
        resp = httpx.put(f"{url}/rollouts/adm-1", content=bad, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json", resp.text
    # `curl -d` sends a form's content type: the body is still read as JSON.
    form = {"content-type": "application/x-www-form-urlencoded", **admin(url)}
    limited = httpx.put(f"{url}/rollouts/adm-1/limits", content=b'{"max_calls": 2}', headers=form)
    assert limited.json() == {"rollout_id": "adm-1", "max_calls": 2}
    assert httpx.post(f"{url}/weights/resume", headers=admin(url), json={"version": 3}).json()["weight_version"] == 3
    assert httpx.post(f"{url}/weights/resume", headers=admin(url)).json() == {"weight_version": 3, "paused": False}, (
        "empty body: kept"
    )

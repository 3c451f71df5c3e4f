"""What a rollout can reach through ``aitlrt-serve`` (its own model routes, nothing else) and the proxy's hygiene:
bounded bodies, refused sampling fields, the agent's length cap, no body kept for a refused call, a broken stream
line reported as vLLM's fault. Real HTTP against a real ``aitlrt-serve`` in front of the scripted upstream."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
from urllib.parse import urlparse

import httpx
import pytest

from aitlrt.common import keys
from aitlrt.common.procs import free_port, wait_http
from tests.conftest import admin, chat, token, trace

BODY = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}


def named(url: str, rollout: str, as_rollout: str | None = None) -> dict[str, str]:
    """``Bearer ID:TOKEN``: rollout ``rollout``'s token, claiming to be ``as_rollout`` (default: itself)."""
    return {"Authorization": f"Bearer {as_rollout or rollout}:{token(url, rollout)['Authorization'][7:]}"}


def test_a_rollout_token_opens_its_own_model_routes_and_nothing_else(scripted_upstream, start_proxy, tmp_path):
    url = start_proxy(scripted_upstream).url
    httpx.put(f"{url}/rollouts/a-1", json={"max_calls": 2}, headers=admin(url)).raise_for_status()
    assert chat(url, "a-1", "mine").status_code == 200, "its own route, with its own token"
    assert chat(url, "b-1", "theirs").status_code == 200
    weights = (tmp_path / "w").mkdir() or tmp_path / "w"
    (weights / "model.safetensors").write_bytes(b"")
    attempts = [
        ("GET", "/rollouts/b-1", None),  # read another rollout's trace
        ("GET", "/rollouts", None),
        ("DELETE", "/rollouts/a-1", None),  # delete its own trace: its reward would become NaN
        ("PUT", "/rollouts/a-1/limits", {"max_calls": None}),  # lift its call limit
        ("PUT", "/rollouts/a-1", {}),  # open itself again, without a limit
        ("POST", "/weights/pause", None),
        ("POST", "/weights/resume", {"version": 999}),
        ("POST", "/weights/reload", {"path": str(weights)}),
        ("POST", "/weights/probe", {"token_ids": [1, 2]}),
        ("GET", "/weights", None),
        ("GET", "/settings", None),
        ("GET", "/metrics", None),
    ]
    for method, path, body in attempts:
        for headers, status in ((token(url, "a-1"), 401), (named(url, "a-1"), 403), ({}, 401)):
            resp = httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)
            assert resp.status_code == status, (method, path, headers, resp.text)
            assert resp.json()["error"]["type"] in ("authentication_error", "permission_error")
    # Nothing changed: the weights, both traces, the call limit.
    state = httpx.get(f"{url}/weights", headers=admin(url)).json()
    assert (state["weight_version"], state["paused"]) == (0, False)
    assert [c["status"] for c in trace(url, "b-1")] == [200]
    assert chat(url, "a-1", "second").status_code == 200
    assert chat(url, "a-1", "third").json()["error"]["code"] == "call_limit", "the limit still holds"

    # Another rollout's model route: refused, nothing recorded there.
    route = f"{url}/rollouts/b-1/v1/chat/completions"
    assert httpx.post(route, json=BODY, headers=token(url, "a-1")).status_code == 401
    assert httpx.post(route, json=BODY, headers=named(url, "a-1")).status_code == 403
    assert httpx.post(route, json=BODY, headers=named(url, "a-1", "b-1")).status_code == 401, "a forged claim"
    assert httpx.post(route, json=BODY).status_code == 401
    assert httpx.get(f"{url}/rollouts/b-1/v1/models", headers=token(url, "a-1")).status_code == 401
    assert [c["status"] for c in trace(url, "b-1")] == [200]
    assert httpx.post(route, json=BODY, headers=admin(url)).status_code == 200, "the admin key opens every route"


def test_plain_v1_names_the_rollout_in_its_key(scripted_upstream, start_proxy):
    url = start_proxy(scripted_upstream).url
    plain = f"{url}/v1/chat/completions"
    assert httpx.post(plain, json=BODY, headers=named(url, "p-1")).status_code == 200
    assert httpx.post(plain, json=BODY, headers=named(url, "p-1", "q-1")).status_code == 401
    assert httpx.post(plain, json=BODY, headers=token(url, "p-1")).status_code == 401, "a bare token names no one"
    assert httpx.post(plain, json=BODY).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=named(url, "p-1")).status_code == 200
    assert httpx.post(plain, json=BODY, headers=admin(url)).status_code == 200
    listing = httpx.get(f"{url}/rollouts", headers=admin(url)).json()["rollouts"]
    assert listing == {"p-1": 1, "_unattributed": 1}


def test_health_names_no_upstream_and_there_are_no_docs(scripted_upstream, start_proxy):
    url = start_proxy(scripted_upstream).url
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and scripted_upstream not in health.text and "upstream" not in health.json()
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{url}{path}", headers=admin(url)).status_code == 404, path


def test_a_server_started_without_a_key_writes_one_to_its_key_file(scripted_upstream, tmp_path):
    run_dir, port = tmp_path / "serve", free_port()
    env = {k: v for k, v in os.environ.items() if k != keys.ENV}
    cmd = [sys.executable, "-m", "aitlrt_server.cli", "--upstream", scripted_upstream, "--port", str(port)]
    refused = subprocess.run([*cmd, "--api-key", "on-the-command-line"], env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "AITLRT_API_KEY" in refused.stderr, "a key in ps is refused"
    for _ in range(2):  # started again, it reads the same key
        proc = subprocess.Popen([*cmd, "--run-dir", str(run_dir)], env=env, stdin=subprocess.DEVNULL)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", proc, 60)
            key_file = run_dir / "api_key"
            assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
            key = key_file.read_text().strip()
            settings = f"http://127.0.0.1:{port}/settings"
            assert httpx.get(settings).status_code == 401
            assert httpx.get(settings, headers=keys.bearer(key)).status_code == 200
        finally:
            proc.terminate()
            proc.wait(30)


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream)
    where = urlparse(proxy.url)
    head = (
        f"POST /rollouts/big-2/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: {token(proxy.url, 'big-2')['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {17 * 2**20}\r\n\r\n"
    )
    with socket.create_connection((where.hostname, where.port), timeout=10) as sock:
        sock.sendall(head.encode())  # and not one byte of the body
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"


def test_admin_bodies_are_bounded(scripted_upstream, start_proxy):
    url = start_proxy(scripted_upstream).url
    padded = json.dumps({"max_calls": 1, "padding": "x" * 2**21}).encode()
    resp = httpx.put(f"{url}/rollouts/adm-2/limits", content=padded, headers=admin(url))
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large", resp.text

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(3):
            yield b" " * 2**20

    resp = httpx.put(f"{url}/rollouts/adm-2/limits", content=chunks(), headers=admin(url))
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large", resp.text


def test_a_refused_call_keeps_no_body(scripted_upstream, start_proxy):
    url = start_proxy(scripted_upstream).url
    httpx.put(f"{url}/rollouts/lim-1", json={"max_calls": 1}, headers=admin(url)).raise_for_status()
    assert chat(url, "lim-1", "first").status_code == 200
    assert chat(url, "lim-1", "a long secret " * 1000).json()["error"]["code"] == "call_limit"
    answered, refused = trace(url, "lim-1")
    assert answered["request"]["messages"][0]["content"] == "first"
    assert refused["status"] == 400 and refused["request"] is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"ignore_eos": True}, "ignore_eos"), ({"use_beam_search": True}, "use_beam_search"), ({"n": 2}, "n")],
)
def test_fields_that_change_the_sampling_are_refused_and_not_recorded(scripted_upstream, start_proxy, extra, param):
    url = start_proxy(scripted_upstream).url
    resp = chat(url, "field-1", "hi", **extra)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    several = httpx.post(
        f"{url}/rollouts/field-1/v1/completions", json={"prompt": ["a", "b"]}, headers=token(url, "field-1")
    )
    assert several.status_code == 400 and several.json()["error"]["param"] == "prompt"
    assert httpx.get(f"{url}/rollouts/field-1", headers=admin(url)).status_code == 404


def test_the_agents_max_tokens_is_honoured_up_to_the_runs(scripted_upstream, start_proxy):
    free = start_proxy(scripted_upstream).url  # no --max-tokens: the agent's cap (it was dropped)
    reply = chat(free, "len-1", "hi", max_tokens=2).json()
    assert reply["choices"][0]["message"]["content"] == "Hello from"
    assert reply["choices"][0]["finish_reason"] == "length"
    capped = start_proxy(scripted_upstream, "--max-tokens", "3").url
    assert chat(capped, "len-2", "hi", max_completion_tokens=10).json()["usage"]["completion_tokens"] == 3
    assert [c["request"]["max_tokens"] for c in trace(capped, "len-2")] == [3]


def test_a_stream_line_over_aiohttps_limit_is_an_upstream_error(scripted_upstream, start_proxy):
    url = start_proxy(scripted_upstream).url
    body = {**BODY, "messages": [{"role": "user", "content": "fault:stream-longline"}], "stream": True}
    route = f"{url}/rollouts/long-1/v1/chat/completions"
    with httpx.stream("POST", route, json=body, headers=token(url, "long-1"), timeout=30) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "upstream_bad_stream", events[-1]
    (call,) = trace(url, "long-1")
    assert (call["status"], call["error_code"]) == (502, "upstream_bad_stream"), "not a client disconnect (499)"
    assert call["text"] == "Hello", "what came before the line is kept"

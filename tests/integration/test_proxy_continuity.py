"""Token continuity through the real proxy and a real vLLM CPU server with the bundled model: an append-only
conversation is continued call after call (one training row); a rewritten history falls back (a new row); the agent
gets an ordinary chat completion either way."""

from __future__ import annotations

import re

import httpx

from aitlrt.common import keys
from aitlrt.training.rows import build_rows
from tests.conftest import admin, token, trace

SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def ask(url: str, rollout: str, messages: list[dict], **extra) -> dict:
    body = {"model": "whatever", "messages": messages, "max_tokens": 16, **extra}
    resp = httpx.post(f"{url}/rollouts/{rollout}/v1/chat/completions", json=body, headers=token(url, rollout),
                      timeout=300)  # fmt: skip
    assert resp.status_code == 200, resp.text
    return resp.json()


def converse(url: str, rollout: str, turns: list[str], **extra) -> list[dict]:
    """An append-only conversation: each answer kept, then the next user message; the agent's responses."""
    messages, responses = [SYSTEM], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        data = ask(url, rollout, messages, **extra)
        responses.append(data)
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    return responses


def shape(obj):
    """The keys of a JSON value, recursively (the values' types aside)."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items() if k not in ("logprobs",)}
    if isinstance(obj, list):
        return [shape(v) for v in obj[:1]]
    return None


def test_an_append_only_conversation_is_one_row_of_exact_tokens(served, tokenizer):
    turns = ["Name a colour.", "Now name a fruit.", "And an animal?"]
    responses = converse(served.url, "cont-1", turns, seed=3)
    calls = trace(served.url, "cont-1")
    assert [c["continuity"] for c in calls] == ["first_call", "continued", "continued"]
    assert [c["continued_from"] for c in calls] == [None, 0, 1]
    for prev, call, turn in zip(calls, calls[1:], turns[1:], strict=False):
        held = prev["prompt_token_ids"] + prev["completion_token_ids"]
        assert call["prompt_token_ids"][: len(held)] == held, "the previous prompt and completion, token for token"
        added = tokenizer.decode(call["prompt_token_ids"][len(held) :])
        assert added.endswith(f"<|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n"), added
        assert added.startswith("\n" if prev["completion_token_ids"][-1] == tokenizer.eos_token_id else "<|im_end|>")
        # the record is a chat call's: its messages, the run's parameters, vLLM's tokens and logprobs
        assert call["endpoint"] == "chat" and call["request"]["messages"][-1] == {"role": "user", "content": turn}
        assert call["request"]["temperature"] == 1.0 and call["request"]["max_tokens"] == 16
        assert len(call["logprobs"]) == len(call["completion_token_ids"]) > 0
        assert call["usage"]["prompt_tokens"] == len(call["prompt_token_ids"])
    rows, stats = build_rows(calls)
    assert len(rows) == 1 and rows[0].calls == 3 and stats.new_rows == 1
    assert rows[0].sampled == sum(len(c["completion_token_ids"]) for c in calls)

    # what the agent got: an ordinary chat completion, shaped as the first (ordinary) one
    first, *continued = responses
    for data, call in zip(continued, calls[1:], strict=True):
        assert shape(data) == shape(first)
        assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
        assert data["id"] == call["response_id"]
        choice = data["choices"][0]
        assert "prompt_token_ids" not in data and "token_ids" not in choice and "logprobs" not in choice
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == call["finish_reason"]
        assert choice["message"]["content"] == call["text"]
        assert tokenizer.decode(call["completion_token_ids"], skip_special_tokens=True) == call["text"]
        assert data["usage"]["completion_tokens"] == len(call["completion_token_ids"])
        assert data["usage"]["prompt_tokens"] == len(call["prompt_token_ids"])

    metrics = httpx.get(f"{served.url}/metrics", headers=admin(served.url)).text
    count = re.search(r'aitlrt_continuity_total\{outcome="continued"\} (\d+)', metrics)
    assert count and int(float(count.group(1))) >= 2


def test_a_rewritten_history_falls_back_to_a_new_row(served):
    (data,) = converse(served.url, "cont-2", ["Name a colour."])
    answer = {"role": "assistant", "content": data["choices"][0]["message"]["content"]}
    # the answer dropped (as mini-swe-agent drops a badly formatted one) and a new user message instead
    ask(served.url, "cont-2", [SYSTEM, {"role": "user", "content": "Name a colour."}, {"role": "user", "content": "?"}])
    # the answer edited, the call before forgotten (the history no longer extends the last call's)
    edited = {**answer, "content": answer["content"] + " (edited)"}
    ask(
        served.url,
        "cont-2",
        [SYSTEM, {"role": "user", "content": "Name a colour."}, edited, {"role": "user", "content": "?"}],
    )
    calls = trace(served.url, "cont-2")
    assert [c["continuity"] for c in calls] == ["first_call", "answer_rewritten", "history_rewritten"]
    assert all(c["continued_from"] is None for c in calls)
    rows, _ = build_rows(calls[:2])
    assert len(rows) == 2


def test_logprobs_the_agent_asked_for_and_a_stream(served):
    # seeded: an unseeded answer cut inside an emoji by max_tokens falls back (answer_ending, tests/unit)
    first, second = converse(served.url, "cont-3", ["Say hi.", "Again."], logprobs=True, seed=3)
    calls = trace(served.url, "cont-3")
    assert calls[1]["continuity"] == "continued"
    for data, call in zip((first, second), calls, strict=True):
        content = data["choices"][0]["logprobs"]["content"]
        assert [t["logprob"] for t in content] == call["logprobs"]
        assert [t["top_logprobs"] for t in content] == [[]] * len(content)
    assert shape(second) == shape(first)
    assert all(t["bytes"] == list(t["token"].encode()) for t in second["choices"][0]["logprobs"]["content"])
    # a stream is not continued: the ordinary path, its reason recorded
    messages = [*calls[1]["request"]["messages"], {"role": "assistant", "content": calls[1]["text"]},
                {"role": "user", "content": "Once more."}]  # fmt: skip
    body = {"model": "x", "messages": messages, "stream": True, "max_tokens": 4}
    with httpx.stream("POST", f"{served.url}/rollouts/cont-3/v1/chat/completions", json=body,
                      headers=token(served.url, "cont-3"), timeout=300) as resp:  # fmt: skip
        assert resp.status_code == 200 and list(resp.iter_lines())[-2] == "data: [DONE]"
    assert trace(served.url, "cont-3")[2]["continuity"] == "stream"


def test_an_attached_proxy_continues_with_vllms_model_folder_and_can_be_turned_off(served, start_proxy, monkeypatch):
    monkeypatch.setenv("VLLM_KEY", keys.vllm_key(keys.admin_key(served.url) or ""))
    attached = start_proxy(served.vllm_url, "--upstream-api-key-env", "VLLM_KEY")
    converse(attached.url, "att-1", ["Name a colour.", "Another."])
    assert [c["continuity"] for c in trace(attached.url, "att-1")] == ["first_call", "continued"]
    off = start_proxy(served.vllm_url, "--upstream-api-key-env", "VLLM_KEY", "--no-continuity")
    converse(off.url, "off-1", ["Name a colour.", "Another."])
    calls = trace(off.url, "off-1")
    assert [c["continuity"] for c in calls] == ["off", "off"] and calls[1]["continued_from"] is None

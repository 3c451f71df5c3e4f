"""The pure parts of the proxy: request rewriting, reply stripping, stream accumulation, the store."""

from __future__ import annotations

import pytest

from aitlrt_server.errors import ProxyError
from aitlrt_server.exchange import StreamAccumulator, parse_sse_line, prepare_request, strip_response
from aitlrt_server.store import TraceStore, valid_rollout_id

RUN = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "max_tokens": 64}


def test_prepare_request_forces_the_runs_sampling_and_asks_for_ids():
    body = {
        "model": "openai/foo",
        "messages": [{"role": "user", "content": "x"}],
        "temperature": 0,
        "max_completion_tokens": 5,
        "presence_penalty": 2.0,
        "seed": 3,
        "stream": True,
    }
    out, asked = prepare_request(body, "chat", RUN, "served")
    assert out["model"] == "served" and out["seed"] == 3
    assert {k: out[k] for k in RUN} == {**RUN, "max_tokens": 5}, "the agent's cap, under the run's"
    assert "presence_penalty" not in out and "max_completion_tokens" not in out
    assert out["logprobs"] is True and out["return_token_ids"] is True
    assert out["stream_options"] == {"include_usage": True}
    assert asked.logprobs is False and asked.usage_in_stream is False
    assert body["temperature"] == 0, "the agent's body is not modified"


@pytest.mark.parametrize(
    "body", [{}, {"messages": []}, {"messages": "hi"}, {"messages": ["hi"]}, {"messages": [{"role": "user"}], "n": 2}]
)
def test_prepare_request_rejects_bad_chat_bodies(body):
    with pytest.raises(ProxyError) as err:
        prepare_request(body, "chat", RUN, "m")
    assert err.value.status == 400


@pytest.mark.parametrize(
    ("asked", "run_cap", "sent"),
    [
        ({"max_tokens": 24}, None, 24),  # no run cap: the agent's (it was dropped: generation to the context limit)
        ({"max_completion_tokens": 24}, None, 24),
        ({"max_tokens": 500}, 64, 64),  # capped by the run's
        ({"max_tokens": 500, "max_completion_tokens": 10}, 64, 10),  # the newer name wins, as at OpenAI
        ({}, 64, 64),
        ({}, None, None),
    ],
)
def test_the_agents_max_tokens_is_honoured_up_to_the_runs(asked, run_cap, sent):
    run = {"temperature": 1.0} | ({"max_tokens": run_cap} if run_cap else {})
    out, _ = prepare_request({"messages": [{"role": "user", "content": "x"}], **asked}, "chat", run, "m")
    assert out.get("max_tokens") == sent and "max_completion_tokens" not in out


@pytest.mark.parametrize("bad", [0, -3, 2.5, "24", True])
def test_a_bad_max_tokens_is_a_400_naming_it(bad):
    with pytest.raises(ProxyError) as err:
        prepare_request({"prompt": "x", "max_tokens": bad}, "completions", RUN, "m")
    assert err.value.status == 400 and err.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        ("chat", {"use_beam_search": True}, "use_beam_search"),
        ("chat", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
        ("chat", {"bad_words": ["x"]}, "bad_words"),
        ("chat", {"min_tokens": 5}, "min_tokens"),
        ("chat", {"ignore_eos": True}, "ignore_eos"),
        ("chat", {"stop_token_ids": [2]}, "stop_token_ids"),
        ("chat", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
        ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"prompt_logprobs": 1}, "prompt_logprobs"),
        ("chat", {"vllm_xargs": {"k": 1}}, "vllm_xargs"),
        ("completions", {"echo": True}, "echo"),
        ("completions", {"prompt": ["one", "two"]}, "prompt"),  # several prompts: several answers in one call
        ("completions", {"prompt": [[1, 2], [3]]}, "prompt"),
    ],
)
def test_fields_that_change_the_sampling_are_refused_openai_style(endpoint, extra, param):
    body = {"messages": [{"role": "user", "content": "x"}]} if endpoint == "chat" else {"prompt": "x"}
    with pytest.raises(ProxyError) as err:
        prepare_request({**body, **extra}, endpoint, RUN, "m")
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_only_allow_listed_fields_reach_vllm():
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "logit_bias": {"5": 100},  # a sampling parameter: dropped, as temperature is
        "min_tokens": 0,  # neutral values of refused fields: dropped
        "ignore_eos": False,
        "some_future_vllm_field": 1,  # unknown: dropped
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "stop": ["\n\n"],
    }
    out, _ = prepare_request(body, "chat", RUN, "m")
    assert set(out) == {"messages", "tools", "tool_choice", "stop", "model", "logprobs", "return_token_ids"} | set(RUN)


def test_completions_logprobs_the_agent_asked_for_are_kept():
    out, asked = prepare_request({"prompt": "x", "logprobs": 2}, "completions", RUN, "m")
    assert out["logprobs"] == 2 and asked.logprobs
    out, asked = prepare_request({"prompt": [1, 2]}, "completions", RUN, "m")
    assert out["logprobs"] == 0 and not asked.logprobs
    choice = {"text": "a", "token_ids": [5], "logprobs": {}, "prompt_token_ids": [1]}
    data = {"prompt_token_ids": [1], "choices": [choice]}
    assert strip_response(data, asked) == {"choices": [{"text": "a"}]}


def test_stream_accumulator_merges_text_ids_logprobs_and_tool_calls():
    acc = StreamAccumulator("chat")
    acc.add({"id": "c1", "prompt_token_ids": [1, 2], "choices": [{"delta": {"role": "assistant", "content": ""}}]})
    acc.add(
        {
            "choices": [
                {
                    "delta": {
                        "content": "Hel",
                        "tool_calls": [{"index": 0, "id": "t", "function": {"name": "edit", "arguments": '{"a"'}}],
                    },
                    "token_ids": [7, 8],
                    "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
                }
            ]
        }
    )
    acc.add(
        {
            "choices": [
                {
                    "delta": {"content": "lo", "tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]},
                    "token_ids": [9],
                    "logprobs": {"content": [{"logprob": -0.3}]},
                    "finish_reason": "stop",
                }
            ]
        }
    )
    acc.add({"choices": [], "usage": {"completion_tokens": 3}})
    out = acc.result()
    assert out.prompt_token_ids == [1, 2] and out.completion_token_ids == [7, 8, 9]
    assert out.logprobs == [-0.1, -0.2, -0.3] and out.text == "Hello" and out.finish_reason == "stop"
    assert out.message["tool_calls"] == [{"id": "t", "function": {"name": "edit", "arguments": '{"a":1}'}}]
    assert out.usage == {"completion_tokens": 3} and out.response_id == "c1"


def test_parse_sse_line():
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert parse_sse_line("data: [DONE]") is None
    assert parse_sse_line(": keep-alive") is None


@pytest.mark.parametrize(
    ("rid", "ok"),
    [
        ("r-1.a_B", True),
        ("", False),
        ("a b", False),
        ("a/b", False),
        ("..", False),
        ("x" * 128, True),
        ("x" * 129, False),
    ],
)
def test_rollout_id_validation(rid, ok):
    assert valid_rollout_id(rid) is ok


def test_store_orders_calls_by_index_and_replays_tombstones(tmp_path):
    store = TraceStore(tmp_path)
    (first, life), (second, same) = store.start_call("r"), store.start_call("r")
    assert (first, second) == (0, 1) and life == same
    store.add({"rollout_id": "r", "call_index": second}, life)
    store.add({"rollout_id": "r", "call_index": first}, life)
    index, life = store.start_call("gone")
    assert store.add({"rollout_id": "gone", "call_index": index}, life)
    assert store.delete("gone") and not store.delete("gone")
    assert [c["call_index"] for c in store.get("r")] == [0, 1]
    store.close()
    again = TraceStore(tmp_path)
    assert again.summary() == {"r": 2}
    assert again.start_call("r")[0] == 2 and again.start_call("gone")[0] == 0


def test_a_call_that_ends_after_its_rollout_was_deleted_is_not_recorded(tmp_path):
    store = TraceStore(tmp_path)
    index, old_life = store.start_call("r")  # a call starts; the rollout is deleted while it runs
    assert store.delete("r"), "a rollout with a call running is known"
    new_index, life = store.start_call("r")  # the id opened again
    assert new_index == 0 and life != old_life
    assert not store.add({"rollout_id": "r", "call_index": index}, old_life), "the late call"
    assert store.get("r") is None
    assert store.add({"rollout_id": "r", "call_index": new_index}, life)
    assert [c["call_index"] for c in store.get("r")] == [0]
    store.close()
    assert TraceStore(tmp_path).summary() == {"r": 1}, "the late call is not in the journal either"


def test_closed_rollouts_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr("aitlrt_server.store.CLOSED_KEPT", 2)
    store = TraceStore(None)
    for rid in ("a", "b", "c"):
        store.close_rollout(rid)
    assert [store.is_closed(r) for r in ("a", "b", "c")] == [False, True, True], "the oldest forgotten"
    store.reopen("b")
    assert not store.is_closed("b")

"""Token continuity's pure part (``aitlrt_server.continuity``) with the bundled SmolLM2's real tokenizer and ChatML
template: when a call extends the previous one, what it sends; every case that falls back, and why."""

from __future__ import annotations

import asyncio

import pytest

from aitlrt_server.cli import build_parser, vllm_arg
from aitlrt_server.continuity import (
    ChatRenderer,
    Continuation,
    Continuity,
    base_obstacle,
    chat_response,
    completion_body,
    continued_prompt,
    find_base,
    new_messages,
    request_obstacle,
)

EOS = 2  # SmolLM2's <|im_end|>
FIRST = [{"role": "system", "content": "You run shell commands."}, {"role": "user", "content": "Fix calc.py."}]
ANSWER = "THOUGHT: look.\n\n```bash\ncat calc.py\n```"


@pytest.fixture(scope="module")
def renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer(tokenizer)


def record(renderer: ChatRenderer, messages=FIRST, text=ANSWER, *, eos=True, index=0, **extra) -> dict:
    """A recorded chat call as the proxy keeps it: vLLM's rendering of ``messages``, ``text`` sampled as its
    canonical tokens (and the end of the turn, when ``eos``)."""
    completion = renderer.encode(text) + ([EOS] if eos else [])
    return {
        "call_index": index,
        "endpoint": "chat",
        "tag": None,
        "status": 200,
        "request": {"model": "m", "messages": list(messages), "temperature": 1.0, "max_tokens": 64},
        "prompt_token_ids": renderer.encode(renderer.render(messages, True)),
        "completion_token_ids": completion,
        "logprobs": [-0.5] * len(completion),
        "finish_reason": "stop" if eos else "length",
        "text": text,
        "message": {"role": "assistant", "content": text},
        "continued_from": None,
        **extra,
    }


def following(base: dict, *new: str) -> list[dict]:
    """The next request of an append-only history: ``base``'s messages, its answer, then user messages ``new``."""
    answer = {"role": "assistant", "content": base["text"]}
    return [*base["request"]["messages"], answer, *({"role": "user", "content": n} for n in new)]


def test_a_continued_prompt_is_the_previous_tokens_the_end_of_the_turn_and_the_new_message(renderer):
    base = record(renderer)
    messages = following(base, "<output>def add(a, b): ...</output>")
    prompt, rendered = continued_prompt(renderer, base, messages, root=True)
    held = base["prompt_token_ids"] + base["completion_token_ids"]
    assert prompt[: len(held)] == held, "the previous prompt and completion, token for token"
    # SmolLM2 samples <|im_end|> and stops; the template ends the turn with "<|im_end|>\n": the "\n" is context
    tail = renderer.encode("\n<|im_start|>user\n<output>def add(a, b): ...</output><|im_end|>\n<|im_start|>assistant\n")
    assert prompt[len(held) :] == tail and rendered == len(tail)
    # where the sampled tokens are the canonical ones, that is exactly the template's rendering of the whole history
    assert prompt == renderer.encode(renderer.render(messages, True))


def test_the_sampled_tokens_are_kept_where_the_template_would_tokenise_the_answer_otherwise(renderer):
    base = record(renderer)
    odd = [t for ch in "cat" for t in renderer.encode(ch)]  # "cat" as 3 tokens, not its canonical one
    assert odd != renderer.encode("cat")
    base["completion_token_ids"] = [*odd, EOS]
    base["logprobs"] = [-1.0] * 4
    base["text"] = base["message"]["content"] = "cat"
    prompt, _ = continued_prompt(renderer, base, following(base, "ok"), root=True)
    held = base["prompt_token_ids"] + odd + [EOS]
    assert prompt[: len(held)] == held
    rendered = renderer.encode(renderer.render(following(base, "ok"), True))
    assert rendered[: len(held)] != held, "vLLM's rendering of the history would start a new row"
    assert len(prompt) == len(rendered) + 2


def test_an_answer_cut_at_its_length_gets_the_whole_end_of_its_turn(renderer):
    base = record(renderer, eos=False)
    prompt, _ = continued_prompt(renderer, base, following(base, "go on"), root=True)
    held = base["prompt_token_ids"] + base["completion_token_ids"]
    assert prompt[: len(held)] == held
    tail = "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    assert prompt[len(held) :] == renderer.encode(tail)


def test_several_new_messages_and_a_chain_of_continued_calls(renderer):
    first = record(renderer)
    messages = following(first, "one", "two")
    prompt, _ = continued_prompt(renderer, first, messages, root=True)
    second = {
        **record(renderer, messages, "done", index=1),
        "prompt_token_ids": prompt,
        "continued_from": 0,
    }
    # a continued call's prompt is not vLLM's rendering: no root check for it, and the chain runs on
    third, _ = continued_prompt(renderer, second, following(second, "three"), root=False)
    assert third[: len(prompt)] == prompt
    assert third == renderer.encode(renderer.render(following(second, "three"), True))


def test_fallbacks_of_the_rendering(renderer):
    base = record(renderer)
    # a prompt vLLM rendered otherwise than this renderer (another template, tokenizer): never the root of a chain
    other = {**base, "prompt_token_ids": base["prompt_token_ids"][1:]}
    assert continued_prompt(renderer, other, following(other, "x"), root=True) == "template_mismatch"
    # an answer that stopped on a stop string the agent asked for: its tokens run past its text
    stopped = record(renderer, text="ls")
    stopped["completion_token_ids"] = renderer.encode("ls\n```")
    stopped["logprobs"] = [-1.0] * len(stopped["completion_token_ids"])
    assert continued_prompt(renderer, stopped, following(stopped, "x"), root=True) == "answer_ending"
    # an answer cut by max_tokens inside a character (an emoji is two tokens): vLLM's text holds the partial
    # character back, its tokens decode to a replacement character past the text (CI's answer_ending, stop 59)
    cut = record(renderer, text="Hi ", eos=False)
    cut["completion_token_ids"] = renderer.encode("Hi 😁")[:-1]
    cut["logprobs"] = [-1.0] * len(cut["completion_token_ids"])
    assert continued_prompt(renderer, cut, following(cut, "x"), root=True) == "answer_ending"
    # a special token sampled inside the answer: vLLM's text leaves it out
    inner = record(renderer, text="ab")
    inner["completion_token_ids"] = [*renderer.encode("a"), 1, *renderer.encode("b"), EOS]
    assert continued_prompt(renderer, inner, following(inner, "x"), root=True) == "answer_rendered"
    # a template that renders an earlier answer otherwise once a message follows it (as Qwen3 drops old thinking)
    forgetful = ChatRenderer(
        renderer.tokenizer,
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(answered){% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    base = record(forgetful)
    assert continued_prompt(forgetful, base, following(base, "x"), root=True) == "template_rerenders"
    # a template that trims the answer
    trimming = ChatRenderer(
        renderer.tokenizer,
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    base = record(trimming, text=" padded ")
    assert continued_prompt(trimming, base, following(base, "x"), root=True) == "answer_rendered"


def test_extension_detection():
    base = {"request": {"messages": FIRST}, "text": ANSWER}
    assert new_messages(base, following(base, "obs")) == [{"role": "user", "content": "obs"}]
    assert new_messages(base, following(base)) == []
    assert new_messages(base, FIRST) == "history_rewritten"  # the answer dropped (mini-swe-agent's format errors)
    assert new_messages(base, [FIRST[0], *following(base, "obs")[2:]]) == "history_rewritten"  # a message dropped
    edited = following(base, "obs")
    edited[1] = {"role": "user", "content": "Fix calc.py please."}
    assert new_messages(base, edited) == "history_rewritten"
    edited = following(base, "obs")
    edited[2] = {"role": "assistant", "content": ANSWER.strip() + "!"}
    assert new_messages(base, edited) == "answer_rewritten"
    edited[2] = {"role": "user", "content": ANSWER}
    assert new_messages(base, edited) == "answer_rewritten"


def test_requests_and_previous_calls_that_are_not_continued():
    plain = {"model": "m", "messages": [*FIRST, {"role": "assistant", "content": "a"}]}
    assert request_obstacle(plain) is None
    cases = {
        "stream": {"stream": True},
        "tools": {"tools": [{"type": "function", "function": {"name": "bash"}}]},
        "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    }
    for why, extra in cases.items():
        assert request_obstacle({**plain, **extra}) == why
    assert request_obstacle({**plain, "tool_choice": "auto"}) == "tools"
    assert request_obstacle({**plain, "tool_choice": "none", "logprobs": True}) is None
    for message, why in [
        ({"role": "tool", "content": "x", "tool_call_id": "1"}, "message_role"),
        ({"role": "developer", "content": "x"}, "message_role"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, "message_role"),
        ({"role": "user", "content": [{"type": "text", "text": "x"}]}, "message_content"),
        ({"role": "assistant", "content": "x", "reasoning_content": "hm"}, "message_content"),
    ]:
        assert request_obstacle({**plain, "messages": [*FIRST, message]}) == why

    ok = {"status": 200, "prompt_token_ids": [1], "completion_token_ids": [5], "logprobs": [-1.0],
          "finish_reason": "stop", "request": {"messages": FIRST}}  # fmt: skip
    assert base_obstacle(ok) is None
    assert base_obstacle({**ok, "logprobs": []}) == "previous_tokens"
    assert base_obstacle({**ok, "finish_reason": "abort"}) == "previous_finish"
    assert base_obstacle({**ok, "message": {"tool_calls": [{"id": "1"}]}}) == "tools"

    calls = [
        {"call_index": 0, "endpoint": "chat", "status": 200, "tag": None},
        {"call_index": 1, "endpoint": "chat", "status": 200, "tag": "weak"},
        {"call_index": 2, "endpoint": "chat", "status": 400, "tag": None},
        {"call_index": 3, "endpoint": "completions", "status": 200, "tag": None},
    ]
    assert find_base(calls, None)["call_index"] == 0
    assert find_base(calls, "weak")["call_index"] == 1
    assert find_base(calls, "summary") is None and find_base(None, None) is None


def test_the_completion_body_and_the_chat_answer_it_becomes():
    chat = {"model": "m", "messages": FIRST, "temperature": 1.0, "top_p": 0.95, "top_k": -1, "seed": 7, "stop": ["X"],
            "logprobs": True, "return_token_ids": True, "response_format": {"type": "text"}}  # fmt: skip
    body = completion_body(chat, [1, 2, 3], 100)
    assert body == {"model": "m", "temperature": 1.0, "top_p": 0.95, "top_k": -1, "seed": 7, "stop": ["X"],
                    "prompt": [1, 2, 3], "max_tokens": 97, "logprobs": 0, "return_token_ids": True}  # fmt: skip
    assert completion_body({**chat, "max_tokens": 5}, [1, 2, 3], 100)["max_tokens"] == 5

    usage = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}
    completion = {
        "id": "cmpl-abc",
        "object": "text_completion",
        "created": 17,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "hé",
                "logprobs": {
                    "text_offset": [0, 1],
                    "token_logprobs": [-0.1, -0.2],
                    "tokens": ["h", "é"],
                    "top_logprobs": [{"h": -0.1}, {"é": -0.2}],
                },
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": [9, 2],
                "prompt_token_ids": [1, 2, 3],
            }
        ],
        "usage": usage,
    }
    data = chat_response(completion)
    assert data["id"] == "chatcmpl-abc" and data["object"] == "chat.completion" and data["created"] == 17
    assert data["prompt_token_ids"] == [1, 2, 3] and data["usage"] == usage
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == "hé"
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [9, 2]
    assert choice["logprobs"]["content"] == [
        {"token": "h", "logprob": -0.1, "bytes": [104], "top_logprobs": []},
        {"token": "é", "logprob": -0.2, "bytes": [195, 169], "top_logprobs": []},
    ]


def test_the_plan_of_a_rollout(renderer, model_dir):
    first = record(renderer)
    continuity = Continuity(str(model_dir))
    try:

        def plan(calls, messages, tag=None, model="m"):
            return asyncio.run(continuity.plan(calls, {"model": model, "messages": messages}, tag, None))

        assert plan([], FIRST) == "first_call"
        done = plan([first], following(first, "obs"))
        assert isinstance(done, Continuation) and done.base_index == 0
        assert done.prompt_token_ids == renderer.encode(renderer.render(following(first, "obs"), True))
        assert plan([first], following(first, "obs"), tag="weak") == "first_call"
        assert plan([first], following(first, "obs"), model="other") == "model"
        assert plan([first], FIRST) == "history_rewritten"
    finally:
        continuity.close()
    missing = Continuity(None)
    try:  # no tokenizer given, and vLLM's model is not a folder here: never continued, said once
        call = missing.plan([first], {"model": "m", "messages": following(first, "obs")}, None, "org/remote-model")
        assert asyncio.run(call) == "no_tokenizer"
    finally:
        missing.close()


def test_the_flags():
    assert build_parser().parse_known_args([])[0].no_continuity is False
    assert build_parser().parse_known_args(["--no-continuity"])[0].no_continuity is True
    args = ["--enforce-eager", "--tokenizer", "tok", "--chat-template=t.jinja"]
    assert vllm_arg(args, "--tokenizer") == "tok" and vllm_arg(args, "--chat-template") == "t.jinja"
    assert vllm_arg(args, "--dtype") is None

"""What the proxy changes on the way to vLLM and back, and the call record it keeps.

Pure functions and one stream accumulator: no I/O here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from aitlrt.common.seeds import derived_seed
from aitlrt_server.errors import ProxyError

Endpoint = Literal["chat", "completions"]

# Only the fields in _PASSED reach vLLM (besides the run's sampling, the length cap and what we ask for); any other
# field is dropped, so that nothing unknown to this list reaches vLLM, whatever a later vLLM makes of it. Among the
# dropped: the agent's sampling parameters (temperature, top_p, top_k, min_p, penalties, logit_bias), replaced by the
# run's or by vLLM's neutral default (the trainer must see one distribution); agents send them without meaning harm
# (Aider sends temperature 0 to unknown models), so they are dropped, not refused.
LENGTH_KEYS = ("max_completion_tokens", "max_tokens")
"""The agent's length cap (the first present), honoured up to the run's ``max_tokens``: truncation leaves the
distribution of the tokens sampled as it was."""
_PASSED = {
    "common": {"model", "stream", "stream_options", "stop", "seed", "logprobs"},
    "chat": {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "response_format"},
    "completions": {"prompt"},
}
# Fields that would change the sampling distribution away from the run's, or the shape of a call (the prompt's
# logprobs, an echo), refused with a 400 naming them: an agent that sends one means it, and must learn that this
# server cannot honour it rather than get samples it did not ask for.
REFUSED = {
    "use_beam_search": "beam search is not sampling",
    "allowed_token_ids": "it masks the vocabulary",
    "bad_words": "it masks the vocabulary",
    "logits_processors": "it changes the logits",
    "min_tokens": "it masks the end of the answer",
    "ignore_eos": "it masks the end of the answer",
    "stop_token_ids": "it changes where answers end",
    "structured_outputs": "structured outputs constrain the sampling",
    "guided_json": "guided decoding constrains the sampling",
    "guided_regex": "guided decoding constrains the sampling",
    "guided_choice": "guided decoding constrains the sampling",
    "guided_grammar": "guided decoding constrains the sampling",
    "guided_decoding_backend": "guided decoding constrains the sampling",
    "guided_whitespace_pattern": "guided decoding constrains the sampling",
    "prompt_logprobs": "the prompt's logprobs are the trainer's (POST /weights/probe)",
    "vllm_xargs": "vLLM's free-form arguments could change anything",
    "echo": "the answer must be the sampled tokens only",
    "suffix": "the prompt must be the recorded one",
}
_FREE_TOOL_CHOICES = ("auto", "none")


# Fields vLLM adds for us; removed from what the agent receives.
_TOP_LEVEL_EXTRAS = ("prompt_token_ids", "prompt_text", "prompt_logprobs", "kv_transfer_params", "ec_transfer_params")
_CHOICE_EXTRAS = ("token_ids", "prompt_token_ids", "prompt_logprobs", "routed_experts")


@dataclass(frozen=True)
class AgentAsked:
    """What the agent itself asked for, so that only our additions are stripped from the reply."""

    logprobs: bool
    usage_in_stream: bool


def _refuse(param: str, why: str) -> ProxyError:
    message = f"'{param}' is not accepted: {why} (docs/serving.md)"
    return ProxyError(400, message, code="unsupported_parameter", param=param)


def _check_fields(body: dict[str, Any], endpoint: Endpoint) -> None:
    """400 for a refused field (``REFUSED``), a tool choice or response format that constrains the sampling, and
    anything but one prompt."""
    for name, why in REFUSED.items():
        if body.get(name):  # absent, false, 0 or empty: the neutral value, dropped
            raise _refuse(name, why)
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise ProxyError(400, "only n=1 is supported: each call is one step of one rollout", param="n")
    choice = body.get("tool_choice")
    if choice is not None and choice not in _FREE_TOOL_CHOICES:
        raise _refuse("tool_choice", "a forced tool call is guided decoding, which constrains the sampling")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise _refuse("response_format", "structured outputs constrain the sampling (only {'type': 'text'})")
    if endpoint == "completions":
        prompt = body.get("prompt")
        one = isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
        if not one or not prompt:
            raise ProxyError(400, "'prompt' is required: one string or one list of token ids", param="prompt")


def _length_cap(body: dict[str, Any], run_cap: int | None) -> int | None:
    """The ``max_tokens`` sent to vLLM: the agent's (``LENGTH_KEYS``), at most the run's; None: neither set one."""
    name = next((k for k in LENGTH_KEYS if body.get(k) is not None), None)
    if name is None:
        return run_cap
    asked = body[name]
    if not isinstance(asked, int) or isinstance(asked, bool) or asked < 1:
        raise ProxyError(400, f"'{name}' must be a positive integer", param=name)
    return asked if run_cap is None else min(asked, run_cap)


def prepare_request(
    body: Any, endpoint: Endpoint, sampling: dict[str, Any], model: str, token_ids: bool = True
) -> tuple[dict[str, Any], AgentAsked]:
    """Validate the agent's body and return what is sent to vLLM, with what the agent asked for; without
    ``token_ids`` (an upstream that is not vLLM) nothing vLLM-specific is asked for."""
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object")
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ProxyError(400, "'messages' is required and must be a non-empty list", param="messages")
        if not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ProxyError(400, "every message must be an object with a 'role'", param="messages")
    _check_fields(body, endpoint)

    asked_logprobs = bool(body.get("logprobs")) if endpoint == "chat" else body.get("logprobs") is not None
    stream_options = body.get("stream_options") or {}
    asked = AgentAsked(asked_logprobs, bool(stream_options.get("include_usage")))

    passed = _PASSED["common"] | _PASSED[endpoint]
    out = {k: v for k, v in body.items() if k in passed}
    out.update({k: v for k, v in sampling.items() if k != "max_tokens"})
    if (cap := _length_cap(body, sampling.get("max_tokens"))) is not None:
        out["max_tokens"] = cap
    out["model"] = model
    if token_ids:
        out["return_token_ids"] = True
        if endpoint == "chat":
            out["logprobs"] = True
        elif not asked.logprobs:
            out["logprobs"] = 0
    if out.get("stream"):
        out["stream_options"] = {**stream_options, "include_usage": True}
    return out, asked


def call_seed(rollout_seed: int, index: int) -> int:
    """The sampling seed of call ``index`` of a rollout opened with ``rollout_seed``: a 31-bit hash of both, so that no
    two calls share a seed by construction (vLLM samples a request with a seed from its own generator)."""
    return derived_seed(rollout_seed, index)


def strip_response(data: dict[str, Any], asked: AgentAsked) -> dict[str, Any]:
    """Remove the token ids / logprobs we requested (in place) and return the agent's view."""
    for key in _TOP_LEVEL_EXTRAS:
        data.pop(key, None)
    for choice in data.get("choices") or ():
        for key in _CHOICE_EXTRAS:
            choice.pop(key, None)
        if not asked.logprobs:
            choice.pop("logprobs", None)
    return data


def _choice_logprobs(choice: dict[str, Any], endpoint: Endpoint) -> list[float]:
    lp = choice.get("logprobs") or {}
    if endpoint == "chat":
        return [float(t["logprob"]) for t in lp.get("content") or ()]
    return [float(x) for x in lp.get("token_logprobs") or ()]


def _choice_text(choice: dict[str, Any], endpoint: Endpoint) -> str:
    if endpoint == "chat":
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


@dataclass
class CallOutput:
    """The model side of one call, as vLLM returned it."""

    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    message: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    response_id: str | None = None


def output_from_response(data: dict[str, Any], endpoint: Endpoint) -> CallOutput:
    """Extract ids, logprobs and text from a non-streamed vLLM response (before stripping)."""
    choice = (data.get("choices") or [{}])[0]
    return CallOutput(
        prompt_token_ids=list(data.get("prompt_token_ids") or choice.get("prompt_token_ids") or ()),
        completion_token_ids=list(choice.get("token_ids") or ()),
        logprobs=_choice_logprobs(choice, endpoint),
        text=_choice_text(choice, endpoint),
        finish_reason=choice.get("finish_reason"),
        message=choice.get("message") if endpoint == "chat" else None,
        usage=data.get("usage"),
        model=data.get("model"),
        response_id=data.get("id"),
    )


class StreamAccumulator:
    """Collects a streamed response chunk by chunk into one ``CallOutput``."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.out = CallOutput()
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._role = "assistant"

    def add(self, chunk: dict[str, Any]) -> None:
        out = self.out
        out.model = chunk.get("model", out.model)
        out.response_id = chunk.get("id", out.response_id)
        if chunk.get("prompt_token_ids"):
            out.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            out.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("prompt_token_ids"):
                out.prompt_token_ids = list(choice["prompt_token_ids"])
            out.completion_token_ids.extend(choice.get("token_ids") or ())
            out.logprobs.extend(_choice_logprobs(choice, self.endpoint))
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
            if self.endpoint == "completions":
                out.text += choice.get("text") or ""
                continue
            delta = choice.get("delta") or {}
            self._role = delta.get("role") or self._role
            out.text += delta.get("content") or ""
            for call in delta.get("tool_calls") or ():
                self._merge_tool_call(call)

    def _merge_tool_call(self, call: dict[str, Any]) -> None:
        slot = self._tool_calls.setdefault(call.get("index", 0), {"function": {"name": "", "arguments": ""}})
        for key in ("id", "type"):
            if call.get(key):
                slot[key] = call[key]
        fn = call.get("function") or {}
        slot["function"]["name"] += fn.get("name") or ""
        slot["function"]["arguments"] += fn.get("arguments") or ""

    def result(self) -> CallOutput:
        if self.endpoint == "chat":
            message: dict[str, Any] = {"role": self._role, "content": self.out.text}
            if self._tool_calls:
                message["tool_calls"] = [self._tool_calls[i] for i in sorted(self._tool_calls)]
            self.out.message = message
        return self.out


def parse_sse_line(line: str) -> dict[str, Any] | None:
    """The JSON payload of one ``data:`` line, or None for keep-alives, ``[DONE]`` and other lines."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)


def build_record(
    *,
    rollout_id: str,
    call_index: int,
    endpoint: Endpoint,
    request: dict[str, Any] | None,
    output: CallOutput | None,
    weight_version: int,
    started_at: float,
    ended_at: float,
    tag: str | None,
    status: int = 200,
    error: str | None = None,
    error_code: str | None = None,
    continuity: str | None = None,
    continued_from: int | None = None,
) -> dict[str, Any]:
    """One line of the journal: everything the trainer needs to rebuild the sampled tokens exactly. ``continuity``:
    how a chat call went (``aitlrt_server.continuity``); ``continued_from``: the index of the call whose prompt and
    completion tokens a continued call's prompt starts with."""
    out = output or CallOutput()
    return {
        "rollout_id": rollout_id,
        "call_index": call_index,
        "endpoint": endpoint,
        "tag": tag,
        "status": status,
        "error": error,
        "error_code": error_code,
        "weight_version": weight_version,
        "started_at": started_at,
        "ended_at": ended_at,
        "request": request,
        "prompt_token_ids": out.prompt_token_ids,
        "completion_token_ids": out.completion_token_ids,
        "logprobs": out.logprobs,
        "finish_reason": out.finish_reason,
        "text": out.text,
        "message": out.message,
        "usage": out.usage,
        "model": out.model,
        "response_id": out.response_id,
        "continuity": continuity,
        "continued_from": continued_from,
    }

"""Token continuity: a rollout's chat call whose messages extend its previous call's continues that call's tokens.

A chat template does not give back the tokens a model sampled: it renders an answer's text, whose tokens need not be the
sampled ones (a model samples splits of a word other than the tokenizer's, an answer cut at its length ends on a part of
a word), and a template may change the answer or end the turn otherwise. So when a call's messages are the previous
call's messages (of the same rollout and tag), then an assistant message whose content is the text that call sampled,
then new messages, the proxy does not have vLLM render the history again: it sends ``/v1/completions`` a token-id prompt
made of the previous call's exact prompt and completion token ids, the rest of the assistant turn as the template ends
it (what the completion did not sample itself), and the new messages as the template renders them after that turn, with
the generation prompt; the agent gets a chat completion (``chat_response``). A training row (``aitlrt.training.rows``)
then runs on across the call. Anything else (a message dropped or edited, tools, a stream, top logprobs, ...) takes the
ordinary path: a new row, its reason counted (``aitlrt_continuity_total``) and recorded with the call (``continuity``).

Rendering is the served model's chat template through its Hugging Face tokenizer, as vLLM renders a chat prompt
(text, then tokens without special tokens added). A chain starts only from a call whose prompt vLLM rendered exactly as
this renderer does, so a template or tokenizer that differs from vLLM's never continues anything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONTINUED = "continued"
"""The ``continuity`` of a continued call; any other value is why the call took the ordinary path."""
OFF = "off"
"""Continuity switched off (``aitlrt-serve --no-continuity``, or an upstream that is not vLLM)."""
_ROLES = {"system", "user", "assistant"}
_ENDINGS = ("stop", "length")
_COMPLETION_KEYS = ("model", "stop", "seed", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""What a continued call passes from the chat body to ``/v1/completions`` (besides the prompt and the length)."""


@dataclass(frozen=True)
class Continuation:
    """A continued call: the previous call it continues and the token-id prompt sent to vLLM."""

    base_index: int
    prompt_token_ids: list[int]
    rendered: int
    """Tokens rendered for this call: the end of the previous assistant turn and the new messages."""


def request_obstacle(body: dict[str, Any]) -> str | None:
    """Why a chat request (as the proxy sends it upstream) cannot be continued whatever came before, or None."""
    if body.get("stream"):
        return "stream"
    if body.get("tools") or body.get("tool_choice") not in (None, "none"):
        return "tools"
    if body.get("top_logprobs"):
        return "top_logprobs"
    for message in body["messages"]:
        if message.get("role") not in _ROLES or message.get("tool_calls") or message.get("function_call"):
            return "message_role"
        if not isinstance(message.get("content"), str) or message.get("reasoning") or message.get("reasoning_content"):
            return "message_content"
    return None


def find_base(calls: Sequence[dict[str, Any]] | None, tag: str | None) -> dict[str, Any] | None:
    """The last answered chat call among ``calls`` with the same ``tag`` (Aider's weak-model calls continue their
    own), or None."""
    for call in reversed(calls or ()):
        if call.get("tag") == tag and call.get("endpoint") == "chat" and call.get("status") == 200:
            return call
    return None


def base_obstacle(base: dict[str, Any]) -> str | None:
    """Why the recorded call ``base`` cannot be continued, or None."""
    request = base.get("request") or {}
    ids, logprobs = base.get("completion_token_ids") or [], base.get("logprobs") or []
    if not base.get("prompt_token_ids") or not ids or len(ids) != len(logprobs):
        return "previous_tokens"
    if request.get("tools") or (base.get("message") or {}).get("tool_calls"):
        return "tools"
    if base.get("finish_reason") not in _ENDINGS:
        return "previous_finish"
    return None


def new_messages(base: dict[str, Any], messages: list[dict[str, Any]]) -> list[dict[str, Any]] | str:
    """The messages after ``base``'s answer when ``messages`` extend ``base``'s exactly (its messages, then an
    assistant message with the text it sampled), else why not."""
    before = (base.get("request") or {}).get("messages") or []
    if len(messages) <= len(before) or messages[: len(before)] != before:
        return "history_rewritten"
    answer = messages[len(before)]
    if answer.get("role") != "assistant" or answer.get("content") != base.get("text"):
        return "answer_rewritten"
    return messages[len(before) + 1 :]


class ChatRenderer:
    """The served model's chat template and tokenizer, rendering as vLLM does for plain-text messages."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @classmethod
    def load(cls, source: str, chat_template: str | None = None) -> ChatRenderer:
        """The tokenizer at ``source`` (a folder or a Hub id in the local cache); ``chat_template``: vLLM's
        ``--chat-template`` (a file or the template itself), if it was started with one."""
        from transformers import AutoTokenizer

        if chat_template is not None and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text()
        return cls(AutoTokenizer.from_pretrained(source), chat_template)

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        # vLLM's conversation keeps a message's role, its content and its name (``parse_chat_messages``)
        conversation = [
            {k: m[k] for k in ("role", "content", "name") if k in m and (k != "name" or isinstance(m[k], str))}
            for m in messages
        ]
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            chat_template=self.chat_template,
        )
        if not isinstance(text, str):
            raise TypeError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


def continued_prompt(
    renderer: ChatRenderer, base: dict[str, Any], messages: list[dict[str, Any]], root: bool
) -> tuple[list[int], int] | str:
    """The token-id prompt of a call whose ``messages`` extend ``base``'s (``new_messages``), and how many of its
    tokens were rendered here; else why not. ``root``: ``base`` was not continued itself, so its prompt is vLLM's
    rendering of its messages, which must equal this renderer's."""
    before = base["request"]["messages"]
    prompt, completion = list(base["prompt_token_ids"]), list(base["completion_token_ids"])
    asking = renderer.render(before, True)
    if root and renderer.encode(asking) != prompt:
        return "template_mismatch"
    turn = renderer.render(messages[: len(before) + 1], False)
    full = renderer.render(messages, True)
    if not turn.startswith(asking) or not full.startswith(turn):
        return "template_rerenders"  # an earlier turn rendered otherwise once more messages follow it
    text = base["text"]
    answer = turn[len(asking) :]
    sampled = renderer.decode(completion)
    if not answer.startswith(text) or not sampled.startswith(text):
        return "answer_rendered"  # the template changes the answer's text (trimmed?), or it did not decode to it
    ending, sampled_ending = answer[len(text) :], sampled[len(text) :]
    if not ending.startswith(sampled_ending):
        return "answer_ending"  # it ended on something the template does not end a turn with (a stop string)
    rendered = renderer.encode(ending[len(sampled_ending) :] + full[len(turn) :])
    return prompt + completion + rendered, len(rendered)


def completion_body(chat_body: dict[str, Any], prompt_ids: list[int], max_model_len: int | None) -> dict[str, Any]:
    """The ``/v1/completions`` body of a continued call from the chat body the ordinary path would send; without a
    length cap it may fill the context, as vLLM's chat route would (its completions route would stop at 16)."""
    out: dict[str, Any] = {k: chat_body[k] for k in _COMPLETION_KEYS if k in chat_body}
    out["prompt"] = prompt_ids
    if chat_body.get("max_tokens") is not None:
        out["max_tokens"] = chat_body["max_tokens"]
    elif max_model_len is not None:
        out["max_tokens"] = max_model_len - len(prompt_ids)
    out["logprobs"] = 0
    out["return_token_ids"] = True
    return out


def _chat_logprobs(logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A completion's sampled-token logprobs in a chat completion's form (no top logprobs)."""
    if not logprobs:
        return None
    content = [
        {
            "token": token,
            "logprob": -9999.0 if logprob is None else logprob,
            "bytes": list(token.encode("utf-8", errors="replace")),
            "top_logprobs": [],
        }
        for token, logprob in zip(logprobs.get("tokens") or (), logprobs.get("token_logprobs") or (), strict=True)
    ]
    return {"content": content}


def chat_response(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` answer to a continued call as its ``/v1/chat/completions`` answer (before the
    proxy strips its extras): the same fields, the text as the assistant message's content."""
    choice = (data.get("choices") or [{}])[0]
    response_id = str(data.get("id") or "")
    message = {
        "role": "assistant",
        "content": choice.get("text") or "",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "id": "chatcmpl-" + response_id.removeprefix("cmpl-"),
        "object": "chat.completion",
        "created": data.get("created"),
        "model": data.get("model"),
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _chat_logprobs(choice.get("logprobs")),
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": choice.get("token_ids"),
                "routed_experts": choice.get("routed_experts"),
            }
        ],
        "service_tier": data.get("service_tier"),
        "system_fingerprint": data.get("system_fingerprint"),
        "usage": data.get("usage"),
        "prompt_logprobs": None,
        "prompt_token_ids": choice.get("prompt_token_ids"),
        "prompt_text": None,
        "kv_transfer_params": data.get("kv_transfer_params"),
        "ec_transfer_params": data.get("ec_transfer_params"),
        "metrics": data.get("metrics"),
    }


class Continuity:
    """The proxy's continuity: a renderer loaded on first use (on one thread of its own, as every rendering)."""

    def __init__(self, source: str | None = None, chat_template: str | None = None) -> None:
        """``source``: the served model's tokenizer (a folder or Hub id); None: the model folder vLLM reports
        (``/v1/models``' ``root``), if it is on this machine."""
        self.source, self.chat_template = source, chat_template
        self._renderer: ChatRenderer | None = None
        self._failed = False
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="continuity")

    async def renderer(self, root: str | None) -> ChatRenderer | None:
        """The renderer, loaded from ``source`` (else ``root``) once; None if it cannot be (logged once)."""
        async with self._lock:
            if self._renderer is None and not self._failed:
                source = self.source or (root if root and Path(root).is_dir() else None)
                if source is None:
                    log.warning(
                        "token continuity off: vLLM's model %r is not a folder here (--continuity-tokenizer)", root
                    )
                    self._failed = True
                    return None
                try:
                    loop = asyncio.get_running_loop()
                    self._renderer = await loop.run_in_executor(
                        self._thread, ChatRenderer.load, source, self.chat_template
                    )
                except Exception as exc:
                    log.warning("token continuity off: cannot load the tokenizer of %s (%s)", source, exc)
                    self._failed = True
        return self._renderer

    async def plan(
        self, calls: Sequence[dict[str, Any]] | None, body: dict[str, Any], tag: str | None, root: str | None
    ) -> Continuation | str:
        """How a chat call with upstream ``body`` goes: continued from the rollout's recorded ``calls``, or why not
        (a reason for the metrics and the record)."""
        if (why := request_obstacle(body)) is not None:
            return why
        base = find_base(calls, tag)
        if base is None:
            return "first_call"
        if (why := base_obstacle(base)) is not None:
            return why
        if base["request"].get("model") != body.get("model"):
            return "model"
        if isinstance(after := new_messages(base, body["messages"]), str):
            return after
        renderer = await self.renderer(root)
        if renderer is None:
            return "no_tokenizer"
        root_call = base.get("continued_from") is None
        loop = asyncio.get_running_loop()
        try:
            planned = await loop.run_in_executor(
                self._thread, continued_prompt, renderer, base, body["messages"], root_call
            )
        except Exception as exc:  # a template that refuses these messages: vLLM will say so on the ordinary path
            log.info("token continuity: rendering failed (%s: %s)", type(exc).__name__, exc)
            return "render_error"
        if isinstance(planned, str):
            return planned
        prompt_ids, rendered = planned
        return Continuation(base["call_index"], prompt_ids, rendered)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

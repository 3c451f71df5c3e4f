"""Training rows from a rollout's recorded calls: exact sampled tokens, never re-tokenised.

A call whose prompt extends the current row's tokens (prompt + everything appended so far) is appended to that
row: the new prompt tokens as context (mask 0), then its sampled tokens (mask 1). Any other call (Aider's
summaries rewrite the history; the chat template may re-render an earlier answer differently from what was
sampled) starts a new row; aitlrt-serve's token continuity (``aitlrt_server.continuity``) sends a call that extends
the previous one as that call's exact tokens plus the new messages, so an append-only history stays one row (its
records say so in ``continuity`` and ``continued_from``). Calls that failed, or that are not the policy's main turn
(tagged, e.g. ``weak``), are skipped unless asked for.

A row longer than ``max_length`` is split into windows, so that every sampled token is still trained exactly
once: each window trains the next chunk of the row (from a sampled token to a sampled token) and carries as
``prompt_ids`` the true preceding tokens, as many as fit (at least ``context`` of them where the row has that
many), so it is scored on the sequence it was sampled from, cut at the front. A call whose prompt alone exceeds
``max_length`` is no exception: its sampled tokens are trained after the last tokens of its prompt, as in every
later window of a long row. Nothing is dropped; the trainer's logprob of a token whose context was cut differs
from the sampler's (the importance-sampling weight and ``logprob_gap`` see it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Row:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """1 on tokens the policy sampled, 0 on context that arrived between calls."""
    logprobs: list[float] = field(default_factory=list)
    """Sampler logprobs on sampled tokens, 0.0 on context."""
    weight_versions: set[int] = field(default_factory=set)
    calls: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def sampled(self) -> int:
        return sum(self.mask)

    def append(self, context: list[int], completion: list[int], logprobs: list[float], version: int) -> None:
        self.completion_ids += context + completion
        self.mask += [0] * len(context) + [1] * len(completion)
        self.logprobs += [0.0] * len(context) + list(logprobs)
        self.weight_versions.add(version)
        self.calls += 1


@dataclass
class RowStats:
    calls: int = 0
    used_calls: int = 0
    skipped_failed: int = 0
    """Calls that failed or came without a logprob per sampled token."""
    skipped_tagged: int = 0
    skipped_unscorable: int = 0
    """Calls of rollouts that failed outside the policy (set by the trainer, which skips those rollouts)."""
    new_rows: int = 0
    split_rows: int = 0
    """Rows longer than ``max_length``, split into windows."""
    windows: int = 0
    """The rows those became."""

    def add(self, other: RowStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


Span = tuple[int, int, int]
"""A call's sampled tokens in its row's ``tokens``: start, end, weight version."""


def _usable(call: dict[str, Any]) -> bool:
    ids, logprobs = call.get("completion_token_ids"), call.get("logprobs") or []
    return bool(call.get("status", 200) == 200 and call.get("prompt_token_ids") and ids and len(ids) == len(logprobs))


def build_rows(
    calls: Iterable[dict[str, Any]],
    max_length: int | None = None,
    include_tagged: bool = False,
    context: int | None = None,
) -> tuple[list[Row], RowStats]:
    """Rows of one rollout from its recorded calls (in call order), each at most ``max_length`` tokens; a longer
    row becomes windows with at least ``context`` tokens of context (default: half of ``max_length``)."""
    if max_length is not None:
        context = max_length // 2 if context is None else context
        if not 1 <= context < max_length:
            raise ValueError(f"need 1 <= context < max_length, got context={context}, max_length={max_length}")
    stats = RowStats()
    chains: list[tuple[Row, list[Span]]] = []
    for call in sorted(calls, key=lambda c: c["call_index"]):
        stats.calls += 1
        if not _usable(call):
            stats.skipped_failed += 1
            continue
        if call.get("tag") and not include_tagged:
            stats.skipped_tagged += 1
            continue
        stats.used_calls += 1
        prompt, completion = list(call["prompt_token_ids"]), list(call["completion_token_ids"])
        held = chains[-1][0].tokens if chains else []
        if chains and len(prompt) >= len(held) and prompt[: len(held)] == held:
            row, spans = chains[-1]
            row.append(prompt[len(held) :], completion, call["logprobs"], call["weight_version"])
        else:
            row, spans = Row(prompt), []
            row.append([], completion, call["logprobs"], call["weight_version"])
            chains.append((row, spans))
            stats.new_rows += 1
        spans.append((len(prompt), len(prompt) + len(completion), call["weight_version"]))
    rows: list[Row] = []
    for row, spans in chains:
        if max_length is None or context is None or len(row.tokens) <= max_length:
            rows.append(row)
            continue
        windows = _windows(row, spans, max_length, context)
        stats.split_rows += 1
        stats.windows += len(windows)
        rows += windows
    return rows, stats


def _windows(row: Row, spans: list[Span], max_length: int, context: int) -> list[Row]:
    """``row`` as consecutive windows of at most ``max_length`` tokens (see the module docstring)."""
    tokens, offset = row.tokens, len(row.prompt_ids)
    sampled = [0] * offset + row.mask
    windows, start = [], offset
    while (start := next((i for i in range(start, len(tokens)) if sampled[i]), len(tokens))) < len(tokens):
        end = min(len(tokens), start + max_length - min(context, start))
        while not sampled[end - 1]:
            end -= 1
        inside = [version for first, last, version in spans if first < end and last > start]
        chunk = slice(start - offset, end - offset)
        windows.append(
            Row(
                tokens[max(0, end - max_length) : start],
                row.completion_ids[chunk],
                row.mask[chunk],
                row.logprobs[chunk],
                set(inside),
                len(inside),
            )
        )
        start = end
    return windows


def rollout_rows(
    traces: list[list[dict[str, Any]]],
    skip: set[int],
    max_length: int | None = None,
    include_tagged: bool = False,
) -> tuple[list[Row], list[int], RowStats]:
    """The rows of several rollouts (``traces``: each one's recorded calls; those in ``skip``, by index, give none:
    unscorable), each row's rollout, and the counts."""
    rows, owners, stats = [], [], RowStats()
    for i, trace in enumerate(traces):
        if i in skip:
            stats.skipped_unscorable += len(trace)
            continue
        built, s = build_rows(trace, max_length, include_tagged)
        stats.add(s)
        rows += built
        owners += [i] * len(built)
    return rows, owners, stats


def truncated_rollouts(traces: list[list[dict[str, Any]]], include_tagged: bool = False) -> set[int]:
    """The rollouts (by index) of which a trained call was cut at ``max_completion_length`` (finish reason
    ``length``): under ``mask_truncated_completions`` they get no loss, as trl's truncated completions."""
    return {
        i
        for i, trace in enumerate(traces)
        if any(call.get("finish_reason") == "length" and (include_tagged or not call.get("tag")) for call in trace)
    }

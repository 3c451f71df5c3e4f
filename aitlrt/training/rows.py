"""Training rows from a rollout's recorded calls: exact sampled tokens, never re-tokenised.

A call whose prompt extends the current row's tokens (prompt + everything appended so far) is appended to that
row: the new prompt tokens as context (mask 0), then its sampled tokens (mask 1). Any other call (Aider's
summaries rewrite the history; the chat template may re-render an earlier answer differently from what was
sampled) starts a new row. Calls that failed, or that are not the policy's main turn (tagged, e.g. ``weak``),
are skipped unless asked for. Rows longer than ``max_length`` lose their tail (the mask stays aligned); a row
whose prompt alone is too long is dropped. Both are counted.
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
    skipped_tagged: int = 0
    new_rows: int = 0
    truncated_rows: int = 0
    truncated_tokens: int = 0
    dropped_rows: int = 0

    def add(self, other: RowStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def _usable(call: dict[str, Any]) -> bool:
    ids, logprobs = call.get("completion_token_ids"), call.get("logprobs") or []
    return bool(call.get("status", 200) == 200 and call.get("prompt_token_ids") and ids and len(ids) == len(logprobs))


def build_rows(
    calls: Iterable[dict[str, Any]], max_length: int | None = None, include_tagged: bool = False
) -> tuple[list[Row], RowStats]:
    """Rows of one rollout from its recorded calls (in call order)."""
    stats = RowStats()
    rows: list[Row] = []
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
        current = rows[-1] if rows else None
        held = current.tokens if current else []
        if current and len(prompt) >= len(held) and prompt[: len(held)] == held:
            current.append(prompt[len(held) :], completion, call["logprobs"], call["weight_version"])
        else:
            row = Row(prompt)
            row.append([], completion, call["logprobs"], call["weight_version"])
            rows.append(row)
            stats.new_rows += 1
    return [r for r in (_fit(r, max_length, stats) for r in rows) if r is not None], stats


def _fit(row: Row, max_length: int | None, stats: RowStats) -> Row | None:
    if max_length is None or len(row.tokens) <= max_length:
        return row
    room = max_length - len(row.prompt_ids)
    if room <= 0 or sum(row.mask[:room]) == 0:
        stats.dropped_rows += 1
        return None
    stats.truncated_rows += 1
    stats.truncated_tokens += len(row.completion_ids) - room
    row.completion_ids, row.mask, row.logprobs = row.completion_ids[:room], row.mask[:room], row.logprobs[:room]
    return row

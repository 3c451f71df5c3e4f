"""The rows ``aitlrt sft`` trains on: one JSON line per model call (``aitlrt trajectories`` writes them), in trl's
conversational prompt-completion form, validated before any model loads: a bad row is refused with its file, line
and field, not met as a tokenizer error minutes into a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

ChatRow = dict[str, Any]
"""``{"prompt": messages, "completion": [the assistant's answer], "rollout_id": str | None, "call_index": int |
None}``, each message ``{"role", "content"}``; the rollout and call say which rows are one conversation's calls
(``merge_rollout_calls``)."""


class SftDataError(ValueError):
    """The trajectory file cannot be trained on; the message names the file, line and field."""


class Message(BaseModel):
    """A chat message, reduced to what the chat template reads (other keys, such as ``name``, are dropped)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str = Field(strict=True)


class SftRow(BaseModel):
    """One model call: what the agent sent and the answer to train on, and which rollout's call it is (optional).
    Other columns (``instance_id``, ``reward``, ``teacher``, ...) are the writer's bookkeeping and are dropped."""

    model_config = ConfigDict(extra="ignore")

    prompt: list[Message] = Field(min_length=1)
    completion: list[Message]
    rollout_id: str | None = None
    call_index: int | None = None

    @field_validator("completion")
    @classmethod
    def _one_answer(cls, completion: list[Message]) -> list[Message]:
        if len(completion) != 1 or completion[0].role != "assistant" or not completion[0].content.strip():
            raise PydanticCustomError("one_answer", "must be one non-empty assistant message (the answer to train on)")
        return completion

    def chat(self) -> ChatRow:
        """The row as trl's ``SFTTrainer`` takes it, with its rollout and call."""
        return self.model_dump(include={"prompt", "completion", "rollout_id", "call_index"})


def _field(loc: tuple[int | str, ...]) -> str:
    """A pydantic location as ``prompt[0].content``; ``the row`` for the row itself."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    return text or "the row"


def parse_row(line: str, where: str) -> ChatRow:
    """One JSON line as a ``ChatRow``; ``SftDataError`` naming ``where`` (file and line) and the field."""
    try:
        return SftRow.model_validate_json(line).chat()
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise SftDataError(f"{where}: not JSON ({first['ctx'].get('error', first['msg'])})") from None
        got = "" if first["type"] == "missing" else f" (got {first['input']!r:.120})"
        raise SftDataError(f"{where}: {_field(first['loc'])}: {first['msg']}{got}") from None


def load_sft_rows(path: str | Path) -> list[ChatRow]:
    """The rows of a trajectory file (blank lines skipped); ``SftDataError`` for a missing or empty file or the
    first bad row."""
    path = Path(path)
    if not path.is_file():
        raise SftDataError(f"{path}: no such file")
    with path.open(encoding="utf-8") as lines:
        rows = [parse_row(line, f"{path} line {number}") for number, line in enumerate(lines, 1) if line.strip()]
    if not rows:
        raise SftDataError(f"{path}: no rows (an empty file); write it with `aitlrt trajectories`")
    return rows

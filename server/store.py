"""Per-rollout call records: in memory for the trainer, and in an append-only JSONL journal that
survives a proxy crash (reloaded on start: a line that is not a record, such as a torn last line, is skipped with a
warning, and the next record starts on a line of its own)."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

UNATTRIBUTED = "_unattributed"
ROLLOUT_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
JOURNAL_NAME = "calls.jsonl"
CLOSED_KEPT = 65_536
"""Deleted rollout ids remembered as closed (a late call of an older one is recorded as a new rollout)."""

log = logging.getLogger(__name__)


class Life:
    """One opening of a rollout id, from its first call until it is deleted: hands out call indices. Compared by
    identity, so a call knows whether the rollout it started in still exists (``TraceStore.add``)."""

    __slots__ = ("next_index",)

    def __init__(self) -> None:
        self.next_index = 0


def valid_rollout_id(rollout_id: str) -> bool:
    return bool(ROLLOUT_ID_RE.match(rollout_id)) and rollout_id not in {".", ".."}


def _entry(line: bytes) -> dict[str, Any] | None:
    """A journal line as its entry (a call record or a ``{"deleted": id}`` tombstone); None if it is neither."""
    try:
        entry = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(entry, dict):
        return None
    if "deleted" in entry:
        return entry if isinstance(entry["deleted"], str) else None
    rid, index = entry.get("rollout_id"), entry.get("call_index")
    valid = isinstance(rid, str) and isinstance(index, int) and not isinstance(index, bool)
    return entry if valid else None


class TraceStore:
    """Records of every proxied call, grouped by rollout id.

    The journal holds one JSON object per line: a call record, or ``{"deleted": id}`` tombstone.
    Call indices are assigned when a call starts, so concurrent calls of one rollout keep their order.
    """

    def __init__(self, run_dir: Path | None) -> None:
        self._records: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._lives: dict[str, Life] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._journal = None
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            path = run_dir / JOURNAL_NAME
            torn = path.exists() and self._replay(path)
            self._journal = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the store
            if torn:  # else the next record would be glued onto the torn line and lost with it at the next reload
                self._journal.write("\n")
                self._journal.flush()

    def _replay(self, path: Path) -> bool:
        """Reload the journal at ``path``, skipping (with one warning) the lines that are not records; whether its
        last line lacks its newline (a torn write)."""
        loaded, line = 0, b"\n"
        skipped: list[int] = []
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                entry = _entry(line)
                if entry is None:
                    skipped.append(lineno)
                elif "deleted" in entry:
                    self._drop(entry["deleted"])
                else:
                    self._add(entry)
                    loaded += 1
        if skipped:
            log.warning("journal %s: skipped %d line(s) that are not records (torn writes?): line %s",
                        path, len(skipped), ", ".join(map(str, skipped[:10])))  # fmt: skip
        log.info("journal %s: reloaded %d calls of %d rollouts", path, loaded, len(self._records))
        return not line.endswith(b"\n")

    def start_call(self, rollout_id: str) -> tuple[int, Life]:
        """The next call's index in ``rollout_id`` and the rollout's current ``Life`` (a new one after a delete), so
        that a call still running when the rollout is deleted is not recorded afterwards (``add``)."""
        life = self._lives.setdefault(rollout_id, Life())
        life.next_index += 1
        return life.next_index - 1, life

    def _add(self, record: dict[str, Any]) -> None:
        rid = record["rollout_id"]
        calls = self._records[rid]
        calls.append(record)
        if len(calls) > 1 and calls[-2]["call_index"] > record["call_index"]:
            calls.sort(key=lambda r: r["call_index"])
        life = self._lives.setdefault(rid, Life())
        life.next_index = max(life.next_index, record["call_index"] + 1)

    def _drop(self, rollout_id: str) -> bool:
        self._lives.pop(rollout_id, None)
        return self._records.pop(rollout_id, None) is not None

    def _append(self, entry: dict[str, Any]) -> None:
        if self._journal is not None:
            self._journal.write(json.dumps(entry, separators=(",", ":")) + "\n")
            self._journal.flush()

    def add(self, record: dict[str, Any], life: Life | None = None) -> bool:
        """Keep a finished call: journal first, then memory. A call started in an earlier ``life`` of its rollout
        (``start_call``; deleted or opened again while the call ran: its trace was read already) is dropped."""
        rid = record["rollout_id"]
        if life is not None and self._lives.get(rid) is not life:
            log.info(
                "call %d of rollout %s ended after the rollout was deleted: not recorded", record["call_index"], rid
            )
            return False
        self._append(record)
        self._add(record)
        return True

    def get(self, rollout_id: str) -> list[dict[str, Any]] | None:
        return self._records.get(rollout_id)

    def close_rollout(self, rollout_id: str) -> None:
        """Refuse later calls of ``rollout_id`` (``is_closed``) until it is opened again (``reopen``): an agent's
        background call (Aider's chat summary in a warm worker) can arrive after its rollout was read and deleted."""
        self._closed[rollout_id] = None
        self._closed.move_to_end(rollout_id)
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)

    def reopen(self, rollout_id: str) -> None:
        self._closed.pop(rollout_id, None)

    def is_closed(self, rollout_id: str) -> bool:
        return rollout_id in self._closed

    def delete(self, rollout_id: str) -> bool:
        """Forget ``rollout_id`` (a tombstone in the journal); whether it had calls, finished or running."""
        if rollout_id not in self._records and rollout_id not in self._lives:
            return False
        self._append({"deleted": rollout_id})
        self._drop(rollout_id)
        return True

    def summary(self) -> dict[str, int]:
        """Rollout id -> number of recorded calls."""
        return {rid: len(calls) for rid, calls in self._records.items()}

    def close(self) -> None:
        if self._journal is not None:
            self._journal.flush()
            os.fsync(self._journal.fileno())
            self._journal.close()
            self._journal = None

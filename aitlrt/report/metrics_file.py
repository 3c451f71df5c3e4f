"""``OUTPUT/metrics.jsonl``: one JSON line per logged step (``aitlrt.report.metrics_log.MetricsLog`` writes it, for
a GRPO run and an SFT run alike), read back by the run report and the benches with ``read_metrics``. Kept apart
from the callback so that reading a run needs no transformers."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aitlrt.report import metric_names as names

log = logging.getLogger(__name__)


def json_safe(v: Any) -> Any:
    """JSON-safe: NaN and infinities become null (strict JSON), other non-JSON values their ``str``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if v is None or isinstance(v, bool | int | float | str) else str(v)


def metrics_line(logs: Mapping[str, Any], step: int, elapsed_s: float) -> str:
    """One entry: ``logs`` made JSON-safe, with ``step`` and ``elapsed_s`` (ms resolution)."""
    entry = {k: json_safe(v) for k, v in logs.items()} | {names.STEP: step, names.ELAPSED: round(elapsed_s, 3)}
    return json.dumps(entry) + "\n"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The entries of a ``metrics.jsonl`` merged per step (a later entry's values win), by step; [] without the
    file. A line that is not JSON (a run killed mid-write) is skipped with a warning."""
    if not path.exists():
        return []
    merged: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: not JSON, skipped", path, n)
            continue
        merged.setdefault(int(entry.get(names.STEP, 0)), {}).update(entry)
    return [merged[s] for s in sorted(merged)]

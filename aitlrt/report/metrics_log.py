"""Every logged step of a training run as one JSON line in ``OUTPUT/metrics.jsonl``: the values trl's ``report_to``
gets, for the run report (``aitlrt.report.html``, which reads them with ``read_metrics``) without wandb."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from aitlrt.report.html import read_metrics

log = logging.getLogger(__name__)


def _value(v: Any) -> Any:
    """JSON-safe: NaN and infinities become null (strict JSON), other non-JSON values their ``str``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v if v is None or isinstance(v, bool | int | float | str) else str(v)


class MetricsLog(TrainerCallback):
    """Appends each ``on_log`` dict, with ``step`` = the global step, to ``path`` on the main process.

    At the start of training the file is emptied, or on a resumed run cut back to the steps up to the resumed
    one (those after it will be logged again)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        kept = [e for e in read_metrics(self.path) if e["step"] <= state.global_step] if state.global_step else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(e) + "\n" for e in kept))
        log.info("logging metrics to %s (%d earlier steps kept)", self.path, len(kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        entry = {k: _value(v) for k, v in logs.items()} | {"step": state.global_step}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")

"""Every logged step of a training run, GRPO (``aitlrt/train.py``) or SFT (``aitlrt sft``), as one JSON line in a
metrics file (``aitlrt.report.metrics_file``): the values trl's ``report_to`` gets, for the run report and the
benches, without wandb."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from transformers import TrainerCallback

from aitlrt.report.metrics_file import metrics_line, read_metrics

log = logging.getLogger(__name__)


class MetricsLog(TrainerCallback):
    """Appends each ``on_log`` dict, with ``step`` = the global step and ``elapsed_s`` = the seconds since the
    training (this process) started, to ``path`` on the main process.

    At the start of training the file is emptied, or on a resumed run cut back to the steps up to the resumed
    one (those after it will be logged again)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.started = time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.monotonic()
        if not state.is_world_process_zero:
            return
        kept = [e for e in read_metrics(self.path) if e["step"] <= state.global_step] if state.global_step else []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(e) + "\n" for e in kept))
        log.info("logging metrics to %s (%d earlier steps kept)", self.path, len(kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.write(metrics_line(logs, state.global_step, time.monotonic() - self.started))

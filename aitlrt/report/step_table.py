"""Console output of a training run: one table row per logged step, apart from the progress display.

On a terminal the progress bar stays at the bottom and each row is printed above it (``write_line``); trl's raw
dict of every logged value is not printed (the table shows them). Where the console is a file or a pipe (a batch
job's log, ``| tee``), a bar cannot redraw in place: each redraw would be appended to the line of the row before
it, so there is no bar and each row ends with the progress it would have shown (steps done, minutes left)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from aitlrt.common.logs import write_line
from aitlrt.report import metric_names as m

Column = tuple[str, str, str]
"""(header, logged key, format of the cell)."""

COLUMNS: tuple[Column, ...] = (
    ("step", m.STEP, "{:>5.0f}"),
    ("reward", m.REWARD, "{:>7.3f}"),
    ("resolve", m.RESOLVE_RATE, "{:>7.2f}"),
    ("simil.", m.SIMILARITY, "{:>7.3f}"),
    ("patch", m.EDIT_RATE, "{:>6.2f}"),
    ("ok", m.ROLLOUTS_OK, "{:>5.2f}"),
    ("unsc.", m.ROLLOUTS_UNSCORABLE, "{:>5.0f}"),
    ("calls", m.CALLS_MEAN, "{:>6.1f}"),
    ("tokens", m.COMPLETION_TOKENS_MEAN, "{:>7.0f}"),
    ("rows", m.ROWS, "{:>5.0f}"),
    ("split", m.ROWS_SPLIT, "{:>5.0f}"),
    ("0-var", m.ZERO_VARIANCE_GROUPS, "{:>5.0f}"),
    ("inf.", m.INFORMATIVE_GROUPS, "{:>4.0f}"),
    ("rnd", m.ROUNDS, "{:>3.0f}"),
    ("skip", m.SKIPPED_UPDATE, "{:>4.0f}"),
    ("lp gap", m.LOGPROB_GAP_MEAN, "{:>7.3f}"),
    ("loss", m.LOSS, "{:>8.4f}"),
    ("roll s", m.TIME_ROLLOUTS, "{:>7.1f}"),
    ("busy s", m.TIME_MODEL_BUSY, "{:>7.1f}"),
    ("agent s", m.TIME_AGENT_OUTSIDE_CALLS, "{:>7.1f}"),
    ("rew s", m.TIME_REWARDS, "{:>6.1f}"),
    ("upd s", m.TIME_UPDATE, "{:>6.1f}"),
    ("sync s", m.TIME_SYNC, "{:>6.1f}"),
    ("step s", m.TIME_STEP, "{:>6.1f}"),
    ("mem GiB", m.MEMORY_PEAK, "{:>7.1f}"),
    ("wv", m.WEIGHT_VERSION, "{:>3.0f}"),
)
"""The GRPO run's table (a row per log that has ``reward``)."""

SFT_COLUMNS: tuple[Column, ...] = (
    ("step", m.STEP, "{:>5.0f}"),
    ("loss", m.LOSS, "{:>8.4f}"),
    ("grad", m.GRAD_NORM, "{:>7.3f}"),
    ("lr", "learning_rate", "{:>9.2e}"),
    ("tok acc", "mean_token_accuracy", "{:>7.3f}"),
    ("entropy", "entropy", "{:>7.3f}"),
    ("tokens", m.NUM_TOKENS, "{:>8.0f}"),
    ("epoch", "epoch", "{:>6.2f}"),
)
"""The warm start's (``aitlrt sft``) table (a row per log that has ``loss``)."""


class StepTable(TrainerCallback):
    """Prints a header once and a row per ``on_log`` that has ``key``, on the main process, above the progress bar
    (missing values show as ``-``); with ``progress`` (no bar) each row ends with the steps done and the minutes
    left at the mean pace so far."""

    def __init__(self, columns: Sequence[Column] = COLUMNS, key: str = m.REWARD, progress: bool = False) -> None:
        self.columns, self.key, self.progress = tuple(columns), key, progress
        self._header = False
        self._started: float | None = None
        self._first_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._started, self._first_step = time.monotonic(), state.global_step  # a resumed run: its own pace

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or self.key not in logs:
            return
        values = {**logs, m.STEP: state.global_step}
        if not self._header:
            names = [f"{name:>{len(fmt.format(0))}}" for name, _, fmt in self.columns]
            write_line(" ".join(names + (["     done  min left"] if self.progress else [])))
            self._header = True
        cells = []
        for _, key, fmt in self.columns:
            width = len(fmt.format(0))
            cells.append(fmt.format(values[key]) if isinstance(values.get(key), int | float) else "-".rjust(width))
        if self.progress:
            cells.append(self._progress(state.global_step, state.max_steps))
        write_line(" ".join(cells))

    def _progress(self, step: int, total: int) -> str:
        done = f"{step}/{total}".rjust(9)
        steps = step - self._first_step
        if self._started is None or steps <= 0 or total <= 0:
            return f"{done} {'-':>9}"
        left = (time.monotonic() - self._started) / steps * max(0, total - step) / 60
        return f"{done} {left:>9.1f}"


class QuietProgress(ProgressCallback):
    """transformers' progress bar without its dump of every logged value (the step table shows them)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return None


def use_step_table(trainer, columns: Sequence[Column] = COLUMNS, key: str = m.REWARD) -> None:
    """Print the step table (``columns``, a row per log that has ``key``) instead of the raw log dicts: above the
    progress bar on a terminal, with the progress in each row elsewhere (module docstring)."""
    callbacks = trainer.callback_handler.callbacks
    had_bar = any(isinstance(cb, ProgressCallback) for cb in callbacks)
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)  # disable_tqdm's: the same dicts as lines
    bar = had_bar and sys.stderr.isatty()
    if bar:
        trainer.add_callback(QuietProgress())
    trainer.add_callback(StepTable(columns, key, progress=not bar))

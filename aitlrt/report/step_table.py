"""Console output of a training run: one table row per logged step."""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from aitlrt.common.logs import write_line

COLUMNS = (
    ("step", "step", "{:>5.0f}"),
    ("reward", "reward", "{:>7.3f}"),
    ("resolve", "rewards/tests_pass/mean", "{:>7.2f}"),
    ("simil.", "rewards/patch_similarity/mean", "{:>7.3f}"),
    ("patch", "rollouts/non_empty_patch_rate", "{:>6.2f}"),
    ("ok", "rollouts/ok", "{:>5.2f}"),
    ("unsc.", "rollouts/unscorable", "{:>5.0f}"),
    ("calls", "rollouts/calls_mean", "{:>6.1f}"),
    ("tokens", "rollouts/completion_tokens_mean", "{:>7.0f}"),
    ("rows", "rows/count", "{:>5.0f}"),
    ("split", "rows/split", "{:>5.0f}"),
    ("0-var", "zero_variance_groups", "{:>5.0f}"),
    ("inf.", "sampling/informative_groups", "{:>4.0f}"),
    ("rnd", "sampling/rounds", "{:>3.0f}"),
    ("skip", "sampling/skipped_update", "{:>4.0f}"),
    ("lp gap", "logprob_gap/mean", "{:>7.3f}"),
    ("loss", "loss", "{:>8.4f}"),
    ("roll s", "time/rollouts_s", "{:>7.1f}"),
    ("busy s", "time/model_busy_s", "{:>7.1f}"),
    ("agent s", "time/agent_outside_calls_s", "{:>7.1f}"),
    ("rew s", "time/rewards_s", "{:>6.1f}"),
    ("upd s", "time/update_s", "{:>6.1f}"),
    ("sync s", "time/sync_s", "{:>6.1f}"),
    ("step s", "time/step_s", "{:>6.1f}"),
    ("wv", "weight_version", "{:>3.0f}"),
)


class StepTable(TrainerCallback):
    """Prints a header once and a row per ``on_log`` on the main process, above the progress bar (missing values
    show as ``-``)."""

    def __init__(self) -> None:
        self._header = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        values = {**logs, "step": state.global_step}
        if not self._header:
            write_line(" ".join(f"{name:>{len(fmt.format(0))}}" for name, _, fmt in COLUMNS))
            self._header = True
        cells = []
        for _, key, fmt in COLUMNS:
            width = len(fmt.format(0))
            cells.append(fmt.format(values[key]) if isinstance(values.get(key), int | float) else "-".rjust(width))
        write_line(" ".join(cells))


class QuietProgress(ProgressCallback):
    """transformers' progress bar without its dump of every logged value (the step table shows them)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return None


def use_step_table(trainer) -> None:
    """Print the step table; keep the progress bar but not the raw log dicts."""
    if any(isinstance(cb, ProgressCallback) for cb in trainer.callback_handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(QuietProgress())
    trainer.add_callback(StepTable())

"""Console lines (log records, the step table's rows) never share a line with tqdm's progress bar, also where
stdout is a pipe or a file (block-buffered) and the bar is drawn on stderr."""

from __future__ import annotations

import io
import logging
import sys

import pytest
from tqdm.auto import tqdm

from aitlrt.common.logs import setup_logging, write_line


class Sink(io.RawIOBase):
    """What a terminal or a job's log receives from stdout and stderr together."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.data += b
        return len(b)

    def shown(self) -> list[str]:
        """Each line as displayed: what follows its last carriage return."""
        return [line.split("\r")[-1] for line in self.data.decode().split("\n")]


@pytest.fixture
def restore_logging():
    names = ("aitlrt", "aitlrt_server", "py.warnings")
    saved = {
        n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate) for n in names
    }
    yield
    logging.captureWarnings(False)
    for name, (handlers, level, propagate) in saved.items():
        log = logging.getLogger(name)
        log.handlers[:], log.level, log.propagate = handlers, level, propagate


def test_lines_and_records_land_between_bar_updates(monkeypatch, restore_logging):
    console = Sink()  # stdout and stderr block-buffered, as on a pipe (set here: pytest resets them after fixtures)
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(console), encoding="utf-8"))
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.BufferedWriter(console), encoding="utf-8"))
    setup_logging()
    bar = tqdm(total=2, file=sys.stderr, mininterval=0)
    bar.update(1)
    write_line("step row")
    logging.getLogger("aitlrt.test").info("a record")
    bar.update(1)
    bar.close()
    assert "step row" in console.shown() and "[aitlrt] a record" in console.shown()


class Console(Sink):
    """A terminal (``tty``) or a job's log file."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def train_three_steps(tmp_path) -> None:
    """A real transformers training loop (a tiny Llama, 3 steps, a log per step) with the SFT's step table."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from aitlrt.report.step_table import SFT_COLUMNS, use_step_table

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    rows = Dataset.from_list([{"input_ids": [1, 2, 3, 4, 5, 6], "labels": [1, 2, 3, 4, 5, 6]}] * 6)
    args = TrainingArguments(
        str(tmp_path), max_steps=3, logging_steps=1, per_device_train_batch_size=2, report_to=[], save_strategy="no"
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    use_step_table(trainer, SFT_COLUMNS, key="loss")
    trainer.train()


def console(monkeypatch, tty: bool) -> Console:
    out = Console(tty)
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(out), encoding="utf-8"))
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(io.BufferedWriter(out), encoding="utf-8"))
    return out


def test_in_a_jobs_log_each_row_is_a_line_of_its_own_with_the_progress_and_no_bar(monkeypatch, tmp_path):
    out = console(monkeypatch, tty=False)
    train_three_steps(tmp_path)
    sys.stdout.flush(), sys.stderr.flush()
    lines = out.data.decode().split("\n")
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "loss"])
    rows = lines[header + 1 : header + 4]
    assert lines[header].endswith("done  min left")
    assert [row.split()[0] for row in rows] == ["1", "2", "3"] and [row.split()[-2] for row in rows] == [
        "1/3",
        "2/3",
        "3/3",
    ]
    text = out.data.decode()
    assert "\r" not in text and "it/s" not in text, text  # no bar redrawn into the rows' lines
    assert "{'loss'" not in text and "'train_runtime'" not in text  # nor trl's/transformers' raw dicts


def test_on_a_terminal_the_bar_stays_and_the_rows_are_printed_above_it(monkeypatch, tmp_path):
    out = console(monkeypatch, tty=True)
    train_three_steps(tmp_path)
    sys.stdout.flush(), sys.stderr.flush()
    shown = out.shown()
    header = next(i for i, line in enumerate(shown) if line.split()[:2] == ["step", "loss"])
    assert [line.split()[0] for line in shown[header + 1 : header + 4]] == ["1", "2", "3"]
    assert "done" not in shown[header]  # the bar shows the progress
    assert "3/3" in out.data.decode() and "{'loss'" not in out.data.decode()

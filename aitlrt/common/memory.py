"""A process's peak memory over a stretch of work (a training step): the CUDA caching allocator's peak on a GPU,
the process's resident high-water mark (``VmHWM``) elsewhere. ``reset_peak_memory`` starts a new stretch; on CPU
that needs Linux's ``clear_refs`` (elsewhere the peak is the process's since it started).

``unmap_freed_tensors`` keeps a CPU training process's resident memory near what its live tensors hold: glibc's
malloc otherwise raises its mmap threshold each time a large block is freed (up to 32 MiB), after which a forward's
activations come from the heap, and the heap keeps the pages of what backward frees. One forward/backward of 4,096
tokens with gradient checkpointing (bundled model, fp32): 3.73 GiB at the peak with glibc's default, 1.55 with a
fixed 128 KiB threshold, the same time within noise (``bench/memory.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import resource
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 128 * 1024
"""Bytes from which a malloc gets its own mapping, given back to the system when freed: glibc's initial value, held
fixed."""


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


def unmap_freed_tensors(device: torch.device) -> bool:
    """Training on ``device`` the CPU: fix glibc's mmap threshold at ``MMAP_THRESHOLD`` for this process, so that the
    blocks tensors take (all but the smallest) are unmapped when freed instead of kept by the heap; whether it was set
    (False on another device, where the host holds little, or without glibc)."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        done = False
    log.debug("glibc mmap threshold fixed at %d bytes: %s", MMAP_THRESHOLD, done)
    return done

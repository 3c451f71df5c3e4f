"""What this node gives the job (cores it may run on, memory it may use, whether its CPU computes bf16), and the
agent concurrency that follows.

SLURM and containers restrict a job with CPU affinity and cgroups, not by hiding the machine: ``os.cpu_count()``
and ``/proc/meminfo`` describe the whole node, so both are read from the job's own limits instead.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

AGENT_GIB = 1.0
"""Memory one running agent needs: an Aider worker (~270 MB) plus the test runs that grade its patch."""
RESERVED_CORES = 2
"""Cores left to the trainer process, aitlrt-serve and the OS (fewer on small machines: a quarter at most)."""


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which SLURM and taskset set)."""
    return len(os.sched_getaffinity(0))


def usable_memory_gib() -> float:
    """Memory this process may use: its cgroup's limit when it has one, else the node's total."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total / 2**30


def agent_slots(cores: int | None = None, memory_gib: float | None = None) -> int:
    """Agents the node runs at once: min(cores - reserved, memory / ``AGENT_GIB``), at least 1."""
    cores = usable_cores() if cores is None else cores
    memory_gib = usable_memory_gib() if memory_gib is None else memory_gib
    return max(1, min(cores - min(RESERVED_CORES, cores // 4), int(memory_gib / AGENT_GIB)))


def rollout_concurrency() -> int:
    """Agents at once for each training rank on this node (``LOCAL_WORLD_SIZE`` ranks, set by torchrun/accelerate)."""
    return max(1, agent_slots() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def cpu_bf16_is_native() -> bool:
    """Whether this CPU computes bf16 in hardware (AMX tiles or AVX512-BF16). There bf16 autocast is faster than fp32
    (1.5x in SFT on an AMX Xeon); elsewhere PyTorch emulates it and it is slower (an AVX-512 Xeon without either:
    25.4 s vs 7.9 s for one forward and backward of a 1,500-token row of SmolLM2-135M, 3.2x)."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def cpu_mixed_precision(bf16: bool | None, where: str) -> bool:
    """``bf16`` for a run on the CPU: unset, bf16 autocast where the CPU has it natively (``cpu_bf16_is_native``),
    fp32 elsewhere; set, kept, with a warning when bf16 is asked for on a CPU that only emulates it."""
    native = cpu_bf16_is_native()
    if bf16 is None:
        return native
    if bf16 and not native:
        log.warning(
            "%s: bf16 autocast on a CPU without native bf16 (no AMX, no AVX512-BF16) runs ~3x slower than fp32 here; "
            "leave bf16 unset to choose by the CPU",
            where,
        )
    return bf16

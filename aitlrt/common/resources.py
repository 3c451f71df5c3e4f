"""What this node gives the job (cores it may run on, memory it may use), and the agent concurrency that follows.

SLURM and containers restrict a job with CPU affinity and cgroups, not by hiding the machine: ``os.cpu_count()``
and ``/proc/meminfo`` describe the whole node, so both are read from the job's own limits instead.
"""

from __future__ import annotations

import os
from pathlib import Path

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

"""Live processes and this process's resident memory, read from ``/proc``: what the tests that check nothing is left
behind, and the memory tests, look for."""

from __future__ import annotations

from pathlib import Path


def processes(ppid: int | None = None, session: int | None = None, marker: str = "") -> list[int]:
    """Live processes with this parent or in this session whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        state, parent, _, sid = stat[stat.rindex(")") + 2 :].split()[:4]
        if state != "Z" and marker in argv and int(parent if ppid is not None else sid) == (ppid or session):
            found.append(int(entry.name))
    return found


def resident_gib() -> float:
    """This process's resident memory now, in GiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 2**20


def held_after_freeing_gib() -> float:
    """GiB this process still holds after freeing 400 MiB of 1 MiB tensors, the heap's top kept in use. glibc's
    malloc keeps them (its mmap threshold rises past 1 MiB when the 4 MiB block made first is freed); with the
    threshold fixed (``aitlrt.common.memory.unmap_freed_tensors``) each was its own mapping, given back."""
    import torch

    big = torch.ones(2**20)
    del big
    before = resident_gib()
    blocks = [torch.ones(2**18) for _ in range(400)]
    last = blocks[-1]  # noqa: F841 (kept: the heap cannot give back what lies below a block in use)
    del blocks
    return resident_gib() - before

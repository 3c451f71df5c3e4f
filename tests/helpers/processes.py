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

"""Run a test command in a sandboxed subprocess: its own process group, a wall-clock timeout, resource limits,
and no network where the OS allows it (bubblewrap, else ``unshare -n``), with the isolation actually obtained
reported beside the result.

Runners: ``local`` (the default) or ``apptainer:IMAGE`` (set ``AITLRT_TEST_RUNNER``): on HPC clusters the
command then runs in ``apptainer exec --containall --net --network none`` with the working directory and the
test environment bound at the same paths (the image must provide the interpreter the venv was built with).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from aitlrt.common.procs import kill_group

MEMORY_LIMIT = 8 << 30
FILE_SIZE_LIMIT = 1 << 30


@cache
def network_isolation() -> tuple[tuple[str, ...], str]:
    """The command prefix that cuts the network off, and a word for it (``none: <why>`` when nothing works)."""
    probes: list[tuple[tuple[str, ...], str]] = []
    if bwrap := shutil.which("bwrap"):
        probes.append(((bwrap, "--dev-bind", "/", "/", "--unshare-net", "--die-with-parent", "--"), "bwrap"))
    if (unshare := shutil.which("unshare")) and (ip := shutil.which("ip")):
        loopback_up = ("bash", "-c", f'{ip} link set lo up && exec "$@"', "_")  # a new netns starts with lo down
        probes += [((unshare, "-n", *loopback_up), "unshare -n"), ((unshare, "-r", "-n", *loopback_up), "unshare -rn")]
    for prefix, name in probes:
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix, name
    return (), "none: neither bwrap nor unshare+ip can create a network namespace here"


def _limits(cpu_seconds: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def runner_prefix(binds: list[Path], cwd: Path) -> tuple[tuple[str, ...], str]:
    """The command prefix and isolation word for the configured runner (``AITLRT_TEST_RUNNER``)."""
    runner = os.environ.get("AITLRT_TEST_RUNNER", "local")
    if runner == "local":
        return network_isolation()
    kind, _, image = runner.partition(":")
    if kind != "apptainer" or not image:
        raise ValueError(f"AITLRT_TEST_RUNNER must be local or apptainer:IMAGE, got {runner!r}")
    exe = shutil.which("apptainer") or shutil.which("singularity")
    if exe is None:
        raise RuntimeError("AITLRT_TEST_RUNNER asks for apptainer, which is not installed here")
    bind = ",".join(str(p) for p in dict.fromkeys([cwd, *binds]))
    cmd = (exe, "exec", "--containall", "--net", "--network", "none", "--bind", bind, "--pwd", str(cwd), image)
    return cmd, f"apptainer ({image}, no network)"


@dataclass(frozen=True)
class SandboxResult:
    returncode: int
    output: str
    seconds: float
    timed_out: bool
    isolation: str


def run_sandboxed(
    command: str, cwd: Path, env: dict[str, str], timeout: float, binds: list[Path] | None = None
) -> SandboxResult:
    """Run ``command`` (a shell line) in ``cwd``; killed with its whole process group after ``timeout`` seconds.
    ``binds``: folders besides ``cwd`` the command needs (only containers care)."""
    prefix, isolation = runner_prefix(binds or [], cwd)
    started = time.monotonic()
    proc = subprocess.Popen(
        [*prefix, "bash", "-c", command],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
        preexec_fn=lambda: _limits(int(timeout * 2) + 10),
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        kill_group(proc)
        output, _ = proc.communicate()
        timed_out = True
    return SandboxResult(proc.returncode, output, time.monotonic() - started, timed_out, isolation)

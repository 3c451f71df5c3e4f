"""Run code the policy wrote (graded tests) in a sandbox, and always come back.

Isolation, best first (the one obtained is reported beside every result):
- ``bwrap``: bubblewrap (Debian's ``bubblewrap``, installed by ``jobs/setup.sh``): the host read-only, the working
  directory writable, a private ``/tmp``, its own pid, network (loopback only), IPC and UTS namespaces, every
  capability dropped, a new session; everything in it dies with it.
- ``unshare``: util-linux ``unshare`` where bubblewrap cannot start: its own network and pid namespaces (every
  process dies with its first one) but the host stays writable.
- ``apptainer:IMAGE`` (``AITLRT_TEST_RUNNER``, for clusters): ``apptainer exec --containall --net --network none``
  with the working directory and ``binds`` bound at the same paths (the image provides the interpreter).
- ``none``: nothing isolates; training refuses to run so unless told to (``allow_unisolated_tests``).

Whatever the isolation, the command gets resource limits (address space, processes, file size, CPU time), a
wall-clock limit after which its whole process group (and namespace) is killed, and only the tail of its output is
kept (``OUTPUT_TAIL``): a command that floods stdout, or leaves a child holding the pipe, cannot hang the caller
or fill its memory. Extra pipes (``pass_fds``) reach the command, e.g. the grader's result channel.
"""

from __future__ import annotations

import logging
import os
import resource
import selectors
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from aitlrt.common.procs import kill_group

MEMORY_LIMIT = 8 << 30
FILE_SIZE_LIMIT = 1 << 30
PROCESS_HEADROOM = 1024
"""Processes and threads the command may add to those its user already runs (RLIMIT_NPROC counts per user)."""
OUTPUT_TAIL = 256 << 10
"""Bytes of the command's output kept (its end)."""
DRAIN_S = 2.0
"""Seconds to read what is left in the pipes once the command is killed or has exited."""
NO_ISOLATION = "none"

log = logging.getLogger(__name__)


HIDE_ENV = "AITLRT_SANDBOX_HIDE"
"""More folders to hide from sandboxed code (``os.pathsep``-separated), e.g. where task files with oracle patches
live."""


def hidden_folders() -> list[Path]:
    """The folders sandboxed code must not read, each covered by an empty one (``bwrap``): ``AITLRT_HOME`` (cached
    repositories hold every fix commit; task files, warm-start data, other rollouts' copies), ``AITLRT_SCRATCH``,
    the working directory of the process that grades (a run's output: recorded rollouts with the oracle patch) and
    ``AITLRT_SANDBOX_HIDE``'s. What the command needs from them (its test environment, its copy) is bound back. A
    patch that read them could run the fix at import time, or print it into the test feedback the model reads."""
    from aitlrt.common.paths import aitlrt_home, scratch_dir

    extra = [Path(p) for p in os.environ.get(HIDE_ENV, "").split(os.pathsep) if p]
    folders = (p.resolve() for p in (aitlrt_home(), scratch_dir(), Path.cwd(), *extra))
    return [p for p in dict.fromkeys(folders) if p.is_dir() and p != Path("/")]


def _bwrap(
    bwrap: str,
    cwd: Path,
    binds: Sequence[Path] = (),
    writable: bool = True,
    writable_binds: Sequence[Path] = (),
    network: bool = False,
) -> tuple[str, ...]:
    # Order matters: the private /tmp and the hidden folders first, so that folders in them are bound on top.
    hide = [arg for p in hidden_folders() for arg in ("--tmpfs", str(p))]
    ro_binds = [arg for b in dict.fromkeys(binds) for arg in ("--ro-bind", str(b), str(b))]
    rw_binds = [arg for b in dict.fromkeys(writable_binds) for arg in ("--bind", str(b), str(b))]
    return (
        bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", *hide, *ro_binds,
        *rw_binds, "--bind" if writable else "--ro-bind", str(cwd), str(cwd), "--chdir", str(cwd),
        "--unshare-pid", *(() if network else ("--unshare-net",)), "--unshare-ipc", "--unshare-uts",
        "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--",
    )  # fmt: skip


def _unshare(unshare: str) -> tuple[str, ...]:
    loopback_up = ("bash", "-c", 'ip link set lo up 2>/dev/null; exec "$@"', "_")  # a new netns starts with lo down
    return (unshare, "--net", "--pid", "--fork", "--kill-child", "--mount-proc", *loopback_up)


@cache
def _works(prefix: tuple[str, ...]) -> bool:
    probe = [*prefix, "true"]
    return subprocess.run(probe, capture_output=True, stdin=subprocess.DEVNULL, timeout=30).returncode == 0


def local_isolation(cwd: Path, binds: Sequence[Path] = (), writable: bool = True) -> tuple[tuple[str, ...], str]:
    """The best local command prefix for ``cwd`` (and read-only ``binds`` beside the read-only host, for those
    under ``/tmp``), and its name (``none: <why>`` when nothing works)."""
    if (bwrap := shutil.which("bwrap")) and _works(_bwrap(bwrap, Path("/"))):
        return _bwrap(bwrap, cwd, binds, writable), "bwrap" if writable else "bwrap (working directory read-only)"
    if unshare := shutil.which("unshare"):
        for prefix in (_unshare(unshare), (unshare, "--user", "--map-root-user", *_unshare(unshare)[1:])):
            if _works(prefix):
                return prefix, "unshare (own network and pids; host writable)"
    return (), f"{NO_ISOLATION}: neither bwrap nor unshare can create namespaces here (apt-get install bubblewrap)"


def runner_prefix(binds: Sequence[Path], cwd: Path, writable: bool = True) -> tuple[tuple[str, ...], str]:
    """The command prefix and isolation word for the configured runner (``AITLRT_TEST_RUNNER``)."""
    runner = os.environ.get("AITLRT_TEST_RUNNER", "local")
    if runner == "local":
        return local_isolation(cwd, binds, writable)
    kind, _, image = runner.partition(":")
    if kind != "apptainer" or not image:
        raise ValueError(f"AITLRT_TEST_RUNNER must be local or apptainer:IMAGE, got {runner!r}")
    exe = shutil.which("apptainer") or shutil.which("singularity")
    if exe is None:
        raise RuntimeError("AITLRT_TEST_RUNNER asks for apptainer, which is not installed here")
    bind = ",".join(str(p) for p in dict.fromkeys([cwd, *binds]))
    cmd = (exe, "exec", "--containall", "--net", "--network", "none", "--bind", bind, "--pwd", str(cwd), image)
    return cmd, f"apptainer ({image}, no network)"


def prlimit_prefix(cpu_seconds: int) -> tuple[str, ...]:
    """util-linux ``prlimit`` with the limits of graded tests but the process count (whose per-user count the caller
    cannot know ahead of each command): for commands started by a process of another virtualenv, which cannot import
    ``_limits``. Empty where ``prlimit`` is missing."""
    exe = shutil.which("prlimit")
    if exe is None:
        return ()
    return (
        exe, f"--as={MEMORY_LIMIT}", f"--fsize={FILE_SIZE_LIMIT}", f"--cpu={cpu_seconds}", "--core=0", "--",
    )  # fmt: skip


def shell_sandbox(workspace: Path, timeout_s: float, binds: Sequence[Path] = ()) -> tuple[tuple[str, ...], str]:
    """The argv prefix for each shell command an agent runs (``bash -c CMD`` follows it) and its isolation word: the
    sandbox of graded tests (``runner_prefix``: with bubblewrap the host read-only, ``workspace`` writable, a private
    ``/tmp``, no network at all, its own pid namespace, so that nothing it starts outlives it) under the limits of
    graded tests, CPU time ``2 * timeout_s + 10``. The agent's own process stays outside: it must reach the proxy."""
    prefix, name = runner_prefix(binds, workspace)
    return (*prlimit_prefix(int(timeout_s * 2) + 10), *prefix), name


def agent_sandbox(workspace: Path, private: Sequence[Path], binds: Sequence[Path] = ()) -> tuple[tuple[str, ...], str]:
    """The argv prefix for a whole agent process that must reach the proxy (``agent: command``): bubblewrap as
    ``shell_sandbox``'s but sharing the host's network; ``private``: folders of its own it may write (its HOME),
    ``binds``: folders it reads that are hidden otherwise (its virtualenv). Without bubblewrap: no prefix
    (``none: ...``); the network cannot be kept to the proxy alone by ``unshare`` or apptainer here."""
    if (bwrap := shutil.which("bwrap")) and _works(_bwrap(bwrap, Path("/"))):
        prefix = _bwrap(bwrap, workspace, binds, writable_binds=private, network=True)
        return prefix, "bwrap (network shared: the agent reaches the proxy)"
    return (), f"{NO_ISOLATION}: bubblewrap cannot create namespaces here (apt-get install bubblewrap)"


def isolation() -> str:
    """The isolation graded tests get on this machine with the configured runner (``none: ...`` when none)."""
    return runner_prefix([], Path("/"))[1]


def require_isolation(allow_none: bool) -> str:
    """The isolation graded tests get here; raises ``RuntimeError`` when there is none, unless ``allow_none``
    (then it warns, loudly)."""
    obtained = isolation()
    if obtained.startswith(NO_ISOLATION):
        if not allow_none:
            raise RuntimeError(
                f"graded tests would run with no isolation ({obtained}): the policy's code would reach the network "
                "and could write this machine. Install bubblewrap (jobs/setup.sh does, as root), or set "
                "allow_unisolated_tests: true to run anyway"
            )
        log.warning("!!! graded tests run with NO isolation (%s): allow_unisolated_tests is set !!!", obtained)
    else:
        log.info("graded tests run sandboxed: %s", obtained)
    return obtained


def _user_tasks() -> int:
    """Processes and threads its user runs now: what RLIMIT_NPROC counts (a trainer's threads are many)."""
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                count += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:
            continue
    return count


def _limits(cpu_seconds: int, processes: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))

    return apply


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    """None when the command was killed for running out of time."""
    output: str
    """The tail of stdout and stderr together (at most ``OUTPUT_TAIL`` bytes)."""
    seconds: float
    timed_out: bool
    isolation: str
    extra: dict[int, bytes]
    """What the command wrote to each of ``read_fds`` (each at most ``read_limit`` bytes)."""
    overflowed: tuple[int, ...] = ()
    """The ``read_fds`` that carried more than ``read_limit`` bytes (what was read is cut there)."""


def _pump(proc: subprocess.Popen, pipes: dict[int, int], timeout: float) -> tuple[dict[int, bytes], bool]:
    """Read every pipe (fd -> byte limit; of the first only the tail is kept) until each closes or the deadline;
    kill the group at the deadline."""
    chunks: dict[int, bytearray] = {fd: bytearray() for fd in pipes}
    sel = selectors.DefaultSelector()
    for fd in pipes:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    timed_out = False
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            if timed_out or proc.poll() is not None:
                break  # killed, or exited, and something still holds a pipe: stop reading
            timed_out = proc.poll() is None
            kill_group(proc)
            deadline = time.monotonic() + DRAIN_S
            continue
        for key, _ in sel.select(min(left, 1.0)):
            fd = int(key.fd)
            data = os.read(fd, 1 << 16)
            if not data:
                sel.unregister(fd)
                continue
            buf = chunks[fd]
            buf += data
            if len(buf) > pipes[fd]:
                if fd == next(iter(pipes)):  # the output: keep its tail
                    del buf[: len(buf) - pipes[fd]]
                else:
                    del buf[pipes[fd] + 1 :]
                    sel.unregister(fd)  # over its limit: stop reading it (the rest is lost)
        if proc.poll() is not None and deadline - time.monotonic() > DRAIN_S:
            deadline = time.monotonic() + DRAIN_S  # exited: what is still open belongs to a stray child
    sel.close()
    return {fd: bytes(b) for fd, b in chunks.items()}, timed_out


def run_sandboxed(
    command: Sequence[str],
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    binds: Sequence[Path] = (),
    pass_fds: Sequence[int] = (),
    read_fds: Sequence[int] = (),
    read_limit: int = 16 << 20,
    writable: bool = True,
) -> SandboxResult:
    """Run ``command`` (an argv) in ``cwd`` in the sandbox; killed with its whole process group and namespace after
    ``timeout`` seconds. ``binds``: folders besides ``cwd`` a container needs; ``pass_fds``: descriptors the
    command inherits; ``read_fds``: our ends of pipes to read while it runs; both are closed here. ``writable``:
    False makes ``cwd`` read-only too (bubblewrap only)."""
    prefix, isolation_name = runner_prefix(binds, cwd, writable)
    started = time.monotonic()
    out_r, out_w = os.pipe()
    try:
        proc = subprocess.Popen(
            [*prefix, *command],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=out_w,
            pass_fds=tuple(pass_fds),
            start_new_session=True,
            preexec_fn=_limits(int(timeout * 2) + 10, _user_tasks() + PROCESS_HEADROOM),
        )
    except BaseException:
        for fd in (out_r, *read_fds):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, *pass_fds):  # the command has its copies: EOF comes when it (and its children) exit
            os.close(fd)
    try:
        pipes = {out_r: OUTPUT_TAIL, **{fd: read_limit for fd in read_fds}}
        data, timed_out = _pump(proc, pipes, timeout)
    finally:
        kill_group(proc)  # strays of a command that exited (no pid namespace): gone too
        for fd in (out_r, *read_fds):
            os.close(fd)
    output = data.pop(out_r).decode(errors="replace")
    overflowed = tuple(fd for fd in read_fds if len(data[fd]) > read_limit)
    extra = {fd: data[fd][:read_limit] for fd in read_fds}
    return SandboxResult(
        None if timed_out else proc.returncode,  # kill_group reaped it
        output,
        time.monotonic() - started,
        timed_out,
        isolation_name,
        extra,
        overflowed,
    )

"""A warm mini-swe-agent worker: a fork server. Runs with the Python of mini-swe-agent's own venv, by path (it imports
nothing of ours but its sibling ``aitlrt_shell``, the sandboxed environment class).

It pays mini-swe-agent's start-up once (importing litellm and mini-swe-agent: 4-14 s, ~250 MB), then forks a child
per job that runs ``mini``'s own typer app with the CLI's arguments, so every rollout starts from the same fresh
process state (no counter, cache or client of one rollout reaches the next) and behaves like the CLI: the same
environment variables (the job's, replacing the worker's), working directory, stdin (``/dev/null``), stdout and
stderr (the job's log). The environment read at import time (``MSWEA_*``) is the worker's own, set by its owner.

Run as ``python miniswe_worker.py OWNER_PID`` with stdin and stdout pipes. Protocol, one JSON object per line: a job
``{"argv", "cwd", "env", "log"}`` on stdin; replies on the original stdout: ``{"ready": true}`` once after the
imports, then per job ``{"exit_code", "seconds"}`` once its child has exited (``exit_code`` as ``subprocess``'s
``returncode``: ``-N`` for a signal). ``{"kill": true}`` on stdin while a job runs SIGKILLs the child's process group
(its own session): the worker, which reaps the child, kills it, so that no pid is signalled after its reuse.

The child dies with the worker (``PR_SET_PDEATHSIG``), its sandboxed commands with it (bubblewrap's
``--die-with-parent``); the worker kills the child and exits when its owner is gone (no longer its parent, checked
every 0.5 s) or closes stdin.
"""

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1
POLL_S = 0.5
PRELOAD = (
    "httpcore",
    "litellm._service_logger",
    "litellm.litellm_core_utils.logging_callback_manager",
    "litellm.llms.github_copilot.per_user_auth",
    "litellm.llms.litellm_proxy.chat.transformation",
    "litellm.llms.openai_like.dynamic_config",
    "litellm.proxy.openai_files_endpoints.common_utils",
    "rich._emoji_codes",
    "rich.status",
)
"""Modules a rollout imports at its first model call or message (litellm 1.110: 0.25 s of a child's 0.41 s under
cProfile, most of it ``litellm.proxy._types``): imported once here, not in every child. One missing (another
litellm) is skipped: they only save time."""


class Owner:
    """The owner's lines on stdin, read without Python's buffering (a buffered line is invisible to ``select``),
    and whether the owner is still there."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.buffer = b""
        self.gone = False

    def line(self, timeout_s: float) -> dict | None:
        """The next line, or None after ``timeout_s`` or once the owner is gone."""
        if b"\n" not in self.buffer and not self.gone:
            if select.select([0], [], [], timeout_s)[0]:
                chunk = os.read(0, 1 << 16)
                self.buffer += chunk
                self.gone = not chunk  # stdin closed
            self.gone = self.gone or os.getppid() != self.pid
        if b"\n" not in self.buffer:
            return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)


def run_mini(argv: list[str]) -> int:
    """The command line ``argv`` (``.../bin/mini ARGS``) as the CLI runs it (``sys.exit(app())``), its exit status
    returned."""
    from minisweagent.run.mini import app

    sys.argv = argv
    try:
        app(args=argv[1:], prog_name=os.path.basename(argv[0]))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # typer's pretty traceback, as the CLI prints it
    return 1


def child(job: dict, worker: int, prctl) -> None:
    """The forked child: its own session, the job's environment, directory and log, then ``mini``; never returns."""
    code = 1
    try:
        os.setsid()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != worker:  # the worker died before the prctl
            os._exit(code)
        os.environ.clear()
        os.environ.update(job["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for fd, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        os.close(null)
        os.close(log)
        os.chdir(job["cwd"])
        code = run_mini(job["argv"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def kill(pid: int) -> None:
    """SIGKILL the child's process group, and the child itself if it had no group of its own yet."""
    for send in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError):
            send(pid, signal.SIGKILL)


def wait(pid: int, done: int, owner: Owner) -> int:
    """The child's exit status once it exits (``done`` reaches EOF), killed first on request or when the owner is
    gone."""
    while done not in select.select([done] if owner.gone else [done, 0], [], [], POLL_S)[0]:
        request = owner.line(0.0)
        if owner.gone or (request or {}).get("kill"):
            kill(pid)
            break
    os.close(done)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def preload() -> None:
    """Pay now what each child would pay at its first model call: the modules litellm imports then (``PRELOAD``),
    and the schemas of its pydantic models, which it builds at first use unless ``DEFER_PYDANTIC_BUILD`` is false
    (read at import: the children's environment does not change it). Nothing here starts a thread: ``fork`` keeps
    only the calling one."""
    os.environ["DEFER_PYDANTIC_BUILD"] = "false"
    import litellm  # noqa: F401

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def main() -> None:
    owner = Owner(int(sys.argv[1]))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the imports print goes to the worker's log, not into the protocol
    preload()
    import aitlrt_shell  # noqa: F401
    from minisweagent.agents import interactive  # noqa: F401  (mini's default agent class)
    from minisweagent.models import litellm_model, litellm_textbased_model  # noqa: F401
    from minisweagent.run import mini  # noqa: F401

    prctl = ctypes.CDLL(None).prctl
    worker = os.getpid()
    gc.freeze()  # the imports' objects: a child's collections skip them, instead of traversing (copying) them all
    proto.write(json.dumps({"ready": True}) + "\n")
    while not owner.gone:
        job = owner.line(POLL_S)
        if job is None or "argv" not in job:
            continue
        start = time.monotonic()
        done, alive = os.pipe()  # the child holds ``alive`` until it exits (close-on-exec: not its commands)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(done)
            proto.close()
            child(job, worker, prctl)
        os.close(alive)
        code = wait(pid, done, owner)
        if not owner.gone:
            proto.write(json.dumps({"exit_code": code, "seconds": time.monotonic() - start}) + "\n")


if __name__ == "__main__":
    main()

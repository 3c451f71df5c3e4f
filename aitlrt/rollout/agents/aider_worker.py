"""A warm Aider worker. Runs with the Python of Aider's own venv, by path (it imports nothing of ours but its
sibling ``edit_guard``, which keeps every edit inside the job's repository and out of its ``.git``).

It pays Aider's start-up (importing litellm, ~3 s) once, then runs jobs one at a time by calling Aider's own
``aider.main.main(argv)`` in-process, so a job behaves exactly like the CLI with the same arguments (down to waiting,
as the CLI's exit does, for a chat summary Aider started in the background).

Run as ``python aider_worker.py [OWNER_PID]``: when that process (the trainer) is gone, however it ended, the worker
kills its own process group, Aider's children included, even in the middle of a job.

Protocol: one JSON job per line on stdin ``{"argv", "cwd", "home", "log", "max_reflections"}``; one JSON reply
per line on the original stdout ``{"exit_code", "seconds"}``; ``{"ready": true}`` once after the imports.
While a job runs, file descriptors 1 and 2 point at the job's log.
"""

import json
import os
import signal
import sys
import threading
import time
import traceback


def _die_with_owner(owner: int) -> None:
    """SIGKILL this process group once ``owner`` is no longer the parent: nobody is left to read the reply, and a
    job in flight must not go on calling the model or editing a workspace."""
    while os.getppid() == owner:
        time.sleep(0.5)
    os.killpg(0, signal.SIGKILL)


def _register_metadata_once(models) -> None:
    """Aider re-parses its 1 MB model-metadata file with json5 on every main() (~0.5 s): do it once per content."""
    register = models.register_litellm_models
    seen = set()

    def once(files):
        fresh = []
        for fname in files:
            try:
                with open(fname, "rb") as f:
                    content = f.read()
            except OSError:
                continue
            if content not in seen:
                seen.add(content)
                fresh.append(fname)
        return register(fresh) if fresh else []

    models.register_litellm_models = once


def _summaries_joined(coder_class) -> list:
    """Record every coder that starts Aider's background chat summary, so that the job can wait for it
    (``summarize_end``) as the CLI's exit does: a summary still running in the worker when the next job starts would
    call the model on the next job's endpoint (Aider reads the base URL from the environment at each call)."""
    started = []
    summarize_start = coder_class.summarize_start

    def recorded(self):
        summarize_start(self)
        if self.summarizer_thread is not None:
            started.append(self)

    coder_class.summarize_start = recorded
    return started


def main() -> None:
    if len(sys.argv) > 1:
        threading.Thread(target=_die_with_owner, args=(int(sys.argv[1]),), daemon=True).start()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    import edit_guard  # from this file's folder, before it leaves the path

    # This file's folder holds our aider.py: it must not shadow the real package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    import aider.main
    import aider.models
    from aider.coders.base_coder import Coder

    edit_guard.install_in_aider()
    _register_metadata_once(aider.models)
    summarizing = _summaries_joined(Coder)
    # Parse Aider's own model metadata now, at start-up, not in the first rollout.
    from importlib import resources

    aider.models.register_litellm_models([str(resources.files("aider.resources").joinpath("model-metadata.json"))])

    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        start = time.monotonic()
        log_fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.environ["HOME"] = job["home"]
        Coder.max_reflections = job.get("max_reflections", 3)
        try:
            os.chdir(job["cwd"])
            code = aider.main.main(job["argv"])
            code = code if isinstance(code, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            while summarizing:
                summarizing.pop().summarize_end()
            sys.stdout.flush()
            sys.stderr.flush()
            os.chdir("/")
        proto.write(json.dumps({"exit_code": code, "seconds": time.monotonic() - start}) + "\n")


if __name__ == "__main__":
    main()

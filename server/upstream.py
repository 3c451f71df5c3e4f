"""The vLLM server behind the proxy: started and supervised as a child process, or attached to."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from aitlrt.common.procs import free_port, tail, wait_http


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
    ) -> None:
        self.model = model
        self.served_model_name = served_model_name
        self.host = host
        self.port = port or free_port(host)
        self.extra_args = list(extra_args or ())
        self.python = python
        self.log_path = log_path or Path(f"vllm-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.stopping = False

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
        return cmd + self.extra_args

    def start(self) -> None:
        env = dict(os.environ)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        # Importing trl sets VLLM_LOGGING_LEVEL=ERROR in the importing process, which would silence vllm.log
        # (request logs included) for a server started from a trainer: vLLM's own level is ours to choose.
        env["VLLM_LOGGING_LEVEL"] = os.environ.get("AITLRT_VLLM_LOGGING_LEVEL", "INFO")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

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

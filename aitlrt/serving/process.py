"""Run ``aitlrt-serve`` as a child process: ``managed_server`` for the demo, ``aitlrt eval`` and training;
``ServeProcess`` for raw control (tests and benchmarks)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from aitlrt.common import keys
from aitlrt.common.procs import die_with_parent, free_port, wait_http
from aitlrt.serving.sampling_defaults import NEUTRAL_CONFIG_FLAG

log = logging.getLogger(__name__)


class ServeProcess:
    """``aitlrt-serve ARGS`` in its own process group; ``with`` waits for health and stops it afterwards.

    It gets SIGTERM (and so stops its vLLM) when the process that started it dies in any way, the OOM killer
    included (Linux): start it from a thread that outlives it, the main thread as the trainer, ``aitlrt eval``
    and ``aitlrt demo`` do."""

    def __init__(
        self, args: list[str], port: int, log_path: Path, host: str = "127.0.0.1", api_key: str | None = None
    ) -> None:
        """``api_key``: the server's admin key (default: a new one), passed in its environment and remembered for
        its URL (``aitlrt.common.keys``), so that this process's clients of the URL send it."""
        self.args = args
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.api_key = api_key or keys.new_key()
        keys.remember(self.url, self.api_key)
        self.proc: subprocess.Popen | None = None
        self._argv = [sys.executable, "-m", "aitlrt_server.cli", "--host", host, "--port", str(port), *args]

    def start(self) -> ServeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self._argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, keys.ENV: self.api_key},
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),
            )
        return self

    @property
    def headers(self) -> dict[str, str]:
        """The headers of an admin call."""
        return keys.bearer(self.api_key)

    def rollout_headers(self, rollout_id: str) -> dict[str, str]:
        """The headers of a model call of rollout ``rollout_id``, as its agent sends them (its own token)."""
        return keys.bearer(keys.rollout_token(self.api_key, rollout_id))

    def wait_ready(self, timeout_s: float = 900.0, progress: bool = False, upstream: bool = True) -> float:
        """Until ``/health`` is 200 (vLLM included; any answer with ``upstream=False``); raises with the
        log's tail if the process dies."""
        try:
            return wait_http(
                f"{self.url}/health",
                self.proc,
                timeout_s,
                any_status=not upstream,
                progress="waiting for aitlrt-serve and vLLM" if progress else None,
            )
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; log tail:\n{self.log_path.read_text(errors='replace')[-4000:]}") from None
        except TimeoutError:
            self.stop()
            raise

    def kill(self) -> None:
        """SIGKILL the proxy alone, as a crash would (a vLLM it started is then stopped by its guard)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM (the proxy then stops its vLLM), SIGKILL the group if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> ServeProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def managed_args(
    model: str | Path,
    run_dir: Path,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """``aitlrt-serve``'s arguments for ``managed_server``: vLLM gets neutral sampling defaults
    (``--generation-config vllm``, unless ``extra_args`` name a generation config): the model's
    ``generation_config.json`` would otherwise apply its penalties to every call (``sampling_defaults``)."""
    sampling = {"--temperature": temperature, "--top-p": top_p, "--top-k": top_k, "--max-tokens": max_tokens}
    args = ["--model", str(model), "--run-dir", str(run_dir)]
    args += [word for flag, value in sampling.items() if value is not None for word in (flag, str(value))]
    if not any(arg.split("=")[0] == NEUTRAL_CONFIG_FLAG[0] for arg in extra_args):
        args += NEUTRAL_CONFIG_FLAG
    return [*args, *extra_args]


@contextmanager
def managed_server(
    model: str | Path,
    run_dir: Path,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    extra_args: Sequence[str] = (),
) -> Iterator[ServeProcess]:
    """``aitlrt-serve`` + vLLM on ``model`` with these sampling parameters (``managed_args``; None: the server's
    default) on a free local port, journal and ``serve.log`` in ``run_dir``, a new admin key (``ServeProcess``);
    ready when entered, stopped on exit."""
    args = managed_args(
        model, run_dir, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, extra_args=extra_args
    )
    serve = ServeProcess(args, port=free_port(), log_path=run_dir / "serve.log")
    log.info("starting aitlrt-serve + vLLM on %s; log: %s", model, serve.log_path)
    serve.start()
    try:
        took = serve.wait_ready(progress=True)
        log.info("server ready in %.0f s at %s", took, serve.url)
        yield serve
    finally:
        serve.stop()

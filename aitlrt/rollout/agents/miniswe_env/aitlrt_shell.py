"""mini-swe-agent's environment for AITLRT rollouts: its ``LocalEnvironment`` with each command sandboxed.

Loaded by path inside mini-swe-agent's own virtualenv (``environment_class: aitlrt_shell.SandboxedEnvironment``,
this folder on its ``PYTHONPATH``), so it imports nothing of AITLRT: the trusted side computes the sandbox's argv
prefix (``aitlrt.tasks.sandbox.shell_sandbox``) and passes it in the config. ``LocalEnvironment`` would run
``sh -c CMD`` on the host with the agent's own environment (the rollout's token in it); here each command runs as
``PREFIX bash -c CMD`` with only ``env`` and a private ``HOME`` under the sandbox's ``/tmp``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from minisweagent.environments.local import LocalEnvironment, LocalEnvironmentConfig
from pydantic import Field


class SandboxedEnvironmentConfig(LocalEnvironmentConfig):
    sandbox: list[str] = Field(default_factory=list)
    """The argv prefix every command runs under (empty: none, which the trusted side refuses unless told)."""
    base_env: dict[str, str] = Field(
        default_factory=lambda: {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    )
    """The commands' whole environment, with ``env`` on top: nothing of the agent's process (its token)."""


class SandboxedEnvironment(LocalEnvironment):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(config_class=SandboxedEnvironmentConfig, **kwargs)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        argv = [*self.config.sandbox, "bash", "-c", command]
        env = self.config.base_env | self.config.env
        process = subprocess.Popen(
            argv,
            cwd=cwd or self.config.cwd or os.getcwd(),
            env=env,
            text=True,
            encoding="utf-8",
            errors="replace",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            stdout, _ = process.communicate(timeout=timeout or self.config.timeout)
            output = {"output": stdout, "returncode": process.returncode, "exception_info": ""}
        except subprocess.TimeoutExpired as exc:
            os.killpg(process.pid, signal.SIGKILL)  # the sandbox's pid namespace dies with its first process
            stdout, _ = process.communicate()
            output = {
                "output": stdout or "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {exc}",
                "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
            }
        self._check_finished(output)
        return output

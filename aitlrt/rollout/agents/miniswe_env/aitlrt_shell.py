"""mini-swe-agent's environment for AITLRT rollouts: its ``LocalEnvironment`` with each command sandboxed.

Loaded by path inside mini-swe-agent's own virtualenv (``environment_class: aitlrt_shell.SandboxedEnvironment``,
this folder on its ``PYTHONPATH``), so it imports nothing of AITLRT: the trusted side computes the sandbox's argv
prefix (``aitlrt.tasks.sandbox.shell_sandbox``) and passes it in the config. ``LocalEnvironment`` would run
``sh -c CMD`` on the host with the agent's own environment (the rollout's token in it); here each command runs as
``PREFIX bash -c CMD`` with only ``env`` and a private ``HOME`` under the sandbox's ``/tmp``.

Test feedback (``test_command``): a command that is exactly ``test_alias`` (``run-tests``) runs the task's feedback
program instead (``aitlrt.tasks.feedback``, the trusted side's argv, as Aider's ``--test-cmd`` runs it): it grades the
work tree's patch on the grader's own copy, the tests in the sandbox of graded tests, and prints the failures. Only
that exact text triggers it, so the policy chooses when, never what runs.
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
    test_command: list[str] = Field(default_factory=list)
    """The task's test feedback argv (empty: none), run with the workspace as working directory."""
    test_alias: str = "run-tests"
    test_timeout: int = 300
    """Seconds the feedback may run (it bounds its own test run by the rollout's ``test_feedback_timeout_s``)."""


class SandboxedEnvironment(LocalEnvironment):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(config_class=SandboxedEnvironmentConfig, **kwargs)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        cwd = cwd or self.config.cwd or os.getcwd()
        env = self.config.base_env | self.config.env
        if self.config.test_command and command.strip() == self.config.test_alias:
            output = _run(self.config.test_command, cwd, env, self.config.test_timeout)
        else:
            output = _run([*self.config.sandbox, "bash", "-c", command], cwd, env, timeout or self.config.timeout)
        self._check_finished(output)
        return output


def _run(argv: list[str], cwd: str, env: dict[str, str], timeout: int) -> dict[str, Any]:
    """``argv``'s output and return code, as ``LocalEnvironment`` reports them; on timeout its whole process group
    is killed (a sandbox's pid namespace dies with its first process)."""
    process = subprocess.Popen(
        argv,
        cwd=cwd,
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
        stdout, _ = process.communicate(timeout=timeout)
        return {"output": stdout, "returncode": process.returncode, "exception_info": ""}
    except subprocess.TimeoutExpired as exc:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        return {
            "output": stdout or "",
            "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {exc}",
            "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
        }

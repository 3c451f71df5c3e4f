"""mini-swe-agent (``mini-swe-agent==2.4.6``), unmodified, as an agent: its ``mini`` command per rollout, forked by a
warm worker (or its CLI), from its own virtualenv (``jobs/setup.sh`` builds ``$AITLRT_HOME/miniswe-venv``, or
``$AITLRT_MINISWE_VENV``; its litellm needs ``mcp`` to import).

Its only tool is a shell. Every command runs in the sandbox of graded tests (``aitlrt.tasks.sandbox.shell_sandbox``:
the workspace writable, the host read-only, a private ``/tmp``, no network, its own pid namespace) through our
environment class ``miniswe_env/aitlrt_shell.py``; the agent process itself reaches only the rollout's endpoint.
A rollout without isolation is refused (``RuntimeError``: the runner's ``agent_error``) unless ``allow_unsandboxed``.
The isolation obtained ends the agent's log (``isolation: ...``).

Modes: text (``tools=False``, its ``mini_textbased.yaml``: one ```` ```mswea_bash_command ```` block per answer;
any chat template works, the bundled SmolLM2's included) or tool calls (``tools=True``, its ``mini.yaml``: a
``bash`` tool; vLLM must run with ``--enable-auto-tool-choice --tool-call-parser hermes`` for Qwen2.5-Coder).
Limits: ``step_limit`` model calls (the rollout's ``max_calls``; a format error spends one), the rollout's
timeout as its wall-time limit, no cost limit (a local model costs nothing).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from aitlrt.common.paths import aitlrt_home
from aitlrt.common.procs import ProcessExit, run_process_group, tail
from aitlrt.common.workspace import Workspace
from aitlrt.rollout.agents.aider import agent_env
from aitlrt.rollout.agents.base import AgentExit, AgentTask, ModelEndpoint
from aitlrt.rollout.agents.worker_pool import WarmWorkers, Worker
from aitlrt.tasks.sandbox import NO_ISOLATION, shell_sandbox

MINISWE_VERSION = "2.4.6"
ENV_CLASS = "aitlrt_shell.SandboxedEnvironment"
ENV_DIR = Path(__file__).with_name("miniswe_env")
KILL_WAIT_S = 10.0
"""Seconds a warm worker may take to kill a timed-out rollout and report it (milliseconds) before it is replaced."""
COMMAND_TIMEOUT_S = 60
"""Seconds one shell command may run (mini-swe-agent's own default is 30)."""
STOP_MARGIN_S = 10.0
"""Seconds before the rollout's timeout that mini-swe-agent stops itself (its wall-time limit), so that it exits
with its trajectory saved rather than being killed."""
TEST_ALIAS = "run-tests"
"""The command, alone on its line, that runs the task's test feedback (``miniswe_env/aitlrt_shell.py``)."""


def feedback_note(rounds: int) -> str:
    """What the task tells the agent of its test feedback (appended to the problem statement)."""
    times = "once" if rounds == 1 else f"{rounds} times"
    return (
        f"\n\nTo run the tests that decide this task on your current changes, run `{TEST_ALIAS}` as a command on its"
        f" own (it runs {times} at most)."
    )


def miniswe_venv() -> Path:
    return Path(os.environ.get("AITLRT_MINISWE_VENV") or aitlrt_home() / "miniswe-venv")


def miniswe_env(home: Path, api_key: str) -> dict[str, str]:
    """mini-swe-agent's process environment: ``agent_env``'s, its global config under ``home`` (no first-run
    prompt, no banner), no cost tracking (a local model has no price), one retry at most (a refused call repeated 10
    times with backoff would spend minutes), the rollout's token in ``OPENAI_API_KEY``."""
    return {
        **agent_env(home),
        "PYTHONPATH": str(ENV_DIR),
        "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mini-swe-agent"),
        "MSWEA_CONFIGURED": "true",
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "2",
        "OPENAI_API_KEY": api_key,
    }


@dataclass
class MiniSweAgent(WarmWorkers):
    """mini-swe-agent's ``mini``: forked by a warm worker (``warm``, the default) or its CLI, one process per rollout.

    A warm worker (``miniswe_env/miniswe_worker.py``, a fork server) has imported mini-swe-agent and litellm once
    (4-14 s: the CLI's start-up, per rollout) and forks a fresh child per rollout that runs ``mini``'s own ``main``
    with the CLI's command line, environment, working directory and log; a rollout's timeout kills the child's
    process group (its sandboxed command with it) and the worker stays. One rollout at a time per worker (a worker
    is ~250 MB); ``close()`` stops them.
    """

    tools: bool = False
    """Tool-calling mode (its default ``mini.yaml``) instead of text actions (``mini_textbased.yaml``)."""
    step_limit: int = 0
    """Model calls at most (0: none but the proxy's ``max_calls``)."""
    command_timeout_s: int = COMMAND_TIMEOUT_S
    allow_unsandboxed: bool = False
    """Run the commands unisolated where no sandbox works (loudly recorded) instead of refusing the rollout."""
    venv: Path = field(default_factory=miniswe_venv)
    name: str = "mini-swe-agent"
    warm: bool = True
    """Rollouts forked by warm workers; False: the ``mini`` CLI per rollout."""
    worker_name = "mini-swe-agent worker"

    def config(
        self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float, sandbox: list[str]
    ) -> dict:
        """Our layer of its config, on top of its own mode file; with the task's test feedback, ``TEST_ALIAS`` runs
        it (its own limits bound it; the rollout's timeout bounds all)."""
        feedback = {"test_command": list(task.test_command), "test_alias": TEST_ALIAS, "test_timeout": int(timeout_s)}
        return {
            "agent": {
                "step_limit": self.step_limit,
                "cost_limit": 0,
                "wall_time_limit_seconds": max(1, int(timeout_s - STOP_MARGIN_S)),
            },
            "model": {
                "model_name": f"openai/{endpoint.model}",
                "model_class": "litellm" if self.tools else "litellm_textbased",
                "model_kwargs": {"api_base": endpoint.base_url, "drop_params": True},
            },
            "environment": {
                "environment_class": ENV_CLASS,
                "cwd": str(ws.repo),
                "timeout": self.command_timeout_s,
                "sandbox": sandbox,
                **(feedback if task.test_command else {}),
            },
        }

    def command(self, task: AgentTask, config_file: Path, trajectory: Path) -> list[str]:
        mode = "mini.yaml" if self.tools else "mini_textbased.yaml"
        instruction = task.instruction + (feedback_note(task.test_rounds) if task.test_command else "")
        return [
            str(self.venv / "bin" / "mini"),
            *("--yolo", "--exit-immediately", "-c", mode, "-c", str(config_file)),
            *("-o", str(trajectory), "-t", instruction),
        ]  # fmt: skip

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        if not (self.venv / "bin" / "mini").exists():
            raise RuntimeError(
                f"mini-swe-agent is not installed in {self.venv}: run jobs/setup.sh (or set AITLRT_MINISWE_VENV)"
            )
        prefix, isolation = shell_sandbox(ws.repo, self.command_timeout_s)
        if isolation.startswith(NO_ISOLATION) and not self.allow_unsandboxed:
            raise RuntimeError(f"mini-swe-agent's commands would run unisolated ({isolation})")
        home = ws.scratch / "home"
        home.mkdir(exist_ok=True)
        config_file = ws.scratch / "mini-swe-agent.yaml"
        config_file.write_text(json.dumps(self.config(task, ws, endpoint, timeout_s, list(prefix))))  # JSON is YAML
        log = ws.scratch / "agent.log"
        run = self._run_warm if self.warm else run_process_group
        exit = run(
            self.command(task, config_file, ws.scratch / "trajectory.json"),
            cwd=ws.repo,
            env=miniswe_env(home, endpoint.api_key),
            log_path=log,
            timeout_s=timeout_s,
        )
        with open(log, "a") as out:
            out.write(f"\nisolation: {isolation}\n")
        return AgentExit(exit.returncode, exit.timed_out, tail(log), exit.seconds)

    def _new_worker(self, scratch: Path) -> Worker:
        script = ENV_DIR / "miniswe_worker.py"
        return Worker(self.venv / "bin" / "python", script, miniswe_env(scratch, ""), scratch)

    def _run_warm(
        self, cmd: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, timeout_s: float
    ) -> ProcessExit:
        """``cmd`` (``mini ARGS``) as ``run_process_group`` runs it, forked by a warm worker: the same environment,
        working directory and log, its process group killed at ``timeout_s`` (by the worker, which reaps it: no pid
        is signalled after its reuse). A worker that dies, or does not report the kill, is killed and replaced
        (its child gets SIGKILL with it)."""
        start = time.monotonic()
        worker = self._take()
        worker.send({"argv": cmd, "cwd": str(cwd), "env": env, "log": str(log_path)})
        reply = worker.read(start + timeout_s - time.monotonic())
        timed_out = reply is None and worker.alive()
        if timed_out:
            worker.send({"kill": True})
            reply = worker.read(KILL_WAIT_S)
        if reply is None:
            self._retire(worker)
            code = None if timed_out else worker.proc.returncode
            return ProcessExit(code, timed_out, tail(log_path) + tail(worker.log, 2000), time.monotonic() - start)
        self._release(worker)
        code = None if timed_out else reply["exit_code"]
        return ProcessExit(code, timed_out, tail(log_path), time.monotonic() - start)

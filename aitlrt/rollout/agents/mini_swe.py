"""mini-swe-agent (``mini-swe-agent==2.4.6``), unmodified, as an agent: its ``mini`` CLI per rollout, from its own
virtualenv (``jobs/setup.sh`` builds ``$AITLRT_HOME/miniswe-venv``, or ``$AITLRT_MINISWE_VENV``; its litellm needs
``mcp`` to import).

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
from dataclasses import dataclass, field
from pathlib import Path

from aitlrt.common.paths import aitlrt_home
from aitlrt.common.procs import run_process_group, tail
from aitlrt.common.workspace import Workspace
from aitlrt.rollout.agents.aider import agent_env
from aitlrt.rollout.agents.base import AgentExit, AgentTask, ModelEndpoint
from aitlrt.tasks.sandbox import NO_ISOLATION, shell_sandbox

MINISWE_VERSION = "2.4.6"
ENV_CLASS = "aitlrt_shell.SandboxedEnvironment"
ENV_DIR = Path(__file__).with_name("miniswe_env")
COMMAND_TIMEOUT_S = 60
"""Seconds one shell command may run (mini-swe-agent's own default is 30)."""
STOP_MARGIN_S = 10.0
"""Seconds before the rollout's timeout that mini-swe-agent stops itself (its wall-time limit), so that it exits
with its trajectory saved rather than being killed."""


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
class MiniSweAgent:
    tools: bool = False
    """Tool-calling mode (its default ``mini.yaml``) instead of text actions (``mini_textbased.yaml``)."""
    step_limit: int = 0
    """Model calls at most (0: none but the proxy's ``max_calls``)."""
    command_timeout_s: int = COMMAND_TIMEOUT_S
    allow_unsandboxed: bool = False
    """Run the commands unisolated where no sandbox works (loudly recorded) instead of refusing the rollout."""
    venv: Path = field(default_factory=miniswe_venv)
    name: str = "mini-swe-agent"

    def config(self, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float, sandbox: list[str]) -> dict:
        """Our layer of its config, on top of its own mode file."""
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
            },
        }

    def command(self, task: AgentTask, config_file: Path, trajectory: Path) -> list[str]:
        mode = "mini.yaml" if self.tools else "mini_textbased.yaml"
        return [
            str(self.venv / "bin" / "mini"),
            *("--yolo", "--exit-immediately", "-c", mode, "-c", str(config_file)),
            *("-o", str(trajectory), "-t", task.instruction),
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
        config_file.write_text(json.dumps(self.config(ws, endpoint, timeout_s, list(prefix))))  # JSON is YAML
        log = ws.scratch / "agent.log"
        exit = run_process_group(
            self.command(task, config_file, ws.scratch / "trajectory.json"),
            cwd=ws.repo,
            env=miniswe_env(home, endpoint.api_key),
            log_path=log,
            timeout_s=timeout_s,
        )
        with open(log, "a") as out:
            out.write(f"\nisolation: {isolation}\n")
        return AgentExit(exit.returncode, exit.timed_out, tail(log), exit.seconds)

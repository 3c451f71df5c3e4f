"""Aider (``aider-chat==0.86.2``) as an agent, run headless and offline from its own virtualenv.

Its pins conflict with trl/vLLM, so it never shares our environment: ``jobs/setup.sh`` builds its venv under
``$AITLRT_HOME/aider-venv`` (or ``$AITLRT_AIDER_VENV``). The weak model (summaries, commit messages) is the
policy under the name ``<model>-weak``, whose calls carry the ``X-AITLRT-Tag: weak`` header so the trainer
can tell them apart. Both ways of running it (the CLI, warm workers) install ``edit_guard``: an edit outside the
repository or under ``.git`` is refused, and the model is told so. A task with a test command (test feedback) runs
it after each applied edit (``--test-cmd``, ``--auto-test``; ``--yes-always`` answers "Attempt to fix test
errors?"): a failing run's output goes back to the model as the next user message.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from aitlrt.common.paths import aitlrt_home
from aitlrt.common.procs import run_process_group, tail
from aitlrt.common.workspace import Workspace
from aitlrt.rollout.agents.base import AgentExit, AgentTask, ModelEndpoint
from aitlrt.rollout.agents.worker_pool import WarmWorkers, Worker

AIDER_VERSION = "0.86.2"
WEAK_TAG = "weak"
REMINDERS = ("user", "sys", "none")
"""Aider's ``reminder`` model setting: where each request repeats the edit format's rules (already in the system
prompt) -- appended to the last user message (Aider's default), as a final system message, or not at all."""


def aider_venv() -> Path:
    return Path(os.environ.get("AITLRT_AIDER_VENV") or aitlrt_home() / "aider-venv")


def aider_settings(
    endpoint: ModelEndpoint, edit_format: str, streaming: bool, reminder: str
) -> tuple[dict, list[dict]]:
    """Aider's model-metadata (context window, zero cost: no price map download) and model-settings."""
    main, weak = f"openai/{endpoint.model}", f"openai/{endpoint.model}-weak"
    meta = {
        "max_input_tokens": endpoint.context_window,
        "max_tokens": endpoint.context_window,
        "max_output_tokens": endpoint.context_window,
        "input_cost_per_token": 0.0,
        "output_cost_per_token": 0.0,
        "litellm_provider": "openai",
        "mode": "chat",
    }
    settings = [
        {
            "name": main,
            "edit_format": edit_format,
            "weak_model_name": weak,
            "use_temperature": True,
            "streaming": streaming,
            "use_repo_map": False,
            "reminder": reminder,
        },
        {
            "name": weak,
            "edit_format": edit_format,
            "weak_model_name": weak,
            "use_temperature": True,
            "streaming": streaming,
            "use_repo_map": False,
            "reminder": reminder,
            "extra_params": {"extra_headers": {"X-AITLRT-Tag": WEAK_TAG}},
        },
    ]
    return {main: meta, weak: meta}, settings


@dataclass
class AiderAgent:
    """Aider's CLI, one process per rollout (3-4 s of start-up, mostly importing litellm)."""

    edit_format: str = "whole"
    streaming: bool = False
    map_tokens: int = 0
    reminder: str = "user"
    """Aider's ``reminder`` model setting (``REMINDERS``)."""
    request_timeout_s: float = 600.0
    venv: Path = field(default_factory=aider_venv)
    name: str = "aider"

    def __post_init__(self) -> None:
        if self.reminder not in REMINDERS:
            raise ValueError(f"Aider's reminder is one of {', '.join(REMINDERS)}, not {self.reminder!r}")

    def command(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint) -> list[str]:
        """Aider's command line, run through ``edit_guard`` (edits outside the repository or under ``.git`` refused)."""
        guard = Path(__file__).with_name("edit_guard.py")
        return [str(self.venv / "bin" / "python"), str(guard), *self.arguments(task, ws, endpoint)]

    def arguments(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint) -> list[str]:
        """Aider's command-line arguments for one rollout (writes the settings files into ``ws.scratch``); the
        rollout's token is not among them (a command line is visible to every process): ``OPENAI_API_KEY``."""
        meta, settings = aider_settings(endpoint, self.edit_format, self.streaming, self.reminder)
        meta_file, settings_file = ws.scratch / "model-metadata.json", ws.scratch / "model-settings.yml"
        meta_file.write_text(json.dumps(meta))
        settings_file.write_text(json.dumps(settings))  # JSON is YAML
        args = [
            "--model",
            f"openai/{endpoint.model}",
            "--openai-api-base",
            endpoint.base_url,
            "--model-metadata-file",
            str(meta_file),
            "--model-settings-file",
            str(settings_file),
            "--edit-format",
            self.edit_format,
            "--map-tokens",
            str(self.map_tokens),
            "--timeout",
            str(self.request_timeout_s),
            "--yes-always",
            "--no-pretty",
            "--no-fancy-input",
            "--no-notifications",
            "--no-stream",
            "--no-auto-commits",
            "--no-dirty-commits",
            "--no-gitignore",
            "--no-check-update",
            "--no-show-release-notes",
            "--no-show-model-warnings",
            "--no-analytics",
            "--no-suggest-shell-commands",
            "--no-detect-urls",
            "--no-auto-lint",
            *self.test_arguments(task, endpoint.context_window),
            "--no-restore-chat-history",
            "--input-history-file",
            "/dev/null",
            "--chat-history-file",
            str(ws.scratch / "chat-history.md"),
            "--llm-history-file",
            str(ws.scratch / "llm-history.txt"),
            "--message",
            task.instruction,
            *task.files,
        ]
        if self.streaming:
            args.remove("--no-stream")
        return args

    @staticmethod
    def test_arguments(task: AgentTask, context_window: int) -> list[str]:
        """Aider runs the task's test command after each applied edit, when it has one; its chat history is then
        never summarised below the context window (the weak model's summaries of a history past 1,024 tokens,
        which a test report passes, spent calls of the rollout's ``max_calls`` and were never used)."""
        if not task.test_command:
            return ["--no-auto-test"]
        history = ["--max-chat-history-tokens", str(context_window)]
        return ["--test-cmd", shlex.join(task.test_command), "--auto-test", *history]

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        if not (self.venv / "bin" / "aider").exists():
            raise RuntimeError(f"Aider is not installed in {self.venv}: run jobs/setup.sh (or set AITLRT_AIDER_VENV)")
        home = ws.scratch / "home"
        home.mkdir(exist_ok=True)
        cmd = self.command(task, ws, endpoint)
        env = {**agent_env(home), "OPENAI_API_KEY": endpoint.api_key}
        return run_process_group(cmd, cwd=ws.repo, env=env, log_path=ws.scratch / "agent.log", timeout_s=timeout_s)


def agent_env(home: Path) -> dict[str, str]:
    """A clean, offline environment with a private HOME: nothing of ours leaks in, nothing is written outside."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "BROWSER": "true",
        "NO_COLOR": "1",
        "TERM": "dumb",
        "HF_HUB_OFFLINE": "1",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "aitlrt-agent",
        "GIT_AUTHOR_EMAIL": "agent@localhost",
        "GIT_COMMITTER_NAME": "aitlrt-agent",
        "GIT_COMMITTER_EMAIL": "agent@localhost",
    }


@dataclass
class WarmAiderAgent(AiderAgent, WarmWorkers):
    """Aider in warm worker processes: start-up is paid once per worker, not per rollout.

    Each worker runs one rollout at a time, exactly as the CLI would (same arguments, ``aider.main.main``).
    A worker that times out or dies is killed with its process group and replaced; workers are also
    recycled after ``jobs_per_worker`` rollouts so no state accumulates. Sets Aider's ``max_reflections`` too,
    which the CLI cannot (its 3 serve every retry: a file to add, an edit that did not apply, a test round).
    """

    max_reflections: int = 3
    """Aider's retries within a rollout besides the task's test rounds, which come on top (the test command counts
    its own rounds)."""
    jobs_per_worker: int = 50
    name: str = "aider-warm"
    worker_name = "Aider worker"

    def _new_worker(self, scratch: Path) -> Worker:
        script = Path(__file__).with_name("aider_worker.py")
        return Worker(self.venv / "bin" / "python", script, agent_env(scratch), scratch)

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        if not (self.venv / "bin" / "python").exists():
            raise RuntimeError(f"Aider is not installed in {self.venv}: run jobs/setup.sh (or set AITLRT_AIDER_VENV)")
        start = time.monotonic()
        worker = self._take()
        home = ws.scratch / "home"
        home.mkdir(exist_ok=True)
        log = ws.scratch / "agent.log"
        job = {
            "argv": [*self.arguments(task, ws, endpoint), "--openai-api-key", endpoint.api_key],  # over a pipe
            "cwd": str(ws.repo),
            "home": str(home),
            "log": str(log),
            "max_reflections": self.max_reflections + task.test_rounds,
        }
        worker.send(job)
        reply = worker.read(timeout_s - (time.monotonic() - start))
        seconds = time.monotonic() - start
        if reply is None:
            timed_out = worker.alive()
            self._retire(worker)
            code = None if timed_out else worker.proc.returncode
            return AgentExit(code, timed_out, tail(log) + tail(worker.log, 2000), seconds)
        self._release(worker)
        return AgentExit(reply["exit_code"], False, tail(log), seconds)

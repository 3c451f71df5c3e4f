"""Aider (``aider-chat==0.86.2``) as an agent, run headless and offline from its own virtualenv.

Its pins conflict with trl/vLLM, so it never shares our environment: ``jobs/setup.sh`` builds its venv under
``$AITLRT_HOME/aider-venv`` (or ``$AITLRT_AIDER_VENV``). The weak model (summaries, commit messages) is the
policy under the name ``<model>-weak``, whose calls carry the ``X-AITLRT-Tag: weak`` header so the trainer
can tell them apart.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from aitlrt.agents.base import AgentExit, AgentTask, ModelEndpoint, run_process_group
from aitlrt.paths import aitlrt_home
from aitlrt.workspace import Workspace

AIDER_VERSION = "0.86.2"
WEAK_TAG = "weak"


def aider_venv() -> Path:
    return Path(os.environ.get("AITLRT_AIDER_VENV") or aitlrt_home() / "aider-venv")


def aider_settings(endpoint: ModelEndpoint, edit_format: str, streaming: bool) -> tuple[dict, list[dict]]:
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
        },
        {
            "name": weak,
            "edit_format": edit_format,
            "weak_model_name": weak,
            "use_temperature": True,
            "streaming": streaming,
            "use_repo_map": False,
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
    request_timeout_s: float = 600.0
    venv: Path = field(default_factory=aider_venv)
    name: str = "aider"

    def command(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint) -> list[str]:
        meta, settings = aider_settings(endpoint, self.edit_format, self.streaming)
        meta_file, settings_file = ws.scratch / "model-metadata.json", ws.scratch / "model-settings.yml"
        meta_file.write_text(json.dumps(meta))
        settings_file.write_text(json.dumps(settings))  # JSON is YAML
        return [
            str(self.venv / "bin" / "aider"),
            "--model",
            f"openai/{endpoint.model}",
            "--openai-api-base",
            endpoint.base_url,
            "--openai-api-key",
            endpoint.api_key,
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
            "--no-auto-test",
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

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        if not (self.venv / "bin" / "aider").exists():
            raise RuntimeError(f"Aider is not installed in {self.venv}: run jobs/setup.sh (or set AITLRT_AIDER_VENV)")
        home = ws.scratch / "home"
        home.mkdir(exist_ok=True)
        cmd = self.command(task, ws, endpoint)
        if self.streaming:
            cmd.remove("--no-stream")
        return run_process_group(
            cmd, cwd=ws.repo, env=agent_env(home), log_path=ws.scratch / "agent.log", timeout_s=timeout_s
        )


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

"""The agent protocol: run on a workspace with a task and an OpenAI endpoint, report how the process ended.

The patch and the outcome are judged by the rollout runner from the workspace and the proxy's trace, never
from the agent's own word (Aider exits 0 even when every call failed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from aitlrt.common.procs import ProcessExit
from aitlrt.common.workspace import Workspace


@dataclass(frozen=True)
class AgentTask:
    task_id: str
    instruction: str
    """What to do: the problem statement."""
    files: tuple[str, ...] = ()
    """Files to open for the agent up front (paths relative to the repository), if known."""
    test_command: tuple[str, ...] = ()
    """The task's test feedback (``aitlrt.tasks.feedback``): an argv run with the repository as working directory
    after an edit, which prints the test output (truncated) and exits 0 iff the task's tests pass; empty: none."""
    test_rounds: int = 0
    """How many times at most the failing tests' output goes back to the model for another try."""


@dataclass(frozen=True)
class ModelEndpoint:
    base_url: str
    """OpenAI base URL for this rollout, e.g. ``http://127.0.0.1:8000/rollouts/<id>/v1``."""
    model: str
    """Served model name."""
    api_key: str = "aitlrt"
    context_window: int = 8192


AgentExit = ProcessExit
"""How an agent's process ended."""


class Agent(Protocol):
    name: str

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        """Work on ``ws.repo`` until done or ``timeout_s``; never outlive the call."""
        ...

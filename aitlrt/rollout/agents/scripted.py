"""Trivial policies: a scripted agent that makes a fixed edit per task, the yardsticks a held-out number is read
against (``trivial:no-edit``, ``trivial:comment``, ``trivial:whitespace``, ``trivial:reject-file``,
``trivial:no-op-code``, and the oracle's fix as the ceiling).

The edits are computed by trusted code from the tasks (``trivial_edits``), never from a model. The agent still makes
one tiny model call through its rollout's endpoint, so that the proxy records the rollout like any other (the runner
counts a rollout without an answered call as an infrastructure failure), then applies its edit to the workspace.
"""

from __future__ import annotations

import difflib
import logging
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from aitlrt.common.git import git
from aitlrt.common.keys import bearer
from aitlrt.common.workspace import Workspace
from aitlrt.rollout.agents.base import AgentExit, AgentTask, ModelEndpoint
from aitlrt.tasks.patches import changed_paths

if TYPE_CHECKING:
    from aitlrt.rollout.batch import PreparedTask

log = logging.getLogger(__name__)

TRIVIAL_POLICIES = (
    "trivial:no-edit",
    "trivial:comment",
    "trivial:whitespace",
    "trivial:reject-file",
    "trivial:no-op-code",
    "trivial:oracle",
)
"""Checkpoint labels of the scripted policies (``aitlrt.evaluation.checkpoints.evaluate``)."""
APPENDED = {"trivial:comment": "# reviewed\n", "trivial:whitespace": "\n", "trivial:no-op-code": "pass\n"}
"""What the appending policies add at the end of the task's file (on a line of its own). ``trivial:no-op-code``'s
``pass`` is code that does nothing: the cheapest edit a reward paying changed code (``code_edit``) pays
(docs/decisions/0024-reward-fix-and-closeness.md)."""
REJECT_SUFFIX = ".rej"
"""``trivial:reject-file`` adds, beside the task's file, what GNU patch leaves of a hunk that did not apply
(``FILE.rej``: the comment policy's hunk) and changes no file: a shell agent's failed ``patch`` makes that edit, and
the mini recipe's GRPO raised it (docs/decisions/0023-reject-file-policy.md)."""


def _target(task: PreparedTask) -> str | None:
    """The file a trivial edit touches: the task's first file, else the first the oracle changes."""
    paths = task.task.files or tuple(changed_paths(task.task.patch))
    return paths[0] if paths else None


def _appending_patch(path: str, old: str, addition: str) -> str:
    """A unified diff that appends ``addition`` to ``path`` (text ``old``) on a line of its own."""
    new = old + ("\n" if old and not old.endswith("\n") else "") + addition
    lines = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _new_file_patch(path: str, text: str) -> str:
    """A unified diff that creates ``path`` holding ``text`` (which ends with a newline)."""
    return "".join(difflib.unified_diff([], text.splitlines(True), "/dev/null", f"b/{path}"))


def trivial_edit(policy: str, task: PreparedTask) -> str:
    """The patch ``policy`` makes on ``task`` (empty: no edit): computed from the task, never from a model."""
    if policy not in TRIVIAL_POLICIES:
        raise ValueError(f"unknown trivial policy {policy!r} (one of {', '.join(TRIVIAL_POLICIES)})")
    if policy == "trivial:oracle":
        return task.task.patch
    path = _target(task)
    if policy == "trivial:no-edit" or path is None:
        return ""
    try:
        old = git("show", f"{task.base_commit}:{path}", cwd=task.repo)
    except RuntimeError as exc:
        log.warning("%s: %s makes no edit: no %s at the task's start (%s)", task.task.instance_id, policy, path, exc)
        return ""
    if policy == "trivial:reject-file":
        return _new_file_patch(path + REJECT_SUFFIX, _appending_patch(path, old, APPENDED["trivial:comment"]))
    return _appending_patch(path, old, APPENDED[policy])


def trivial_edits(policy: str, tasks: Sequence[PreparedTask]) -> dict[str, str]:
    """``trivial_edit`` of every task, by task id."""
    return {p.task.instance_id: trivial_edit(policy, p) for p in tasks}


@dataclass
class ScriptedAgent:
    """Applies ``edits[task_id]`` (a patch; empty or absent: none) after one tiny model call. Deterministic."""

    edits: Mapping[str, str]
    name: str = "scripted"

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        start = time.monotonic()
        notes = [_one_call(endpoint, timeout_s)]
        returncode = 0
        patch = self.edits.get(task.task_id, "")
        if patch.strip():
            try:
                git("apply", "--whitespace=nowarn", "-", cwd=ws.repo, input=patch, timeout=timeout_s)
                notes.append(f"applied {patch.count(chr(10))} patch lines")
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                returncode = 1
                notes.append(f"the scripted edit does not apply: {exc}")
        return AgentExit(returncode, False, "\n".join(notes), time.monotonic() - start)


def _one_call(endpoint: ModelEndpoint, timeout_s: float) -> str:
    """One chat call of one token through the rollout's endpoint; what came of it, for the log."""
    body = {"model": endpoint.model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 1}
    try:
        resp = httpx.post(
            f"{endpoint.base_url}/chat/completions", json=body, headers=bearer(endpoint.api_key), timeout=timeout_s
        )
    except httpx.HTTPError as exc:  # the runner judges from the proxy's trace
        return f"model call failed: {exc}"
    return f"model call: {resp.status_code}"

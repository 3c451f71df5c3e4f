"""A minimal agent of our own: one chat call that shows the task and the files, whole-file edits back.

It proves the agent protocol is not Aider-shaped, and it is a cheap agent for tests. The reply format is
Aider's ``whole`` format: a line with the file's path, then the file's full new content in a fenced block.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from aitlrt.common.procs import run_process_group
from aitlrt.common.workspace import Workspace
from aitlrt.rollout.agents.base import AgentExit, AgentTask, ModelEndpoint
from aitlrt.rollout.agents.edit_guard import refusal

FILE_BLOCK = re.compile(r"^(?P<path>[^\s`][^\n`]*)\n```[^\n]*\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)
SYSTEM = (
    "You edit code. For every file you change or create, reply with its path on a line of its own "
    "followed by the file's complete new content in a fenced code block."
)


@dataclass
class SingleCallAgent:
    max_tokens: int | None = None
    name: str = "single-call"

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        job = {
            "base_url": endpoint.base_url,
            "model": endpoint.model,
            "api_key": endpoint.api_key,
            "instruction": task.instruction,
            "files": list(task.files),
            "max_tokens": self.max_tokens,
        }
        env = {"PATH": "/usr/bin:/bin", "HOME": str(ws.scratch), "LANG": "C.UTF-8"}
        return run_process_group(
            [sys.executable, "-m", "aitlrt.rollout.agents.single_call"],
            cwd=ws.repo,
            env=env,
            log_path=ws.scratch / "agent.log",
            timeout_s=timeout_s,
            stdin_text=json.dumps(job),
        )


def apply_whole_files(reply: str, root: Path) -> list[str]:
    """Write every ``path`` + fenced block of ``reply`` under ``root``; paths ``edit_guard`` refuses (outside
    ``root`` or under ``.git``) are skipped."""
    written = []
    for match in FILE_BLOCK.finditer(reply):
        rel = match["path"].strip().strip("*`:")
        if why := refusal(root, rel):
            print(f"skipping unsafe path {rel!r}: {why}")
            continue
        target = (root / rel).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(match["body"])
        written.append(rel)
    return written


def main() -> int:
    import httpx

    job = json.load(sys.stdin)
    root = Path.cwd()
    shown = "\n\n".join(f"{f}\n```\n{(root / f).read_text()}```" for f in job["files"] if (root / f).is_file())
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"{shown}\n\n{job['instruction']}".strip()},
    ]
    body = {"model": job["model"], "messages": messages}
    if job.get("max_tokens"):
        body["max_tokens"] = job["max_tokens"]
    resp = httpx.post(
        f"{job['base_url']}/chat/completions",
        json=body,
        timeout=600,
        headers={"Authorization": f"Bearer {job['api_key']}"},
    )
    if resp.status_code != 200:
        print(f"model call failed: {resp.status_code} {resp.text[:500]}")
        return 0  # like Aider: the runner judges from the trace
    reply = resp.json()["choices"][0]["message"]["content"] or ""
    print(f"reply:\n{reply}\nwrote: {apply_whole_files(reply, root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

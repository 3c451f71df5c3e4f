"""``git()``: every git command of ours, with a fixed identity, no prompts, and none of a repository's hooks."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": "aitlrt",
    "GIT_AUTHOR_EMAIL": "aitlrt@localhost",
    "GIT_COMMITTER_NAME": "aitlrt",
    "GIT_COMMITTER_EMAIL": "aitlrt@localhost",
    # An agent may write into its copy's .git: none of our git calls runs its hooks or its fsmonitor command.
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.hooksPath",
    "GIT_CONFIG_VALUE_0": "/dev/null",
    "GIT_CONFIG_KEY_1": "core.fsmonitor",
    "GIT_CONFIG_VALUE_1": "false",
}


def git(
    *args: str | Path,
    cwd: Path,
    check: bool = True,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> str:
    """Run git in ``cwd`` with a fixed identity and no prompts; return stdout."""
    env = {**os.environ, **GIT_ENV, **(env or {})}
    proc = subprocess.run(
        ["git", *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, input=input
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(map(str, args))} failed in {cwd}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout

"""``git()``: every git command of ours, with a fixed identity, no prompts, and none of a repository's hooks.

``trusted_git()`` runs git on a git directory of ours over a work tree an agent edited: with nothing of the
environment, the user's or the system's configuration, and no hook, fsmonitor or attributes file (see
``aitlrt.common.workspace``).
"""

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


# Fixed identity and dates: a commit of the same tree and message always has the same sha.
FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "aitlrt",
    "GIT_AUTHOR_EMAIL": "aitlrt@localhost",
    "GIT_COMMITTER_NAME": "aitlrt",
    "GIT_COMMITTER_EMAIL": "aitlrt@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
_TRUSTED_CONFIG = {
    "core.hooksPath": "/dev/null",
    "core.fsmonitor": "false",
    "core.attributesFile": "/dev/null",
}


def trusted_env(git_dir: Path, work_tree: Path | None = None) -> dict[str, str]:
    """The whole environment of a trusted git call: none of ours (no ``GIT_*``, no tokens), no global or system
    configuration or attributes, a HOME that does not exist, the repository and work tree given explicitly."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LC_ALL": "C",
        "HOME": "/nonexistent",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_DIR": str(git_dir),
        "GIT_CONFIG_COUNT": str(len(_TRUSTED_CONFIG)),
        **FIXED_IDENTITY,
    }
    for i, (key, value) in enumerate(_TRUSTED_CONFIG.items()):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    if work_tree is not None:
        env["GIT_WORK_TREE"] = str(work_tree)
    return env


def trusted_git(
    *args: str | Path,
    git_dir: Path,
    work_tree: Path | None = None,
    input: str | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Run git on ``git_dir`` (ours) over ``work_tree`` in ``trusted_env`` (plus ``env``); return stdout."""
    proc = subprocess.run(
        ["git", *map(str, args)],
        cwd=work_tree or git_dir,
        env={**trusted_env(git_dir, work_tree), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        input=input,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(map(str, args))} failed on {git_dir}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


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

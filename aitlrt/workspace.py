"""Workspaces: one cached repository per source, and a private, cheap copy of it per rollout.

The cache is a plain git repository; a rollout's copy is ``git clone --shared`` of it (objects borrowed through
``.git/objects/info/alternates``, nothing copied but the checked-out files) at the task's base commit. Copies
live under ``$AITLRT_SCRATCH/workspaces/<owner pid>-<rollout id>`` (``AITLRT_SCRATCH`` defaults to ``AITLRT_HOME``)
and are always removed: on exit of the context manager, and on the next start for copies whose owner process is
gone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from aitlrt.paths import aitlrt_home, scratch_dir

GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": "aitlrt",
    "GIT_AUTHOR_EMAIL": "aitlrt@localhost",
    "GIT_COMMITTER_NAME": "aitlrt",
    "GIT_COMMITTER_EMAIL": "aitlrt@localhost",
}
# Agent droppings that must never be part of a patch.
EXCLUDES = (".aider*", ".aitlrt*")


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


def workspaces_root() -> Path:
    return scratch_dir() / "workspaces"


def cache_local_repo(path: Path) -> Path:
    """The cache for a local directory: the repository itself if it is one, else a git repository made from
    a copy of it (one commit holding every file), kept under ``$AITLRT_HOME/repos``."""
    path = Path(path).resolve()
    if (path / ".git").exists():
        return path
    key = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    repo = aitlrt_home() / "repos" / f"{path.name}-{key}"
    if (repo / ".git").exists():
        return repo
    tmp = repo.with_name(f"{repo.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(path, tmp, symlinks=True)
    git("init", "-q", cwd=tmp)
    git("add", "-A", cwd=tmp)
    git("commit", "-q", "--no-verify", "-m", f"aitlrt base: {path.name}", cwd=tmp)
    tmp.rename(repo)
    return repo


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reclaim_stale(root: Path | None = None) -> list[Path]:
    """Remove workspaces whose owner process no longer exists (a crashed parent); return them."""
    root = root or workspaces_root()
    removed = []
    for entry in root.glob("*-*") if root.exists() else ():
        owner = entry.name.split("-", 1)[0]
        if owner.isdigit() and not _owner_alive(int(owner)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


@dataclass(frozen=True)
class Workspace:
    repo: Path
    """The private checkout the agent edits."""
    scratch: Path
    """A private directory beside it for the agent's HOME, logs and settings (never part of the patch)."""


@contextmanager
def workspace(repo: Path, commit: str, rollout_id: str, root: Path | None = None) -> Iterator[Workspace]:
    """A private copy of ``repo`` at ``commit`` for one rollout; removed afterwards, whatever happens."""
    root = root or workspaces_root()
    root.mkdir(parents=True, exist_ok=True)
    top = root / f"{os.getpid()}-{rollout_id}"
    shutil.rmtree(top, ignore_errors=True)
    try:
        top.mkdir()
        ws = Workspace(top / "repo", top / "scratch")
        ws.scratch.mkdir()
        git("clone", "-q", "--shared", "--no-checkout", repo, ws.repo, cwd=top)
        git("checkout", "-q", "--detach", commit, cwd=ws.repo)
        with open(ws.repo / ".git" / "info" / "exclude", "a") as f:
            f.write("\n".join(EXCLUDES) + "\n")
        yield ws
    finally:
        shutil.rmtree(top, ignore_errors=True)


def patch_of(path: Path, base: str) -> str:
    """The workspace's change against ``base``, new and binary files included."""
    git("add", "-A", cwd=path)
    return git("diff", "--cached", "--binary", base, cwd=path)

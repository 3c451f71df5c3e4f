"""Workspaces: one cached repository per source, and a private, cheap copy of it per rollout.

The cache is a plain git repository; a rollout's copy is ``git clone --shared`` of it (objects borrowed through
``.git/objects/info/alternates``, nothing copied but the checked-out files) at the task's base commit. Writing
every file dominates that cost, so a ``WorkspacePool`` recycles copies between rollouts: a used copy is moved to
the next rollout's commit (``checkout --force`` rewrites only the files that differ, ``clean -ffdx`` drops the
rest) and must then prove itself pristine, or it is deleted. Copies live under
``$AITLRT_SCRATCH/workspaces/<owner pid>-pool-<uuid>`` (``AITLRT_SCRATCH`` defaults to ``AITLRT_HOME``) and are always
removed: on exit of the context manager or the pool, and on the next start for copies whose owner is gone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from aitlrt.common.git import git
from aitlrt.common.paths import scratch_dir

# Agent droppings that must never be part of a patch.
EXCLUDES = (".aider*", ".aitlrt*")


def workspaces_root() -> Path:
    return scratch_dir() / "workspaces"


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


def _fresh_copy(repo: Path, commit: str, top: Path) -> Workspace:
    top.mkdir(parents=True)
    ws = Workspace(top / "repo", top / "scratch")
    ws.scratch.mkdir()
    git("clone", "-q", "--shared", "--no-checkout", repo, ws.repo, cwd=top)
    git("checkout", "-q", "--detach", commit, cwd=ws.repo)
    with open(ws.repo / ".git" / "info" / "exclude", "a") as f:
        f.write("\n".join(EXCLUDES) + "\n")
    return ws


def _recycle(ws: Workspace, commit: str) -> bool:
    """Move a used copy to ``commit`` and check it is pristine: HEAD detached there, nothing modified, staged,
    untracked or ignored. False when it is not (the caller deletes it)."""
    try:
        git("checkout", "-q", "--force", "--detach", commit, cwd=ws.repo)
        git("clean", "-q", "-ffdx", cwd=ws.repo)
        status = git("status", "--porcelain=v2", "--branch", "--ignored", "--untracked-files=all", cwd=ws.repo)
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return False
    lines = status.splitlines()
    if f"# branch.oid {commit}" not in lines or any(not line.startswith("#") for line in lines):
        return False
    shutil.rmtree(ws.scratch, ignore_errors=True)
    ws.scratch.mkdir()
    return True


class WorkspacePool:
    """Private copies of cached repositories, recycled between rollouts (thread-safe).

    ``workspace(repo, commit)`` hands out an idle copy of ``repo`` moved to ``commit`` when there is one (the
    one last at ``commit`` first), else a fresh copy. At most ``max_idle`` copies are kept idle (least recently
    used go first); ``max_idle=0`` gives every rollout a fresh copy. ``close()`` removes them all.
    """

    def __init__(self, root: Path | None = None, max_idle: int = 8) -> None:
        self.root = root or workspaces_root()
        self.max_idle = max_idle
        self._idle: OrderedDict[Path, tuple[Path, str]] = OrderedDict()  # top -> (repo, commit), LRU first
        self._lock = threading.Lock()
        self.fresh = self.recycled = 0

    def _take_idle(self, repo: Path, commit: str) -> Path | None:
        with self._lock:
            mine = [top for top, (r, _) in self._idle.items() if r == repo]
            if not mine:
                return None
            top = next((t for t in reversed(mine) if self._idle[t][1] == commit), mine[-1])
            del self._idle[top]
            return top

    @contextmanager
    def workspace(self, repo: Path, commit: str) -> Iterator[Workspace]:
        """A private, pristine copy of ``repo`` at ``commit`` for one rollout."""
        repo = Path(repo)
        top = self._take_idle(repo, commit)
        if top is not None and _recycle(ws := Workspace(top / "repo", top / "scratch"), commit):
            self.recycled += 1
        else:
            if top is not None:
                shutil.rmtree(top, ignore_errors=True)
            top = self.root / f"{os.getpid()}-pool-{uuid.uuid4().hex[:12]}"
            try:
                ws = _fresh_copy(repo, commit, top)
            except BaseException:
                shutil.rmtree(top, ignore_errors=True)
                raise
            self.fresh += 1
        keep = False
        try:
            yield ws
            keep = True
        finally:
            self._release(top, repo, commit, keep)

    def _release(self, top: Path, repo: Path, commit: str, keep: bool) -> None:
        evict = [top]
        if keep and self.max_idle > 0:
            with self._lock:
                self._idle[top] = (repo, commit)
                evict = []
                while len(self._idle) > self.max_idle:
                    evict.append(self._idle.popitem(last=False)[0])
        for old in evict:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Remove every idle copy."""
        with self._lock:
            tops, self._idle = list(self._idle), OrderedDict()
        for top in tops:
            shutil.rmtree(top, ignore_errors=True)


def workspace(repo: Path, commit: str, root: Path | None = None) -> AbstractContextManager[Workspace]:
    """A fresh private copy of ``repo`` at ``commit``; removed afterwards, whatever happens."""
    return WorkspacePool(root, max_idle=0).workspace(repo, commit)


def patch_of(path: Path, base: str) -> str:
    """The workspace's change against ``base``, new and binary files included."""
    git("add", "-A", cwd=path)
    return git("diff", "--cached", "--binary", base, cwd=path)

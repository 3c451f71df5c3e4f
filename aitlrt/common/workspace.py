"""Workspaces: private copies of a cached repository, one per rollout (agent copies) or per grade (plain copies).

**An agent copy** (``WorkspacePool.workspace``) holds the task and nothing else, and its patch is taken by git the
agent cannot reach:

- ``repo/`` is the work tree at the tree of the task's base commit (base + setup patch), and ``repo/.git`` a
  repository of one commit of that tree: no parent, a neutral message (``task``), a fixed identity and date (so
  the same tree always gives the same sha), HEAD detached on it, no refs, tags, reflog or alternates, and one pack
  of exactly that commit's objects. ``git log --all``, ``git cat-file --batch-all-objects`` and ``git diff HEAD~1``
  show nothing of the fix (the setup commit's parent), of other tasks, or of later commits. That ``.git`` is a copy
  of a *seed* built once per tree (kept per pool, least recently used dropped); the agent may use it, and whatever
  it does there stays there.
- The patch is never taken from ``repo/.git``. Beside ``repo/`` a *trusted* git directory of ours
  (``git-<random>/``: its own index, HEAD on the same commit, the cache's objects as alternates, a config and
  ``info/exclude`` we wrote) takes it, with ``GIT_DIR``/``GIT_WORK_TREE`` and nothing of the environment, no global
  or system configuration or attributes file, no hooks or fsmonitor, a HOME that does not exist, and
  ``--no-ext-diff --no-textconv`` (``aitlrt.common.git.trusted_git``). A ``.gitattributes`` an agent writes can name
  filters or diff drivers, but only configuration defines them, and ours defines none.
- ``patch_of`` refuses the patch (``RefusedPatch``, recorded as the rollout's reason) when anything under
  ``repo/.git`` but its index and loose objects changed (its config, HEAD, refs, info, hooks, packs...), or when
  anything of the trusted directory did: the agents refuse such edits (``aitlrt.rollout.agents.edit_guard``), so
  this is what a way around them would still meet.
- Recycling (``WorkspacePool``, between rollouts): the trusted git moves the work tree to the next task's tree
  (``clean -ffdx``, then ``checkout --force``: attributes from the new tree, not the agent's), the copy must prove
  itself pristine, and ``repo/.git`` is made fresh: replaced by a copy of the next tree's seed (config, info,
  hooks, refs, objects: all as new) or, where the agent changed nothing there but its index and loose objects,
  those dropped and the seed's pack put in. A copy whose trusted directory changed, or not pristine, is deleted.

**A plain copy** (``workspace()``) is ``git clone --shared`` of the cache at a commit, with its history: for our
own tools (the grader, the task generator), never for an agent.

Copies live under ``$AITLRT_SCRATCH/workspaces/<owner pid>-pool-<uuid>`` (``AITLRT_SCRATCH`` defaults to
``AITLRT_HOME``), a pool's seeds under ``<owner pid>-seeds-<uuid>``; all are removed on exit of the context manager
or the pool, and on the next start for those whose owner is gone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aitlrt.common.git import git, trusted_git
from aitlrt.common.paths import scratch_dir

log = logging.getLogger(__name__)

# Agent droppings that must never be part of a patch.
EXCLUDES = (".aider*", ".aitlrt*")
TASK_MESSAGE = "task"
# An identity of its own: Aider writes one into a config that has none.
_CONFIG = (
    "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n\tlogallrefupdates = false\n"
    "[user]\n\tname = aitlrt\n\temail = aitlrt@localhost\n"
)
_LOOSE = re.compile(r"objects/[0-9a-f]{2}(/|$)")
_GIT_DIR = re.compile(r"git-[0-9a-f]{12}")
"""The name of an agent copy's trusted git directory, beside its work tree."""
_MUTABLE = {"index", "index.lock"}
"""What git itself changes in a git directory when an agent adds files (besides loose objects)."""


class RefusedPatch(Exception):
    """The agent changed what it may not (under ``.git``, or our git directory): its patch is not taken."""


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
    git_dir: Path | None = None
    """An agent copy's trusted git directory, outside ``repo``, that its patch is taken with (None: a plain copy)."""
    head: str = ""
    """The commit ``repo`` is at: for an agent copy, the one neutral commit of the task's tree."""
    seal: tuple[frozenset, frozenset] = field(default=(frozenset(), frozenset()), repr=False, compare=False)
    """Fingerprints of ``repo/.git`` and ``git_dir`` when the copy was handed out."""


def _skeleton(git_dir: Path, head: str = "") -> None:
    """A git directory of ours, by hand: HEAD (detached on ``head``), config, ``info/exclude``, empty refs."""
    for sub in ("objects/info", "objects/pack", "refs/heads", "refs/tags", "info"):
        (git_dir / sub).mkdir(parents=True, exist_ok=True)
    (git_dir / "HEAD").write_text(f"{head}\n" if head else "ref: refs/heads/main\n")
    (git_dir / "config").write_text(_CONFIG)
    (git_dir / "info" / "exclude").write_text("\n".join(EXCLUDES) + "\n")


def _objects_of(repo: Path) -> str:
    """The object directory of the cached repository ``repo``."""
    return git("rev-parse", "--path-format=absolute", "--git-path", "objects", cwd=repo).strip()


def _fingerprint(git_dir: Path) -> frozenset:
    """Every entry of ``git_dir`` (its type, inode, size and modification time; directories by name) except its
    index and loose objects: what an agent may not change there."""
    try:
        top = os.lstat(git_dir)
    except FileNotFoundError:
        return frozenset()
    entries: set[tuple] = {("", stat.S_IFMT(top.st_mode), top.st_ino)}
    if not stat.S_ISDIR(top.st_mode):
        return frozenset(entries)
    for dirpath, dirnames, filenames in os.walk(git_dir):
        for name in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), git_dir)
            if rel in _MUTABLE or _LOOSE.match(rel):
                continue
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISDIR(st.st_mode):
                entries.add((rel, "dir"))
            else:
                entries.add((rel, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns))
    return frozenset(entries)


def _changed(before: frozenset, after: frozenset) -> list[str]:
    return sorted({entry[0] or "." for entry in before ^ after})


def _build_seed(objects: list[str], tree: str, dest: Path) -> None:
    """``dest``: a ``.git`` of one neutral commit of ``tree`` and one pack of exactly its objects, read from
    ``objects`` (the cache, and other seeds whose compressed objects the pack reuses)."""
    tmp = dest.with_name(f"{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        _skeleton(tmp)
        alternates = {"GIT_ALTERNATE_OBJECT_DIRECTORIES": ":".join(objects)}
        head = trusted_git("commit-tree", tree, "-m", TASK_MESSAGE, git_dir=tmp, env=alternates).strip()
        pack = tmp / "objects" / "pack" / "pack"
        flags = ("-c", "pack.compression=1", "pack-objects", "--revs", "-q", "--window=0")  # fast, ~10% larger
        trusted_git(*flags, pack, git_dir=tmp, input=f"{head}\n", env=alternates)
        trusted_git("prune-packed", git_dir=tmp)
        (tmp / "HEAD").write_text(f"{head}\n")
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Seeds:
    """A pool's seeds (see the module docstring), one per tree, at most ``keep`` unused ones (least recently used
    dropped; thread-safe). Building one reuses the compressed objects of the seeds already there."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root, self.keep = root, keep
        self._users: OrderedDict[str, int] = OrderedDict()  # tree -> copies in progress, least recently used first
        self._building: dict[str, threading.Lock] = {}  # tree -> held while it is built: one build per tree
        self._lock = threading.Lock()

    def copy(self, objects: str, tree: str, dest: Path, pack_only: bool = False) -> None:
        """Copy the seed of ``tree`` (built from ``objects`` if need be) to ``dest``; with ``pack_only``, into the
        ``.git`` of another seed: its pack and HEAD replace the old ones."""
        seed = self.root / tree
        with self._lock:
            self._users[tree] = self._users.pop(tree, 0) + 1
            building = self._building.setdefault(tree, threading.Lock())
            reuse = [] if seed.is_dir() else [t for t in self._users if t != tree and (self.root / t).is_dir()]
            for t in reuse:
                self._users[t] += 1  # kept while their packs are read
        try:
            with building:
                if not seed.is_dir():
                    self.root.mkdir(parents=True, exist_ok=True)
                    _build_seed([objects, *(str(self.root / t / "objects") for t in reuse)], tree, seed)
            if pack_only:
                for old in (dest / "objects" / "pack").iterdir():
                    old.unlink()
                for new in (seed / "objects" / "pack").iterdir():
                    shutil.copy2(new, dest / "objects" / "pack" / new.name)
                shutil.copy2(seed / "HEAD", dest / "HEAD")
            else:
                shutil.copytree(seed, dest)
        finally:
            self._release([tree, *reuse])

    def _release(self, trees: list[str]) -> None:
        dropped = []
        with self._lock:
            for t in trees:
                self._users[t] -= 1
            idle = [t for t, users in self._users.items() if users == 0]
            for t in idle[: max(0, len(self._users) - self.keep)]:
                del self._users[t]
                self._building.pop(t, None)
                if (self.root / t).is_dir():
                    gone = self.root / f"{t}.gone-{uuid.uuid4().hex[:8]}"
                    (self.root / t).rename(gone)
                    dropped.append(gone)
        for path in dropped:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _agent_copy(repo: Path, commit: str, top: Path, seeds: _Seeds) -> Workspace:
    """A fresh agent copy of the cached ``repo`` at ``commit``'s tree, under ``top``."""
    ws_repo, scratch, git_dir = top / "repo", top / "scratch", top / f"git-{uuid.uuid4().hex[:12]}"
    for path in (ws_repo, scratch):
        path.mkdir(parents=True)
    objects = _objects_of(repo)
    _skeleton(git_dir)
    (git_dir / "objects" / "info" / "alternates").write_text(f"{objects}\n")
    tree, head = _task_commit(git_dir, commit)
    trusted_git("read-tree", "--reset", "-u", head, git_dir=git_dir, work_tree=ws_repo)
    (git_dir / "HEAD").write_text(f"{head}\n")
    return _hand_out(ws_repo, scratch, git_dir, tree, head, objects, seeds)


def _task_commit(git_dir: Path, commit: str) -> tuple[str, str]:
    """The tree of ``commit`` and its neutral commit, written into ``git_dir`` (the same sha as its seed's)."""
    tree = trusted_git("rev-parse", "--verify", f"{commit}^{{tree}}", git_dir=git_dir).strip()
    return tree, trusted_git("commit-tree", tree, "-m", TASK_MESSAGE, git_dir=git_dir).strip()


def _hand_out(
    ws_repo: Path, scratch: Path, git_dir: Path, tree: str, head: str, objects: str, seeds: _Seeds, kept: str = ""
) -> Workspace:
    """Give ``ws_repo`` a fresh ``.git`` and the trusted index, and seal both git directories. ``kept``: the commit
    of a ``.git`` the agent left as it was handed out (but for its index and loose objects), which is made fresh in
    place: loose objects dropped and, for another tree, the seed's pack and HEAD put in; else a copy of the seed."""
    agent_git = ws_repo / ".git"
    if kept:
        for entry in (agent_git / "objects").iterdir():
            if _LOOSE.match(f"objects/{entry.name}"):
                shutil.rmtree(entry)
        (agent_git / "index.lock").unlink(missing_ok=True)
        if kept != head:
            seeds.copy(objects, tree, agent_git, pack_only=True)
    else:
        seeds.copy(objects, tree, agent_git)
    shutil.copyfile(git_dir / "index", agent_git / "index")
    return Workspace(ws_repo, scratch, git_dir, head, (_fingerprint(agent_git), _fingerprint(git_dir)))


def _recycle(ws: Workspace, repo: Path, commit: str, seeds: _Seeds) -> Workspace | None:
    """``ws`` moved to ``commit``'s tree and proved pristine, with a fresh ``.git``; None when it cannot be (the
    caller deletes it)."""
    assert ws.git_dir is not None
    if changed := _changed(ws.seal[1], _fingerprint(ws.git_dir)):
        log.warning("workspace %s not recycled: its trusted git directory changed (%s)", ws.repo, changed[:5])
        return None
    try:
        tree, head = _task_commit(ws.git_dir, commit)
        # Untracked files first (an agent's .gitattributes among them): checkout reads attributes from the new
        # tree and, for paths it lacks, from the work tree. It removes the files that were staged, then writes.
        trusted_git("clean", "-q", "-ffdx", git_dir=ws.git_dir, work_tree=ws.repo)
        trusted_git("checkout", "-q", "--force", "--detach", head, git_dir=ws.git_dir, work_tree=ws.repo)
        status = trusted_git(
            "status", "--porcelain=v2", "--branch", "--ignored", "--untracked-files=all",
            git_dir=ws.git_dir, work_tree=ws.repo,
        )  # fmt: skip
        lines = status.splitlines()
        if f"# branch.oid {head}" not in lines or any(not line.startswith("#") for line in lines):
            return None
        agent_git = ws.repo / ".git"
        kept = "" if _changed(ws.seal[0], _fingerprint(agent_git)) else ws.head
        if not kept and agent_git.is_dir() and not agent_git.is_symlink():
            shutil.rmtree(agent_git)
        elif not kept:
            agent_git.unlink(missing_ok=True)  # a file or link the agent put there
        shutil.rmtree(ws.scratch, ignore_errors=True)
        ws.scratch.mkdir()
        return _hand_out(ws.repo, ws.scratch, ws.git_dir, tree, head, _objects_of(repo), seeds, kept)
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return None


def tampering(ws: Workspace) -> list[str]:
    """What changed since ``ws`` was handed out that an agent may not change: entries of ``repo/.git`` other than
    its index and loose objects, and anything of the trusted git directory."""
    agent_git, trusted = ws.seal
    changed = [f".git/{p}" for p in _changed(agent_git, _fingerprint(ws.repo / ".git"))]
    if ws.git_dir is not None and _changed(trusted, _fingerprint(ws.git_dir)):
        changed.append("the trusted git directory outside the repository")
    return changed


def patch_of(ws: Workspace) -> str:
    """An agent copy's change against its commit, new and binary files included, taken by the trusted git;
    ``RefusedPatch`` when the agent changed its ``.git`` or our git directory (``tampering``)."""
    if ws.git_dir is None:
        raise ValueError(f"{ws.repo} is a plain copy: patches are taken from agent copies only")
    if changed := tampering(ws):
        raise RefusedPatch(f"the agent changed {', '.join(changed[:10])}")
    return work_tree_patch(ws.git_dir, ws.repo, ws.head)


def agent_copy_at(repo: Path) -> Workspace:
    """The agent copy whose work tree is ``repo``, as found on disk, for our own tools that a rollout runs there
    (the test feedback): its scratch and trusted git directory beside it, its head that directory's HEAD. It carries
    no seal: take its patch with ``work_tree_patch``. ValueError when ``repo`` is not an agent copy's work tree."""
    git_dirs = [p for p in repo.parent.glob("git-*") if _GIT_DIR.fullmatch(p.name) and p.is_dir()]
    head = (git_dirs[0] / "HEAD").read_text().strip() if len(git_dirs) == 1 else ""
    if repo.name != "repo" or not re.fullmatch(r"[0-9a-f]{40}", head):
        raise ValueError(f"{repo} is not the work tree of an agent copy")
    return Workspace(repo, repo.parent / "scratch", git_dirs[0], head)


def work_tree_patch(git_dir: Path, work_tree: Path, head: str) -> str:
    """``work_tree``'s change against commit ``head``, new and binary files included, taken by the trusted git
    directory ``git_dir`` (its index is updated; ``patch_of`` checks for tampering first)."""
    trusted_git("add", "-A", git_dir=git_dir, work_tree=work_tree)
    flags = ("--cached", "--binary", "--no-ext-diff", "--no-textconv")
    return trusted_git("diff", *flags, head, git_dir=git_dir, work_tree=work_tree)


class WorkspacePool:
    """Agent copies of cached repositories, recycled between rollouts (thread-safe).

    ``workspace(repo, commit)`` hands out an idle copy of ``repo`` moved to ``commit``'s tree when there is one (the
    one last at ``commit`` first), else a fresh copy. At most ``max_idle`` copies are kept idle (least recently
    used go first); ``max_idle=0`` gives every rollout a fresh copy. ``close()`` removes them all, and the seeds.
    """

    def __init__(self, root: Path | None = None, max_idle: int = 8) -> None:
        self.root = root or workspaces_root()
        self.max_idle = max_idle
        self._idle: OrderedDict[Path, tuple[Path, str, Workspace]] = OrderedDict()  # top -> (repo, commit, ws)
        self._lock = threading.Lock()
        self._seeds = _Seeds(self.root / f"{os.getpid()}-seeds-{uuid.uuid4().hex[:12]}", keep=max(4, max_idle))
        self.fresh = self.recycled = 0

    def _take_idle(self, repo: Path, commit: str) -> tuple[Path, Workspace] | None:
        with self._lock:
            mine = [top for top, (r, _, _) in self._idle.items() if r == repo]
            if not mine:
                return None
            top = next((t for t in reversed(mine) if self._idle[t][1] == commit), mine[-1])
            return top, self._idle.pop(top)[2]

    @contextmanager
    def workspace(self, repo: Path, commit: str) -> Iterator[Workspace]:
        """A private, pristine agent copy of ``repo`` at ``commit``'s tree for one rollout."""
        repo = Path(repo)
        idle = self._take_idle(repo, commit)
        ws = _recycle(idle[1], repo, commit, self._seeds) if idle else None
        if ws is not None and idle is not None:
            top = idle[0]
            self.recycled += 1
        else:
            if idle is not None:
                shutil.rmtree(idle[0], ignore_errors=True)
            top = self.root / f"{os.getpid()}-pool-{uuid.uuid4().hex[:12]}"
            try:
                ws = _agent_copy(repo, commit, top, self._seeds)
            except BaseException:
                shutil.rmtree(top, ignore_errors=True)
                raise
            self.fresh += 1
        keep = False
        try:
            yield ws
            keep = True
        finally:
            self._release(top, repo, commit, ws, keep)

    def _release(self, top: Path, repo: Path, commit: str, ws: Workspace, keep: bool) -> None:
        evict = [top]
        if keep and self.max_idle > 0:
            with self._lock:
                self._idle[top] = (repo, commit, ws)
                evict = []
                while len(self._idle) > self.max_idle:
                    evict.append(self._idle.popitem(last=False)[0])
        for old in evict:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Remove every idle copy and the seeds."""
        with self._lock:
            tops, self._idle = list(self._idle), OrderedDict()
        for top in tops:
            shutil.rmtree(top, ignore_errors=True)
        self._seeds.close()


@contextmanager
def workspace(repo: Path, commit: str, root: Path | None = None) -> Iterator[Workspace]:
    """A plain copy (shared clone, history included) of ``repo`` at ``commit``, for our own tools, never for an
    agent; removed afterwards, whatever happens."""
    top = (root or workspaces_root()) / f"{os.getpid()}-plain-{uuid.uuid4().hex[:12]}"
    ws = Workspace(top / "repo", top / "scratch", head=commit)
    try:
        top.mkdir(parents=True)
        ws.scratch.mkdir()
        git("clone", "-q", "--shared", "--no-checkout", repo, ws.repo, cwd=top)
        git("checkout", "-q", "--detach", commit, cwd=ws.repo)
        with open(ws.repo / ".git" / "info" / "exclude", "a") as f:
            f.write("\n".join(EXCLUDES) + "\n")
        yield ws
    finally:
        shutil.rmtree(top, ignore_errors=True)

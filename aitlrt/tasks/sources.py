"""Where a task's repository comes from: a git URL at a commit, a local path, or a PyPI sdist.

Each source is materialised once into a cached git repository under ``$AITLRT_HOME/repos`` (shared by every
rollout and grading run of every task that names it) and yields the commit to start from. A task may add a
*setup patch* (SWE-smith's bug patch, or a generated mutation), committed on top of that base once per distinct
patch; the commit is deterministic (fixed identity and dates), so the same task always gets the same base sha.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from aitlrt.common.git import git
from aitlrt.common.paths import aitlrt_home, file_lock

log = logging.getLogger(__name__)

FIXED_DATES = {"GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000"}
_SHA = re.compile(r"^[0-9a-f]{7,40}$")


@dataclass(frozen=True)
class Source:
    """``kind`` is ``git`` (location = URL, commit = sha), ``local`` (location = path, commit = any revision,
    default ``HEAD``) or ``pypi`` (location = ``name==version``)."""

    kind: str
    location: str
    commit: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.location}" + (f"@{self.commit}" if self.commit else "")


def parse_source(text: str) -> Source:
    """``git:URL@SHA``, ``pypi:NAME==VERSION``, ``local:PATH[@REV]``, or a bare existing path."""
    kind, sep, rest = text.partition(":")
    if not sep or kind not in ("git", "pypi", "local"):
        if Path(text).expanduser().exists():
            return Source("local", str(Path(text).expanduser().resolve()))
        raise ValueError(f"unknown repository source {text!r} (git:URL@SHA, pypi:NAME==VERSION, local:PATH[@REV])")
    if kind == "pypi":
        if "==" not in rest:
            raise ValueError(f"pypi source needs an exact version: {text!r} (pypi:NAME==VERSION)")
        return Source("pypi", rest)
    location, _, commit = rest.rpartition("@") if "@" in rest.rsplit("/", 1)[-1] else (rest, "", "")
    if kind == "git" and not _SHA.match(commit):
        raise ValueError(f"git source needs a commit sha: {text!r} (git:URL@SHA)")
    return Source(kind, location, commit)


def repos_root() -> Path:
    return aitlrt_home() / "repos"


def _slug(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"))[:40]
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _commit_tree(repo: Path, message: str) -> str:
    """Commit everything in ``repo``'s work tree as a root commit with fixed identity and dates."""
    git("add", "-A", "-f", cwd=repo)
    git("commit", "-q", "--no-verify", "--allow-empty", "-m", message, cwd=repo, env=FIXED_DATES)
    return git("rev-parse", "HEAD", cwd=repo).strip()


def _fetch_git(source: Source) -> tuple[Path, str]:
    repo = repos_root() / f"git-{_slug(source.location)}"
    with file_lock(repo):
        if not (repo / ".git").exists():
            repo.mkdir(parents=True, exist_ok=True)
            git("init", "-q", cwd=repo)
            git("remote", "add", "origin", source.location, cwd=repo)
        if _has(repo, source):
            return repo, git("rev-parse", source.commit, cwd=repo).strip()
        fetched = subprocess.run(
            ["git", "fetch", "-q", "--depth", "1", "origin", source.commit], cwd=repo, capture_output=True, text=True
        )
        if fetched.returncode != 0:  # servers that refuse a fetch by sha: fetch everything once
            git("fetch", "-q", "origin", cwd=repo, timeout=3600)
        sha = git("rev-parse", f"{source.commit}^{{commit}}", cwd=repo).strip()
        git("update-ref", f"refs/aitlrt/base/{sha}", sha, cwd=repo)  # keep it from git gc
        return repo, sha


def _has(repo: Path, source: Source) -> bool:
    cmd = ["git", "cat-file", "-e", f"{source.commit}^{{commit}}"]
    return subprocess.run(cmd, cwd=repo, capture_output=True).returncode == 0


def _committed(repo: Path) -> bool:
    """Whether ``repo`` is a git repository of its own with a commit at ``HEAD``."""
    cmd = ["git", "--git-dir", str(repo / ".git"), "rev-parse", "-q", "--verify", "HEAD^{commit}"]
    return (repo / ".git").is_dir() and subprocess.run(cmd, capture_output=True).returncode == 0


def _unpack(archive: Path, into: Path) -> None:
    """Unpack an sdist (tar.gz or zip) with its single top-level folder stripped."""
    with tempfile.TemporaryDirectory(dir=into.parent) as tmp:
        if archive.suffix == ".zip":
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(tmp, filter="data")
        entries = list(Path(tmp).iterdir())
        top = entries[0] if len(entries) == 1 and entries[0].is_dir() else Path(tmp)
        shutil.move(str(top), into)


def _fetch_pypi(source: Source) -> tuple[Path, str]:
    """The sdist unpacked and committed, built in a scratch folder and moved into the cache only when whole; a
    half-made cache (a download, extract or commit cut off, by older versions built in place) is rebuilt."""
    repo = repos_root() / f"pypi-{source.location.replace('==', '-')}"
    with file_lock(repo):
        if repo.exists() and not _committed(repo):
            log.warning("%s is a half-made PyPI source cache (interrupted?): rebuilding it", repo)
            shutil.rmtree(repo)
        if not repo.exists():
            with tempfile.TemporaryDirectory(dir=repos_root()) as tmp:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q"]
                proc = subprocess.run([*cmd, "-d", tmp, source.location], capture_output=True, text=True)
                archives = [p for p in Path(tmp).iterdir() if p.name.endswith((".tar.gz", ".zip", ".tgz"))]
                if proc.returncode != 0 or not archives:
                    raise RuntimeError(f"pip could not download the sdist {source.location}: {proc.stderr[-1500:]}")
                built = Path(tmp) / "repo"
                _unpack(archives[0], built)
                git("init", "-q", cwd=built)
                _commit_tree(built, f"aitlrt base: {source.location} (PyPI sdist)")
                built.rename(repo)
        return repo, git("rev-parse", "HEAD", cwd=repo).strip()


def materialise(source: Source) -> tuple[Path, str]:
    """The cached git repository holding ``source``, and the full sha of its base commit."""
    if source.kind == "git":
        return _fetch_git(source)
    if source.kind == "pypi":
        return _fetch_pypi(source)
    repo = cache_local_repo(Path(source.location).expanduser())
    return repo, git("rev-parse", f"{source.commit or 'HEAD'}^{{commit}}", cwd=repo).strip()


def with_patch(repo: Path, base: str, patch: str) -> str:
    """The commit that is ``base`` plus ``patch`` (made once, without touching any work tree; cached by a ref)."""
    if not patch.strip():
        return base
    ref = f"refs/aitlrt/setup/{hashlib.sha256((base + patch).encode()).hexdigest()[:20]}"
    with file_lock(repo / ".git" / "aitlrt-setup"):
        existing = git("rev-parse", "-q", "--verify", ref, cwd=repo, check=False).strip()
        if existing:
            return existing
        with tempfile.TemporaryDirectory() as tmp:
            env = {**FIXED_DATES, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
            git("read-tree", base, cwd=repo, env=env)
            git("apply", "--cached", "--whitespace=nowarn", "-", cwd=repo, env=env, input=patch)
            tree = git("write-tree", cwd=repo, env=env).strip()
            sha = git("commit-tree", tree, "-p", base, "-m", "aitlrt: task setup patch", cwd=repo, env=env).strip()
        git("update-ref", ref, sha, cwd=repo)
        return sha


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

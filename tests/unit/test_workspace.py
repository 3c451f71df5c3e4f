"""Workspaces: real git, private copies at the base commit's tree, always cleaned up (attacks: test_git_attacks)."""

from __future__ import annotations

import os
import subprocess

import pytest

from aitlrt.common.git import git
from aitlrt.common.workspace import RefusedPatch, WorkspacePool, patch_of, reclaim_stale, workspace
from aitlrt.tasks.sources import cache_local_repo


@pytest.fixture
def repo(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git("init", "-q", cwd=src)
    git("add", "-A", cwd=src)
    git("commit", "-q", "-m", "base", cwd=src)
    base = git("rev-parse", "HEAD", cwd=src).strip()
    (src / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    git("commit", "-q", "-am", "later", cwd=src)
    return src, base


def test_copy_is_at_the_base_commit_private_and_removed(repo, tmp_path):
    src, base = repo
    root = tmp_path / "ws"
    pool = WorkspacePool(root, max_idle=0)
    with pool.workspace(src, base) as ws:
        assert (ws.repo / "calc.py").read_text().endswith("a - b\n")
        (ws.repo / "calc.py").write_text("def add(a, b):\n    return a + b  # fixed\n")
        (ws.repo / "new.txt").write_text("hello\n")
        (ws.repo / ".aider.chat.history.md").write_text("noise")
        (ws.repo / "blob.bin").write_bytes(bytes(range(256)))
        patch = patch_of(ws)
    pool.close()
    assert "+    return a + b  # fixed" in patch and "new file mode" in patch and "+hello" in patch
    assert ".aider" not in patch and "GIT binary patch" in patch
    assert list(root.iterdir()) == []
    assert git("status", "--porcelain", cwd=src) == "", "the cache was not touched"
    # A plain copy (the grader's) has the history.
    with workspace(src, base, root) as plain:
        assert git("rev-parse", "HEAD", cwd=plain.repo).strip() == base and plain.git_dir is None
    assert list(root.iterdir()) == []
    # The patch is exactly what applies to the base.
    check = tmp_path / "check"
    git("clone", "-q", src, check, cwd=tmp_path)
    git("checkout", "-q", base, cwd=check)
    subprocess.run(["git", "apply", "--check", "-"], input=patch.encode(), cwd=check, check=True)


def test_removed_on_exception(repo, tmp_path):
    src, base = repo
    root = tmp_path / "ws"
    with pytest.raises(ZeroDivisionError), workspace(src, base, root):
        1 / 0  # noqa: B018
    assert list(root.iterdir()) == []


def test_stale_copies_of_dead_owners_are_reclaimed(repo, tmp_path):
    root = tmp_path / "ws"
    dead = subprocess.Popen(["true"])
    dead.wait()
    (root / f"{dead.pid}-old" / "repo").mkdir(parents=True)
    (root / f"{os.getpid()}-mine").mkdir()
    assert reclaim_stale(root) == [root / f"{dead.pid}-old"]
    assert [p.name for p in root.iterdir()] == [f"{os.getpid()}-mine"]


def test_plain_directory_becomes_a_cached_repo(tmp_path, monkeypatch):
    monkeypatch.setenv("AITLRT_HOME", str(tmp_path / "home"))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.py").write_text("x = 1\n")
    cached = cache_local_repo(plain)
    assert cached != plain and git("ls-files", cwd=cached).split() == ["a.py"]
    assert cache_local_repo(plain) == cached


def test_pool_recycles_a_used_copy_to_a_pristine_one_at_another_commit(repo, tmp_path):
    src, base = repo
    later = git("rev-parse", "HEAD", cwd=src).strip()
    pool = WorkspacePool(tmp_path / "ws", max_idle=2)
    with pool.workspace(src, base) as ws:
        first = ws.repo
        (ws.repo / "calc.py").write_text("edited\n")
        (ws.repo / "new.py").write_text("x = 1\n")
        (ws.repo / "pkg").mkdir()
        (ws.repo / "pkg" / "deep.txt").write_text("untracked dir\n")
        (ws.repo / ".aider.tags.cache.v4").mkdir()  # ignored through .git/info/exclude
        (ws.scratch / "agent.log").write_text("old log\n")
        assert "new file mode" in patch_of(ws)  # leaves the changes staged
    with pool.workspace(src, later) as ws:
        assert ws.repo == first and pool.recycled == 1
        assert (ws.repo / "calc.py").read_text().endswith("a + b\n")
        assert sorted(p.name for p in ws.repo.iterdir()) == [".git", "calc.py"]
        assert list(ws.scratch.iterdir()) == [], "a fresh scratch directory per rollout"
        assert patch_of(ws) == ""
        (ws.repo / "calc.py").write_text("again\n")
        assert patch_of(ws).count("\n+again") == 1, "the exclude file still works"
    pool.close()
    assert list((tmp_path / "ws").iterdir()) == []


def test_pool_recycles_a_copy_whose_git_the_agent_broke_and_discards_one_whose_trusted_git_changed(repo, tmp_path):
    src, base = repo
    pool = WorkspacePool(tmp_path / "ws", max_idle=2)
    with pool.workspace(src, base) as ws:
        first = ws.repo
        git("commit", "-q", "-am", "agent commit", "--allow-empty", cwd=ws.repo)
        git("checkout", "-q", "-b", "agent-branch", cwd=ws.repo)
        (ws.repo / ".git" / "HEAD").write_text("garbage\n")  # a broken repository
    with pool.workspace(src, base) as ws:
        assert ws.repo == first and (pool.fresh, pool.recycled) == (1, 1), "the agent's .git is replaced, not trusted"
        assert git("rev-parse", "HEAD", cwd=ws.repo).strip() == ws.head
        assert ws.git_dir is not None
        (ws.git_dir / "config").write_text("[core]\n\tbare = false\n")
    with pool.workspace(src, base) as ws:
        assert ws.repo != first and not first.exists() and (pool.fresh, pool.recycled) == (2, 1)
        assert (ws.repo / "calc.py").read_text().endswith("a - b\n")
    pool.close()


def copies(root):
    return list(root.glob("*-pool-*"))


def test_pool_keeps_at_most_max_idle_copies_and_none_after_an_error(repo, tmp_path):
    src, base = repo
    root = tmp_path / "ws"
    pool = WorkspacePool(root, max_idle=1)
    with pool.workspace(src, base), pool.workspace(src, base):
        assert len(copies(root)) == 2
    assert len(copies(root)) == 1, "the least recently used copy went"
    with pytest.raises(ZeroDivisionError), pool.workspace(src, base):
        1 / 0  # noqa: B018
    assert copies(root) == [], "a copy whose rollout failed is never reused"
    fresh = WorkspacePool(root, max_idle=0)
    with fresh.workspace(src, base):
        pass
    assert copies(root) == [] and fresh.fresh == 1
    pool.close()
    fresh.close()
    assert list(root.iterdir()) == [], "and the pools' seeds are gone"


def test_our_git_calls_never_run_what_an_agent_planted_in_its_copy(repo, tmp_path):
    src, base = repo
    ran = tmp_path / "ran"
    pool = WorkspacePool(tmp_path / "ws", max_idle=1)
    with pool.workspace(src, base) as ws:
        hook = ws.repo / ".git" / "hooks" / "post-checkout"
        hook.parent.mkdir(exist_ok=True)
        hook.write_text(f"#!/bin/sh\ntouch {ran}-hook\n")
        hook.chmod(0o755)
        subprocess.run(["git", "config", "core.fsmonitor", f"touch {ran}-fsmonitor; false"], cwd=ws.repo, check=True)
        (ws.repo / "calc.py").write_text("edited\n")
        with pytest.raises(RefusedPatch, match=r"\.git/config.*\.git/hooks/post-checkout"):
            patch_of(ws)
    with pool.workspace(src, base) as ws:
        assert pool.recycled == 1 and not (ws.repo / ".git" / "hooks" / "post-checkout").exists()
        (ws.repo / "calc.py").write_text("edited\n")
        assert "+edited" in patch_of(ws)
    pool.close()
    assert not list(tmp_path.glob("ran-*")), "an agent's hook or fsmonitor command ran"


def test_concurrent_copies_of_a_new_tree_pack_its_seed_once(repo, tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from aitlrt.common import workspace as module

    src, base = repo
    builds = []
    build = module._build_seed
    monkeypatch.setattr(module, "_build_seed", lambda *a: (builds.append(a[1]), build(*a)))
    pool = WorkspacePool(tmp_path / "ws", max_idle=8)

    def rollout(i):
        with pool.workspace(src, base) as ws:
            (ws.repo / "calc.py").write_text(f"# {i}\n")
            return patch_of(ws)

    with ThreadPoolExecutor(8) as threads:
        patches = list(threads.map(rollout, range(8)))
    assert all(f"+# {i}" in p for i, p in enumerate(patches)) and len(builds) == 1
    pool.close()

"""Attacks of an agent on the git that takes its patch, and on what its repository reveals (real git repositories).

The Aider paths (CLI and warm workers, refusing ``pkg/../.git/config`` from a scripted model answer) are in
tests/integration/test_rollouts.py."""

from __future__ import annotations

import subprocess

import pytest

from aitlrt.common.git import git, trusted_git
from aitlrt.common.workspace import RefusedPatch, WorkspacePool, patch_of, workspace
from aitlrt.rollout.agents.edit_guard import refusal
from aitlrt.rollout.agents.single_call import apply_whole_files
from aitlrt.tasks.sources import with_patch

FIXED = "def add(a, b):\n    return a + b\n"
BUGGY = "def add(a, b):\n    return a - b\n"
SETUP = "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a + b\n+    return a - b\n"


@pytest.fixture
def task(tmp_path, monkeypatch):
    """A cache with history (the fixed code, a tag, a later commit on a branch) and a task commit: the setup
    patch (the bug) on the fixed base, as generated and SWE-smith tasks have it."""
    monkeypatch.setenv("AITLRT_HOME", str(tmp_path / "home"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "calc.py").write_text(FIXED)
    (src / "README").write_text("calc\n")
    git("init", "-q", cwd=src)
    git("add", "-A", cwd=src)
    git("commit", "-q", "-m", "base", cwd=src)
    base = git("rev-parse", "HEAD", cwd=src).strip()
    git("tag", "v1", cwd=src)
    git("checkout", "-q", "-b", "future", cwd=src)
    (src / "future.py").write_text("SECRET_OF_THE_FUTURE = 1\n")
    git("add", "-A", cwd=src)
    git("commit", "-q", "-m", "the future", cwd=src)
    git("checkout", "-q", "-", cwd=src)
    return src, with_patch(src, base, SETUP)


@pytest.fixture
def marker(tmp_path):
    """A file that exists only if a planted command ran; the command also prints a forged patch."""
    path = tmp_path / "pwned"
    return path, f"touch {path}; echo 'diff --git a/forged b/forged' #"


POISON = """
[diff]
\texternal = "{cmd}"
[diff "x"]
\tcommand = "{cmd}"
\ttextconv = "{cmd}"
[filter "x"]
\tclean = "{cmd}"
\tsmudge = "{cmd}"
\trequired = true
[core]
\tfsmonitor = "{cmd}"
\tattributesFile = "{attrs}"
"""


def poison(agent_git, cmd, tmp_path):
    """Every way a git directory's config and info can make git run a command."""
    attrs = tmp_path / "attributes"
    attrs.write_text("* filter=x diff=x\n")
    with open(agent_git / "config", "a") as f:
        f.write(POISON.format(cmd=cmd, attrs=attrs))
    (agent_git / "info" / "attributes").write_text("* filter=x diff=x\n")
    (agent_git / "hooks").mkdir(exist_ok=True)
    for hook in ("post-checkout", "pre-commit", "post-index-change"):
        (agent_git / "hooks" / hook).write_text(f"#!/bin/sh\n{cmd}\n")
        (agent_git / "hooks" / hook).chmod(0o755)


def plain_patch(src, commit, tmp_path, files):
    """The patch as it was always taken: ``git add -A && git diff --cached --binary`` in a clone at ``commit``."""
    with workspace(src, commit, tmp_path / "plain") as ws:
        for name, content in files.items():
            (ws.repo / name).write_text(content)
        git("add", "-A", cwd=ws.repo)
        return git("diff", "--cached", "--binary", commit, cwd=ws.repo)


def test_poisoned_git_config_filters_and_attributes_never_run_and_the_patch_is_refused(task, marker, tmp_path):
    src, commit = task
    path, cmd = marker
    pool = WorkspacePool(tmp_path / "ws", max_idle=1)
    with pool.workspace(src, commit) as ws:
        assert ws.git_dir is not None
        poison(ws.repo / ".git", cmd, tmp_path)
        (ws.repo / ".gitattributes").write_text("* filter=x diff=x\n")  # the work tree's own attributes too
        (ws.repo / "calc.py").write_text(FIXED)
        with pytest.raises(RefusedPatch, match=r"\.git/config") as refused:
            patch_of(ws)
        assert ".git/info/attributes" in str(refused.value) and ".git/hooks" in str(refused.value)
        # Were it taken anyway, the trusted git reads none of it: nothing runs, the patch is the plain one.
        trusted_git("add", "-A", git_dir=ws.git_dir, work_tree=ws.repo)
        patch = trusted_git("diff", "--cached", "--binary", ws.head, git_dir=ws.git_dir, work_tree=ws.repo)
    assert not path.exists(), "a planted command ran"
    assert "forged" not in patch
    assert patch == plain_patch(src, commit, tmp_path, {"calc.py": FIXED, ".gitattributes": "* filter=x diff=x\n"})
    pool.close()


def test_the_trusted_git_ignores_the_environment_and_the_users_config(task, marker, tmp_path, monkeypatch):
    src, commit = task
    path, cmd = marker
    expected = plain_patch(src, commit, tmp_path, {"calc.py": FIXED})
    home = tmp_path / "userhome"
    (home / ".config" / "git").mkdir(parents=True)
    (home / ".gitconfig").write_text(POISON.format(cmd=cmd, attrs=home / ".config" / "git" / "attributes"))
    (home / ".config" / "git" / "attributes").write_text("* filter=x diff=x\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("GIT_EXTERNAL_DIFF", cmd)
    pool = WorkspacePool(tmp_path / "ws", max_idle=0)
    with pool.workspace(src, commit) as ws:
        (ws.repo / "calc.py").write_text(FIXED)
        patch = patch_of(ws)
    pool.close()
    assert not path.exists() and patch == expected


def test_a_change_to_the_trusted_git_directory_refuses_the_patch(task, marker, tmp_path):
    """What an edit that got past the agents' path checks (``../git-*/config``) would meet."""
    src, commit = task
    path, cmd = marker
    pool = WorkspacePool(tmp_path / "ws", max_idle=1)
    with pool.workspace(src, commit) as ws:
        assert ws.git_dir is not None and not ws.git_dir.is_relative_to(ws.repo)
        with open(ws.git_dir / "config", "a") as f:
            f.write(POISON.format(cmd=cmd, attrs="/dev/null"))
        (ws.repo / "calc.py").write_text(FIXED)
        with pytest.raises(RefusedPatch, match="trusted git directory"):
            patch_of(ws)
    with pool.workspace(src, commit):
        assert (pool.fresh, pool.recycled) == (2, 0), "such a copy is never recycled"
    pool.close()
    assert not path.exists()


def git_files(agent_git):
    """Every file of a git directory and its content but the index (whose stat data may differ)."""
    return {p.relative_to(agent_git): p.read_bytes() for p in agent_git.rglob("*") if p.is_file() and p.name != "index"}


def test_a_recycled_copy_has_a_fresh_git_directory(task, marker, tmp_path):
    src, commit = task
    path, cmd = marker
    pool = WorkspacePool(tmp_path / "ws", max_idle=1)
    with pool.workspace(src, commit) as ws:
        agent_git = ws.repo / ".git"
        fresh = git_files(agent_git)
        poison(agent_git, cmd, tmp_path)
        blob = git("rev-parse", "HEAD:calc.py", cwd=ws.repo).strip()
        other = git("hash-object", "-w", "--stdin", cwd=ws.repo, input=FIXED).strip()
        git("replace", blob, other, cwd=ws.repo)  # refs/replace: calc.py would read as the fix
        git("tag", "planted", cwd=ws.repo)
        git("update-ref", "refs/heads/main", "HEAD", cwd=ws.repo)
        (agent_git / "info" / "exclude").write_text("*.py\n")  # would hide the agent's edits from the patch
        (agent_git / "objects" / "info" / "alternates").write_text(f"{src}/.git/objects\n")
        (agent_git / "packed-refs").write_text(f"{blob} refs/tags/old\n")
    with pool.workspace(src, commit) as ws:
        assert pool.recycled == 1
        agent_git = ws.repo / ".git"
        assert git_files(agent_git) == fresh, "config, info, hooks, refs, replace refs, alternates: all as new"
        assert git("diff-index", "--cached", "HEAD", cwd=ws.repo) == "", "its index is the commit's"
        assert git("for-each-ref", cwd=ws.repo) == "" and git("show", "HEAD:calc.py", cwd=ws.repo) == BUGGY
        (ws.repo / "calc.py").write_text(FIXED)
        assert "+    return a + b" in patch_of(ws)
    pool.close()
    assert not path.exists(), "a planted command ran"


def test_a_recycled_copy_whose_git_the_agent_left_alone_is_as_fresh(task, tmp_path):
    """Only its index and loose objects changed (Aider's ``git add``): made fresh in place, for the same tree or
    another one."""
    src, commit = task
    other = with_patch(src, commit, "--- /dev/null\n+++ b/other.py\n@@ -0,0 +1 @@\n+other = 1\n")
    fresh = {}
    for at in (commit, other):
        pool = WorkspacePool(tmp_path / "fresh", max_idle=0)
        with pool.workspace(src, at) as ws:
            fresh[at] = git_files(ws.repo / ".git")
        pool.close()
    pool = WorkspacePool(tmp_path / "ws", max_idle=1)
    for at in (commit, commit, other, commit):
        with pool.workspace(src, at) as ws:
            assert git_files(ws.repo / ".git") == fresh[at]
            assert git("status", "--porcelain", cwd=ws.repo) == ""
            (ws.repo / "new.py").write_text(f"x = {at!r}\n")
            git("add", "new.py", cwd=ws.repo)  # a loose object and a new index, as Aider leaves them
            assert f"+x = {at!r}" in patch_of(ws)
    assert (pool.fresh, pool.recycled) == (1, 3)
    pool.close()


def test_an_agents_gitattributes_does_not_shape_the_next_checkout(task, tmp_path):
    src, commit = task
    other = with_patch(src, commit, "--- /dev/null\n+++ b/other.py\n@@ -0,0 +1 @@\n+other = 1\n")
    pool = WorkspacePool(tmp_path / "ws", max_idle=1)
    for staged in (False, True):
        with pool.workspace(src, commit) as ws:
            (ws.repo / ".gitattributes").write_text("* text eol=crlf ident\n")
            (ws.repo / "calc.py").write_text("# $Id$\n" + FIXED)
            if staged:
                patch_of(ws)
        with pool.workspace(src, other) as ws:
            assert not (ws.repo / ".gitattributes").exists()
            for name in ("calc.py", "other.py", "README"):
                assert b"\r" not in (ws.repo / name).read_bytes(), name
            assert (ws.repo / "calc.py").read_text() == BUGGY
    assert pool.recycled == 3
    pool.close()


def agent_view(repo):
    """What a shell agent can learn from its repository's git."""
    run = lambda *args: subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)  # noqa: E731
    return {
        "log": run("log", "--all", "--format=%H %P|%an <%ae> %ad|%s", "--date=iso").stdout.splitlines(),
        "objects": set(run("cat-file", "--batch-all-objects", "--batch-check=%(objectname)").stdout.split()),
        "diff_parent": run("diff", "HEAD~1"),
        "refs": run("for-each-ref").stdout + run("tag").stdout + run("stash", "list").stdout,
        "reflog": run("reflog", "--all").stdout,
    }


def test_the_agents_repository_holds_the_task_tree_and_nothing_else(task, tmp_path):
    src, commit = task
    tree = git("rev-parse", f"{commit}^{{tree}}", cwd=src).strip()
    task_objects = {tree, *git("ls-tree", "-r", "-t", "--format=%(objectname)", tree, cwd=src).split()}
    fix_blob = git("rev-parse", f"{commit}~1:calc.py", cwd=src).strip()
    pool = WorkspacePool(tmp_path / "ws", max_idle=1)
    other = with_patch(src, commit, "--- /dev/null\n+++ b/other.py\n@@ -0,0 +1 @@\n+other = 1\n")
    for step, at in enumerate((commit, other, commit)):  # fresh, then recycled to another tree, and back
        with pool.workspace(src, at) as ws:
            view = agent_view(ws.repo)
            (head,) = view["log"]
            assert head == f"{ws.head} |aitlrt <aitlrt@localhost> 2000-01-01 00:00:00 +0000|task", "no parent"
            at_tree = git("rev-parse", f"{at}^{{tree}}", cwd=src).strip()
            at_objects = {at_tree, *git("ls-tree", "-r", "-t", "--format=%(objectname)", at_tree, cwd=src).split()}
            assert view["objects"] == at_objects | {ws.head}, "exactly the tree's objects and the one commit"
            assert fix_blob not in view["objects"] and view["diff_parent"].returncode != 0
            assert view["refs"] == "" and view["reflog"] == ""
            assert not (ws.repo / ".git" / "objects" / "info" / "alternates").exists()
            assert (ws.repo / "calc.py").read_text() == BUGGY and not (ws.repo / "future.py").exists()
            if at == commit:
                assert view["objects"] == task_objects | {ws.head}
            (ws.repo / "calc.py").write_text(FIXED)
            # The patch against the neutral commit is the one taken against the task's real commit.
            assert patch_of(ws) == plain_patch(src, at, tmp_path / str(step), {"calc.py": FIXED})
    pool.close()


def test_the_same_tree_gives_the_same_commit_in_every_copy(task, tmp_path):
    src, commit = task
    heads = set()
    for i in range(2):
        pool = WorkspacePool(tmp_path / f"ws{i}", max_idle=0)
        with pool.workspace(src, commit) as ws:
            heads.add(git("rev-parse", "HEAD", cwd=ws.repo).strip())
        pool.close()
    assert len(heads) == 1


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("pkg/../.git/config", "under .git"),
        (".git/hooks/post-checkout", "under .git"),
        ("sub/.GIT/config", "under .git"),
        ("../outside.txt", "outside"),
        ("/etc/passwd", "outside"),
        ("link/escaped.txt", "outside"),
        ("gitlink/config", "under .git"),
        (".", "outside"),
        ("calc.py", None),
        ("pkg/new.py", None),
        (".gitattributes", None),
    ],
)
def test_edit_paths_outside_the_repository_or_under_git_are_refused(path, why, tmp_path):
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    (root / "link").symlink_to(tmp_path)
    (root / "gitlink").symlink_to(root / ".git")
    got = refusal(root, path)
    assert (got is None) if why is None else (why in got)


def test_the_single_call_agent_writes_only_inside_its_repository(task, tmp_path):
    src, commit = task
    outside = tmp_path / "outside.txt"
    reply = "".join(
        f"{name}\n```\n{body}```\n\n"
        for name, body in [
            ("pkg/../.git/config", "[diff]\n\texternal = touch pwned\n"),
            (".git/info/attributes", "* filter=x\n"),
            (str(outside), "escaped\n"),
            ("../outside.txt", "escaped\n"),
            ("calc.py", FIXED),
        ]
    )
    pool = WorkspacePool(tmp_path / "ws", max_idle=0)
    with pool.workspace(src, commit) as ws:
        config = (ws.repo / ".git" / "config").read_text()
        assert apply_whole_files(reply, ws.repo) == ["calc.py"]
        assert (ws.repo / ".git" / "config").read_text() == config
        assert not (ws.repo / ".git" / "info" / "attributes").exists()
        assert "+    return a + b" in patch_of(ws)
    pool.close()
    assert not outside.exists()

"""What sandboxed code (the policy's patch under test) can read: nothing of the caches, the run or the task files
(``aitlrt.tasks.sandbox.hidden_folders``), only what it is given back."""

import pytest

from aitlrt.tasks.sandbox import HIDE_ENV, isolation, run_sandboxed

pytestmark = pytest.mark.skipif(not isolation().startswith("bwrap"), reason="needs bubblewrap")


def test_sandboxed_code_cannot_read_the_caches_the_run_or_the_task_files(tmp_path, monkeypatch):
    home, run, tasks = tmp_path / "home", tmp_path / "run", tmp_path / "data"
    for folder, secret in ((home / "repos" / "x", "fix commit"), (run, "oracle_patch"), (tasks, "tasks.jsonl")):
        folder.mkdir(parents=True)
        (folder / "secret").write_text(secret)
    env = home / "envs" / "e"
    env.mkdir(parents=True)
    (env / "tool").write_text("the test environment")
    monkeypatch.setenv("AITLRT_HOME", str(home))
    monkeypatch.setenv(HIDE_ENV, str(tasks))
    monkeypatch.chdir(run)  # the grading process's working directory: a run's output
    work = tmp_path / "copy"
    work.mkdir()
    read = f"cat {home}/repos/x/secret {run}/secret {tasks}/secret; cat {env}/tool"
    result = run_sandboxed(["bash", "-c", read], work, {"PATH": "/usr/bin:/bin"}, 30, binds=[env])
    assert "fix commit" not in result.output and "oracle_patch" not in result.output
    assert "tasks.jsonl" not in result.output
    assert "the test environment" in result.output, "what the command is given stays readable"
    listing = run_sandboxed(["bash", "-c", f"ls {home}"], work, {"PATH": "/usr/bin:/bin"}, 30, writable=False)
    assert listing.returncode == 0 and listing.output.split() == [], "the cache is an empty folder"

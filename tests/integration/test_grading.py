"""Grading and rewards on real tasks: real sdists, real test environments, real pytest in the sandbox.

The first run builds two test environments (webargs 8.6.0 on Python 3.11, marshmallow 2.20.0 on Python 3.9 with
SWE-bench's install spec); later runs reuse them from ``$AITLRT_HOME/envs``.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

import pytest

from aitlrt.rewards import runtime
from aitlrt.rewards.builtin import REWARDS
from aitlrt.rewards.inputs import rows_of
from aitlrt.rewards.runtime import grade_rollouts
from aitlrt.tasks.grading import grade
from aitlrt.tasks.loader import load_tasks
from aitlrt.tasks.sandbox import OUTPUT_TAIL, local_isolation, run_sandboxed

WEBARGS = [
    "marshmallow-code__webargs.dbde72fe.pr_974",
    "marshmallow-code__webargs.dbde72fe.func_pm_remove_cond__vz9appx6",
    "marshmallow-code__webargs.dbde72fe.func_pm_ctrl_shuffle__g0amkrmy",
    "marshmallow-code__webargs.dbde72fe.func_pm_class_rm_funcs__kw4zto9r",
]
# A bug in another file (pyramidparser.py) that breaks a test none of the four tasks fixes.
BREAKER = "marshmallow-code__webargs.dbde72fe.func_basic__tv3r8t5p"
# Makes marshmallow's `missing` truthy: breaks PASS_TO_PASS tests of marshmallow-1343, not its fix.
MISSING_TRUTHY = """diff --git a/src/marshmallow/utils.py b/src/marshmallow/utils.py
--- a/src/marshmallow/utils.py
+++ b/src/marshmallow/utils.py
@@ -31,3 +31,3 @@ class _Missing(object):
     def __bool__(self):
-        return False
+        return True
\x20
"""


def _columns(tasks, agent_patches, statuses=None):
    rows = [t.as_row() for t in tasks]
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    cols["agent_patch"] = list(agent_patches)
    cols["rollout_status"] = list(statuses or ["ok"] * len(rows))
    return cols


def _rewards(cols):
    n = len(cols["agent_patch"])
    return {
        name: fn(prompts=[None] * n, completions=[None] * n, completion_ids=[[]] * n, **cols)
        for name, fn in REWARDS.items()
    }


@pytest.fixture(scope="module")
def webargs(data_dir: Path):
    fast = set((data_dir / "swesmith_webargs" / "fast_subset.txt").read_text().split())
    assert set(WEBARGS) <= fast
    loaded = load_tasks(data_dir / "swesmith_webargs" / "tasks.jsonl", ids={*WEBARGS, BREAKER})
    by_id = {t.instance_id: t for t in loaded.tasks}
    return [by_id[i] for i in WEBARGS], by_id[BREAKER]


def test_webargs_tasks_gold_empty_and_breaking_patches(webargs):
    tasks, breaker = webargs
    gold = [t.patch for t in tasks]
    breaking = [t.patch + breaker.setup_patch for t in tasks]
    cols = _columns(tasks * 3, gold + [""] * 4 + breaking)
    started = time.monotonic()
    scores = _rewards(cols)
    elapsed = time.monotonic() - started
    assert scores["tests_pass"] == [1.0] * 4 + [0.0] * 4 + [0.0] * 4, elapsed
    assert scores["tests_pass_fraction"][:4] == [1.0] * 4
    assert all(0.0 < f < 1.0 for f in scores["tests_pass_fraction"][4:])
    assert scores["patch_similarity"][:4] == [1.0] * 4 and scores["patch_similarity"][4:8] == [0.0] * 4
    assert all(0.0 < s < 1.0 for s in scores["patch_similarity"][8:])  # right file, plus an extra wrong one
    assert scores["non_empty_patch"] == [1.0] * 4 + [0.0] * 4 + [1.0] * 4
    # similarity is paid where no PASS_TO_PASS test broke: the fixes keep theirs, the breaking edits lose it
    assert scores["unbroken_patch_similarity"] == scores["patch_similarity"][:8] + [0.0] * 4
    # keeping tests green pays only an edit: the no-ops score 0, below the breaking edits, below the fixes
    assert scores["edit_tests_pass_fraction"] == [1.0] * 4 + [0.0] * 4 + scores["tests_pass_fraction"][8:]
    assert all(0.0 < f < 1.0 for f in scores["edit_tests_pass_fraction"][8:])
    # each patch here changes a module's code: the code-edit terms pay as the edit terms do
    assert scores["code_edit"] == scores["non_empty_patch"]
    assert scores["code_edit_tests_pass_fraction"] == scores["edit_tests_pass_fraction"]
    grades = grade_rollouts(rows_of(cols))
    for g, task in zip(grades[8:], tasks, strict=True):  # the fix works, but another test breaks
        assert g.status == "unresolved" and g.f2p_passed == g.f2p_total == len(task.fail_to_pass)
        assert g.p2p_passed < g.p2p_total
    assert grades[0].isolation == local_isolation(Path("/"), writable=False)[1]


def test_failed_rollouts_and_bad_patches_score_zero_with_a_reason(webargs):
    tasks, _ = webargs
    task = tasks[0]
    garbage = "diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n"
    cols = _columns([task] * 3, [task.patch, garbage, task.patch], ["timeout", "ok", "crashed"])
    scores = _rewards(cols)
    assert all(v == [0.0, 0.0, 0.0] for v in scores.values()), scores
    grades = grade_rollouts(rows_of(cols))
    assert grades[0].status == "agent_failed" and "timeout" in grades[0].reason
    assert grades[1].status == "patch_failed" and "does not apply" in grades[1].reason


def test_a_hung_apply_check_counts_as_not_applying(webargs, monkeypatch, caplog):
    task = webargs[0][0]
    assert runtime.applies(task, task.patch)
    monkeypatch.setattr(runtime, "APPLY_TIMEOUT_S", 1e-6)  # git is killed before it can answer
    monkeypatch.setattr(logging.getLogger("aitlrt"), "propagate", True)  # setup_logging() may have turned it off
    with caplog.at_level("WARNING", logger=runtime.__name__):
        assert not runtime.applies(task, task.patch)
    assert "counts as not applying" in caplog.text and task.instance_id in caplog.text


def test_swebench_task_from_an_sdist_marshmallow_1343(data_dir):
    (task,) = load_tasks(
        data_dir / "swebench_lite" / "dev.jsonl",
        ids={"marshmallow-code__marshmallow-1343"},
        overrides={"marshmallow-code__marshmallow-1343": "pypi:marshmallow==2.20.0"},
    ).tasks
    assert task.test_patch  # SWE-bench form: the tests arrive with the test patch
    cols = _columns([task] * 3, [task.patch, "", task.patch + MISSING_TRUTHY])
    scores = _rewards(cols)
    assert scores["tests_pass"] == [1.0, 0.0, 0.0]
    assert scores["non_empty_patch"] == [1.0, 0.0, 1.0]
    gold, empty, broken = grade_rollouts(rows_of(cols))
    assert (gold.f2p_passed, gold.p2p_passed) == (1, 24) == (gold.f2p_total, gold.p2p_total)
    assert empty.f2p_passed == 0 and empty.p2p_passed == 24
    assert broken.f2p_passed == 1 and broken.p2p_passed < 24


def test_an_agent_cannot_pass_by_editing_the_tests(webargs):
    tasks, _ = webargs
    task = tasks[0]
    test_file = task.fail_to_pass[0].split("::")[0]
    cheat = (
        f"diff --git a/{test_file} b/{test_file}\n--- a/{test_file}\n+++ b/{test_file}\n"
        "@@ -1,0 +1,1 @@\n+collect_ignore = ['everything']\n"
    )
    assert grade(task, cheat).status != "resolved"


def test_sandbox_isolates_and_always_comes_back(tmp_path):
    """bubblewrap: no network but loopback, the host read-only, the working directory and a private /tmp
    writable, its own pids (nothing outlives it), a bounded output tail, and a timeout that returns even when a
    stray child holds the output pipe."""
    isolation = local_isolation(tmp_path)[1]
    if isolation != "bwrap":
        pytest.skip(f"no bubblewrap on this machine: {isolation}")
    outside = Path.home() / f".aitlrt-sandbox-probe-{tmp_path.name}"  # not under /tmp, which is private there
    probe = f"""
python3 -c "import socket; s=socket.socket(); s.settimeout(3); s.connect(('1.1.1.1', 53))" \
  && echo REACHED || echo UNREACHABLE
python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print('LOOPBACK', s.listen())"
echo x > {outside} 2>/dev/null && echo WROTE-HOST || echo HOST-READ-ONLY
echo x > here.txt && echo x > /tmp/private.txt && echo WROTE-OWN
echo PIDS $(ls /proc | grep -c '^[0-9]')
"""
    result = run_sandboxed(["bash", "-c", probe], tmp_path, {"PATH": "/usr/bin:/bin"}, timeout=30)
    out = result.output
    assert "UNREACHABLE" in out and "LOOPBACK" in out and "HOST-READ-ONLY" in out and "WROTE-OWN" in out, out
    assert not outside.exists() and (tmp_path / "here.txt").exists() and not Path("/tmp/private.txt").exists()
    assert int(out.split("PIDS ")[1].split()[0]) < 10, out  # its own pid namespace
    started = time.monotonic()
    stray = "setsid sleep 987656 & yes | head -c 50000000; sleep 300"
    hung = run_sandboxed(["bash", "-c", stray], tmp_path, {"PATH": "/usr/bin:/bin"}, timeout=3)
    assert hung.timed_out and hung.returncode is None and time.monotonic() - started < 20
    assert len(hung.output.encode()) <= OUTPUT_TAIL
    left = subprocess.run(["pgrep", "-f", "sleep 987656"], capture_output=True, text=True)
    assert left.stdout == "", "a process of the sandbox outlived it"


def test_apptainer_runner_when_present(tmp_path, monkeypatch):
    """On clusters: ``AITLRT_TEST_RUNNER=apptainer:IMAGE``. Runs where apptainer and an image are present."""
    import os
    import shutil

    image = os.environ.get("AITLRT_APPTAINER_IMAGE")
    if shutil.which("apptainer") is None or not image:
        pytest.skip("needs apptainer and AITLRT_APPTAINER_IMAGE (an image with python3)")
    monkeypatch.setenv("AITLRT_TEST_RUNNER", f"apptainer:{image}")
    (tmp_path / "probe.txt").write_text("inside\n")
    command = ["bash", "-c", "cat probe.txt && python3 -c 'print(6*7)'"]
    result = run_sandboxed(command, tmp_path, dict(os.environ), timeout=120)
    assert result.returncode == 0 and "inside" in result.output and "42" in result.output
    assert result.isolation.startswith("apptainer")


def test_grading_leaves_no_workspace_behind(webargs):
    tasks, _ = webargs
    from aitlrt.common.workspace import workspaces_root

    before = set(workspaces_root().glob("*grade-*"))
    assert grade(tasks[1], tasks[1].patch).resolved
    assert set(workspaces_root().glob("*grade-*")) == before


def test_early_grading_grades_each_rollout_once_and_the_rewards_reuse_it(webargs, monkeypatch):
    """``EarlyGrader`` (the trainer's grading as each rollout ends): the reward call that follows, made while the
    early grades still run, waits for them; tests_pass and tests_pass_fraction run no test again."""
    tasks, _ = webargs
    monkeypatch.setattr(runtime, "_grades", {})
    runs: list[str] = []
    real = runtime.grade

    def counted(task, patch, timeout):
        runs.append(task.instance_id)
        return real(task, patch, timeout)

    monkeypatch.setattr(runtime, "grade", counted)
    cols = _columns(tasks[:2], [t.patch for t in tasks[:2]])
    grader = runtime.EarlyGrader()
    try:
        for row in rows_of(cols):
            grader.submit(row)
        scores = _rewards(cols)
    finally:
        grader.close()
    assert scores["tests_pass"] == [1.0, 1.0] and scores["tests_pass_fraction"] == [1.0, 1.0]
    assert sorted(runs) == sorted(t.instance_id for t in tasks[:2])

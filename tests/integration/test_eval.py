"""``aitlrt eval`` compares two checkpoints on the same tasks through a real aitlrt-serve + vLLM CPU server, and
``aitlrt report`` turns saved rollouts into a static HTML page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import keyed_env


def test_eval_compares_two_checkpoints_and_writes_a_report(served, make_repo, tmp_path):
    repo = make_repo({"calc.py": "def add(a, b):\n    return a - b\n"})
    tasks = tmp_path / "tasks.jsonl"
    row = {
        "instance_id": "calc-1",
        "problem_statement": "add() subtracts; make it add.",
        "repo_path": str(repo),
        "files": ["calc.py"],
        "patch": "--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n"
        "-    return a - b\n+    return a + b\n",
    }
    tasks.write_text(json.dumps(row) + "\n")
    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        "-m",
        "aitlrt.cli",
        "eval",
        "--tasks",
        str(tasks),
        "--proxy",
        served.url,
        "--checkpoint",
        "served",
        "--compare",
        str(served.model_dir),
        "--agent",
        "single-call",
        "--n",
        "2",
        "--concurrency",
        "1",  # vLLM batches alike: on CPU a batch of other requests can change a near-tie's sample
        "--rewards",
        "non_empty_patch=0.1,patch_similarity",  # a weight given: the weighted reward (similarity counts 1) too
        "--out-dir",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=keyed_env(served.url))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout[done.stdout.index("metric") :]
    assert "served" in table and Path(served.model_dir).name[:24] in table
    for metric in ("non_empty_patch", "patch_similarity", "reward", "reward_se", "calls", "completion_tokens"):
        assert metric in table
    records = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [r["checkpoint"] for r in records] == ["served"] * 2 + [str(served.model_dir)] * 2
    assert all(r["calls"] == 1 and r["conversation"][-1]["role"] == "assistant" for r in records)
    # Seeded by default (--seed 0): the same weights sample the same answers again, rollout by rollout.
    answers = [r["conversation"][-1]["content"] for r in records]
    assert answers[:2] == answers[2:] and answers[0] != answers[1], answers
    paired = done.stdout[done.stdout.index("paired by seed (2 rollouts)") :].splitlines()
    assert paired[1].split() == ["non_empty_patch", "+0.000", "(std", "error", "0.000)"], paired
    assert paired[3].split() == ["reward", "(weighted)", "+0.000", "(std", "error", "0.000)"], paired
    assert paired[4].split() == ["same", "patch", "1.000"], paired
    weighted = [0.1 * r["rewards"]["non_empty_patch"] + r["rewards"]["patch_similarity"] for r in records]
    assert [r["reward"] for r in records] == pytest.approx(weighted)
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and html.count("<details>") == 4 and "calc-1" in html

    # The same report from a training run's saved rollouts.
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    for step in (0, 1):
        saved = [{**r, "step": step, "advantage": 0.5} for r in records[:2]]
        (run / "rollouts" / f"step_{step:04d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in saved))
    made = subprocess.run([sys.executable, "-m", "aitlrt.cli", "report", str(run)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    page = (run / "report.html").read_text()
    assert "<svg" in page and page.count("<details>") == 4 and "advantage 0.500" in page

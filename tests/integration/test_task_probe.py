"""``aitlrt tasks probe``: real Aider agents through the session's aitlrt-serve + vLLM CPU server on two generated
cachetools tasks, graded in the sandbox; the sidecar it writes is merged, reloaded and drawn from by the curriculum."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from aitlrt.rollout.batch import served_model
from aitlrt.tasks.difficulty import TaskDifficulty, read_difficulty, write_difficulty
from aitlrt.training.curriculum import CurriculumSampler
from tests.conftest import cachetools_tasks, keyed_env


def test_probe_writes_the_sidecar_the_curriculum_draws_from(served, tmp_path):
    lines = cachetools_tasks(2).read_text().splitlines(keepends=True)[:2]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(lines))
    ids = [json.loads(line)["instance_id"] for line in lines]
    sidecar = tmp_path / "tasks.jsonl.difficulty.jsonl"
    before = TaskDifficulty("probed-before", 40, 1.0, 1.0, 1.0, "another model", "2026-11-24T00:00:00Z")
    write_difficulty(sidecar, [before])  # kept by --merge
    cmd = [
        sys.executable,
        "-m",
        "aitlrt.cli",
        "tasks",
        "probe",
        "--tasks",
        str(tasks),
        "--serve",
        served.url,
        "--k",
        "2",
        "--rewards",
        "tests_pass,non_empty_patch=0.5",
        "--timeout",
        "300",
        "--merge",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=keyed_env(served.url))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    records = read_difficulty(sidecar)
    assert list(records) == ["probed-before", *ids]
    model = served_model(served.url)
    for task_id in ids:
        r = records[task_id]
        assert (r.k, r.model, r.reward_weights) == (2, model, {"tests_pass": 1.0, "non_empty_patch": 0.5})
        assert r.solved_rate in (0.0, 0.5, 1.0) and r.edit_rate in (0.0, 0.5, 1.0)
        assert r.rewards["tests_pass"] == r.solved_rate
        assert math.isclose(r.reward_mean, r.rewards["tests_pass"] + 0.5 * r.rewards["non_empty_patch"])
        assert f"{task_id} " in done.stdout
    levels = [records[i].level for i in ids]
    counts = f"always solved: {levels.count('solved')}, mixed: {levels.count('mixed')}, "
    assert counts + f"never solved: {levels.count('failed')} (of 2)" in done.stdout

    assert records["probed-before"] == before
    # 48 tokens per call (the fixture's cap) cannot rewrite a module of thousands of characters: nothing is solved
    assert "solved" not in levels
    everything = [*ids, "probed-before"]
    sampler = CurriculumSampler(everything, mini_repeat_count=2, batch_size=2, seed=0, records=records)
    drawn = {everything[i] for _ in range(50) for i in sampler}
    assert drawn == set(ids)  # the always-solved task is never drawn

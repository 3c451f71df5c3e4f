"""Damaged or wrong files a run reads back are reported or rebuilt, not fatal: task rows with wrong types (and
duplicate ids, refused), the proxy's journal with a torn last line, a checkpoint whose trainer state does not parse,
a half-made PyPI source cache. On real files."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest

from aitlrt.tasks.loader import TaskLoadError, load_tasks
from aitlrt.tasks.sources import Source, materialise
from aitlrt.train import resume_checkpoint
from aitlrt_server.store import JOURNAL_NAME, TraceStore


def row(instance_id, **fields):
    return {"instance_id": instance_id, "problem_statement": "fix it", "source": "local:/nowhere", **fields}


def test_wrong_typed_task_fields_are_row_problems_with_the_id(tmp_path):
    rows = [
        row("ok-1"),
        row("statement", problem_statement=5),
        row("f2p", FAIL_TO_PASS=["tests/test_a.py::test_a", 3]),
        row("p2p", PASS_TO_PASS={"tests/test_a.py::test_a": 1}),
        row("patch", patch=["diff"]),
        row("env", env=[1, 2]),
        row("files", files=[1]),
        row("source", source=7),
        {"instance_id": ["not", "an", "id"], "problem_statement": "x"},
        row("ok-2", version=3.0, env={"python": "3.11"}, files='["a.py"]'),
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_tasks(path)
    assert [t.instance_id for t in loaded.tasks] == ["ok-1", "ok-2"]
    problems = {p.instance_id: (p.where, p.reason) for p in loaded.problems}
    assert problems["statement"] == (f"{path}:2", "problem_statement must be a string, got int")
    assert "FAIL_TO_PASS must be a list of test ids (strings)" in problems["f2p"][1]
    assert "PASS_TO_PASS must be a list of test ids (strings), got dict" in problems["p2p"][1]
    assert problems["patch"][1] == "patch must be a string, got list"
    assert problems["env"][1] == "env must be an object (or JSON text of one), got list"
    assert problems["files"][1] == "files must be a list of paths (strings)"
    assert problems["source"][1] == "source must be a string, got int"
    assert problems["['not', 'an', 'id']"][1] == "instance_id must be a string, got list"


def test_duplicate_instance_ids_are_refused_naming_them(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(row(i)) + "\n" for i in ("a", "b", "a", "c", "b", "a")))
    with pytest.raises(TaskLoadError) as err:
        load_tasks(path)
    text = str(err.value)
    assert "2 duplicate instance_id(s)" in text
    assert f"a ({path}:1, {path}:3, {path}:6)" in text and f"b ({path}:2, {path}:5)" in text


def record(rollout_id, index):
    return {"rollout_id": rollout_id, "call_index": index, "status": 200, "prompt_token_ids": [1]}


def test_the_journal_keeps_the_record_after_a_torn_line_and_skips_non_records(tmp_path, caplog):
    journal = tmp_path / JOURNAL_NAME
    lines = [json.dumps(record("r1", 0)), "[1, 2]", '{"no": "rollout"}', json.dumps({"deleted": "gone"})]
    torn = json.dumps(record("r1", 1))[:25]  # the proxy died in the middle of this write
    journal.write_text("\n".join(lines) + "\n" + torn)
    with caplog.at_level(logging.WARNING, logger="aitlrt_server.store"):
        store = TraceStore(tmp_path)
    assert "skipped 3 line(s) that are not records" in caplog.text and "line 2, 3, 5" in caplog.text
    assert [c["call_index"] for c in store.get("r1") or []] == [0]
    store.add(record("r2", 0))  # the first record after the restart
    store.close()
    again = TraceStore(tmp_path)  # a second restart: the record appended after the torn line is still there
    assert [c["call_index"] for c in again.get("r2") or []] == [0]
    assert [c["call_index"] for c in again.get("r1") or []] == [0]
    again.close()


def test_resume_skips_a_checkpoint_whose_trainer_state_does_not_parse(tmp_path, caplog):
    out = tmp_path / "run"
    for step, state in ((5, "{}"), (10, '{"global_step": 10}'), (20, ""), (30, '{"global_st'), (40, None)):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        if state is not None:
            (out / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    with caplog.at_level(logging.WARNING, logger="aitlrt.train"):
        assert resume_checkpoint("true", out) == str(out / "checkpoint-10")
    assert f"{out}/checkpoint-30: its trainer_state.json is not a JSON object" in caplog.text
    assert f"{out}/checkpoint-20: its trainer_state.json is not a JSON object" in caplog.text


def test_a_half_made_pypi_cache_is_rebuilt(tmp_path, monkeypatch):
    """A build cut off after ``git init`` (a repository without a commit), as older versions left it when killed:
    every later materialise failed on ``git rev-parse HEAD``. (A folder without a repository was rebuilt already.)"""
    monkeypatch.setenv("AITLRT_HOME", str(tmp_path))
    half = tmp_path / "repos" / "pypi-sniffio-1.3.1"
    half.mkdir(parents=True)
    (half / "setup.py").write_text("# half of it\n")
    subprocess.run(["git", "init", "-q"], cwd=half, check=True)
    repo, base = materialise(Source("pypi", "sniffio==1.3.1"))
    assert repo == half and len(base) == 40
    listed = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout
    assert "sniffio/__init__.py" in listed
    assert materialise(Source("pypi", "sniffio==1.3.1")) == (repo, base)  # whole now: reused as it is

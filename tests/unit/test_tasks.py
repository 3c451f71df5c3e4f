"""Task loading in every file form, bad-row reports, and the repository sources (git, local, PyPI sdist)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aitlrt.common.git import git
from aitlrt.tasks.loader import TaskLoadError, load_tasks
from aitlrt.tasks.patches import normalised_files, reverse
from aitlrt.tasks.sources import Source, materialise, parse_source, with_patch
from aitlrt.tasks.task import task_from_row

IDS = ["marshmallow-code__marshmallow-1343", "marshmallow-code__marshmallow-1359", "pvlib__pvlib-python-1072"]


@pytest.fixture(scope="module")
def lite_rows(data_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (data_dir / "swebench_lite" / "dev.jsonl").open()]
    return [r for r in rows if r["instance_id"] in IDS]


def _write_all_forms(rows: list[dict], tmp_path: Path) -> list[Path]:
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    as_json = tmp_path / "t.json"
    as_json.write_text(json.dumps(rows))
    as_csv = tmp_path / "t.csv"
    with open(as_csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    as_parquet = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist(rows), as_parquet)
    return [jsonl, as_json, as_csv, as_parquet]


def test_every_file_form_loads_the_same_swebench_tasks(lite_rows, tmp_path):
    loaded = [load_tasks(path) for path in _write_all_forms(lite_rows, tmp_path)]
    assert all(not ts.problems for ts in loaded)
    first = loaded[0].tasks
    assert [t.instance_id for t in first] == [r["instance_id"] for r in lite_rows]
    for ts in loaded[1:]:
        assert ts.tasks == first  # Task equality ignores the raw row
    task = first[0]
    assert task.source == Source("git", f"https://github.com/{task.repo}.git", lite_rows[0]["base_commit"])
    assert task.fail_to_pass == tuple(json.loads(lite_rows[0]["FAIL_TO_PASS"])) and task.pass_to_pass
    # Lists instead of JSON strings: the same task.
    as_lists = {**lite_rows[0], "FAIL_TO_PASS": list(task.fail_to_pass), "PASS_TO_PASS": list(task.pass_to_pass)}
    assert task_from_row(as_lists) == task
    # Overrides by instance id or by repo; the row round-trips through as_row().
    over = load_tasks(tmp_path / "t.jsonl", overrides={"marshmallow-code/marshmallow": "pypi:marshmallow==2.20.0"})
    assert over.tasks[0].source == Source("pypi", "marshmallow==2.20.0")
    assert task_from_row(over.tasks[0].as_row()) == over.tasks[0]


def test_bad_rows_are_reported_with_line_and_id_and_do_not_stop_the_rest(lite_rows, tmp_path):
    good = json.dumps(lite_rows[0])
    lines = [
        good,
        "{not json",
        json.dumps({**lite_rows[1], "FAIL_TO_PASS": "[broken"}),
        json.dumps({"problem_statement": "no id"}),
        "",
        json.dumps({"instance_id": "orphan-3", "problem_statement": "x"}),
        json.dumps({**lite_rows[2], "PASS_TO_PASS": 7}),
        json.dumps(["a", "list"]),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    loaded = load_tasks(path)
    assert [t.instance_id for t in loaded.tasks] == [lite_rows[0]["instance_id"]]
    got = {(p.where.rsplit(":", 1)[1], p.instance_id) for p in loaded.problems}
    assert got == {
        ("2", "?"),
        ("3", lite_rows[1]["instance_id"]),
        ("4", "?"),
        ("6", "orphan-3"),
        ("7", lite_rows[2]["instance_id"]),
        ("8", "?"),
    }
    reasons = {p.instance_id: p.reason for p in loaded.problems}
    assert "FAIL_TO_PASS" in reasons[lite_rows[1]["instance_id"]]
    assert "no repository source" in reasons["orphan-3"]
    assert "PASS_TO_PASS" in reasons[lite_rows[2]["instance_id"]]
    with pytest.raises(TaskLoadError, match="orphan-3"):
        load_tasks(path, ids={"orphan-3"}).require()


def test_swesmith_rows_use_the_reversed_bug_patch_and_a_template_statement(data_dir):
    loaded = load_tasks(data_dir / "swesmith_webargs" / "tasks.jsonl")
    assert len(loaded.tasks) == 253 and not loaded.problems
    task = loaded.tasks[0]
    assert task.source == Source("pypi", "webargs==8.6.0") and task.version == "8.6.0"
    assert task.repo == "marshmallow-code/webargs"
    assert task.setup_patch == task.row["bug_patch"] and task.patch == reverse(task.row["bug_patch"])
    assert task.fail_to_pass[0] in task.problem_statement and "Do not change the tests" in task.problem_statement


def test_source_specs_parse_and_reject_clearly():
    assert parse_source("pypi:webargs==8.6.0") == Source("pypi", "webargs==8.6.0")
    assert parse_source("git:https://example.org/x/y.git@0123abc") == Source(
        "git", "https://example.org/x/y.git", "0123abc"
    )
    for bad, hint in [
        ("pypi:webargs", "exact version"),
        ("git:https://e.org/x.git", "commit sha"),
        ("ftp:x", "unknown"),
    ]:
        with pytest.raises(ValueError, match=hint):
            parse_source(bad)


@pytest.fixture
def upstream(tmp_path: Path) -> tuple[Path, list[str]]:
    """A real git repository with three commits, served over file:// like a remote."""
    up = tmp_path / "upstream"
    up.mkdir()
    git("init", "-q", cwd=up)
    shas = []
    for i in range(3):
        (up / "f.txt").write_text(f"version {i}\n")
        git("add", "-A", cwd=up)
        git("commit", "-qm", f"c{i}", cwd=up)
        shas.append(git("rev-parse", "HEAD", cwd=up).strip())
    return up, shas


def test_git_source_fetches_one_commit_shallowly_and_caches_it(upstream, tmp_path, monkeypatch):
    monkeypatch.setenv("AITLRT_HOME", str(tmp_path / "home"))
    up, shas = upstream
    source = parse_source(f"git:file://{up}@{shas[1]}")
    repo, base = materialise(source)
    assert base == shas[1]
    assert git("show", f"{base}:f.txt", cwd=repo) == "version 1\n"
    assert git("rev-parse", "--is-shallow-repository", cwd=repo).strip() == "true"
    assert git("rev-list", "--count", "--all", cwd=repo).strip() == "1"  # only that commit came over
    shutil.rmtree(up)  # cached: no second fetch needed
    assert materialise(source) == (repo, base)


def test_local_source_at_a_revision_and_setup_patch_commit(upstream, tmp_path, monkeypatch):
    monkeypatch.setenv("AITLRT_HOME", str(tmp_path / "home"))
    up, shas = upstream
    repo, base = materialise(Source("local", str(up), "HEAD~2"))
    assert base == shas[0]
    patch = "--- a/f.txt\n+++ b/f.txt\n@@ -1 +1 @@\n-version 0\n+patched\n"
    first = with_patch(repo, base, patch)
    assert first != base and with_patch(repo, base, patch) == first  # cached by a ref
    assert git("show", f"{first}:f.txt", cwd=repo) == "patched\n"
    assert git("status", "--porcelain", cwd=repo) == ""  # made without touching the work tree
    other = tmp_path / "home2"
    monkeypatch.setenv("AITLRT_HOME", str(other))
    assert with_patch(*materialise(Source("local", str(up), "HEAD~2")), patch) == first  # deterministic sha


def test_pypi_sdist_source_and_a_swesmith_task_checkout(data_dir):
    task = load_tasks(data_dir / "swesmith_webargs" / "tasks.jsonl", limit=1).tasks[0]
    repo, base = materialise(task.source)
    files = git("ls-tree", "-r", "--name-only", base, cwd=repo).split()
    assert "src/webargs/core.py" in files and "tests/test_core.py" in files
    _, start = task.checkout()
    assert git("rev-parse", f"{start}~1", cwd=repo).strip() == base  # the bug, committed on the sdist
    # The task's starting point differs from the sdist by the bug patch; the oracle takes it back.
    assert normalised_files(git("diff", base, start, cwd=repo)) == normalised_files(task.setup_patch)
    assert normalised_files(git("diff", start, base, cwd=repo)) == normalised_files(task.patch)


def test_heldout_split_shares_no_function_and_holds_out_a_whole_file():
    from aitlrt.tasks.split import split_heldout, task_function

    def row(i, path, fn):
        return {"instance_id": f"t{i}", "files": [path], "mutation": f"{path}: changed `<` to `>` in {fn} (line 3)"}

    rows = [row(0, "a.py", "f"), row(1, "a.py", "f"), row(2, "a.py", "g"), row(3, "b.py", "h"), row(4, "b.py", "k")]
    rows += [row(5, "c.py", "m"), row(6, "a.py", "n"), row(7, "b.py", "p")]
    train, heldout = split_heldout(rows, 0.4, seed=1)
    assert {task_function(r) for r in train}.isdisjoint(task_function(r) for r in heldout)
    assert "c.py:m" in {task_function(r) for r in heldout}, "the file with the fewest tasks is held out whole"
    assert len(heldout) == 3 and len(train) + len(heldout) == len(rows)
    assert split_heldout(rows, 0.4, seed=1) == (train, heldout), "deterministic per seed"
    train, heldout = split_heldout(rows, 0.2, heldout_files=["b.py"])
    assert {r["instance_id"] for r in heldout} == {"t3", "t4", "t7"}
    with pytest.raises(ValueError, match="no task"):
        split_heldout(rows, 0.2, heldout_files=["z.py"])


def test_warm_start_split_gives_rl_the_functions_the_warm_start_never_saw():
    from aitlrt.tasks.split import split_warm_start, task_function
    from aitlrt.training.config import AgentScriptArguments

    rows = [
        {"instance_id": f"t{i}", "files": ["a.py"], "mutation": f"a.py: changed `<` to `>` in {fn} (line 3)"}
        for i, fn in enumerate("ffgghkkmnp")
    ]
    warm, rl = split_warm_start(rows, 0.5, seed=3)
    assert {task_function(r) for r in warm}.isdisjoint(task_function(r) for r in rl)
    assert len(warm) + len(rl) == len(rows) and 4 <= len(warm) <= 6
    assert split_warm_start(rows, 0.5, seed=3) == (warm, rl), "deterministic per seed"
    assert split_warm_start(rows, 1.0) == (rows, rows), "share 1: warm start and RL both get every task"
    with pytest.raises(ValueError, match="two mutated functions"):
        split_warm_start(rows[:2], 0.5)
    with pytest.raises(ValueError, match=r"warm_start 'oracle'"):
        AgentScriptArguments(warm_start="trajectories.jsonl", warm_start_share=0.5)
    assert split_warm_start(rows, 0.0) == ([], rows), "share 0: the warm start's tasks come from warm_start_from"
    tiny, rest = split_warm_start(rows, 0.01)
    assert tiny and rest and len({task_function(r) for r in tiny}) == 1, (
        "a tiny share still gives the warm start one function"
    )
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        AgentScriptArguments(warm_start="oracle", warm_start_share=1.5)
    with pytest.raises(ValueError, match="give it some with warm_start_from"):
        AgentScriptArguments(warm_start="oracle", warm_start_share=0.0)
    with pytest.raises(ValueError, match="not to 'none'"):
        AgentScriptArguments(warm_start_from=["pypi:toolz==1.2.0"])
    assert AgentScriptArguments(warm_start="oracle", warm_start_share=0.0, warm_start_from=["pypi:toolz==1.2.0"])


def test_generated_tasks_are_topped_up_unless_the_source_ran_out(tmp_path, monkeypatch):
    import aitlrt.tasks.generate
    from aitlrt.tasks.generate import Report
    from aitlrt.training.dataset import generated_tasks

    monkeypatch.setenv("AITLRT_HOME", str(tmp_path))
    calls: list[tuple[str, int, int]] = []
    found = {"pypi:small==1": 3, "pypi:large==1": 99}  # valid tasks each source can give

    def generate(source, out, *, max_tasks, seed, max_file_lines):
        have = len(out.read_text().splitlines()) if out.exists() else 0
        kept = min(max_tasks, found[str(source)] - have)
        calls.append((str(source), max_tasks, seed))
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as sink:
            sink.write("".join(json.dumps({"instance_id": f"t{have + i}"}) + "\n" for i in range(kept)))
        return Report(candidates=kept + 1, kept=kept)

    monkeypatch.setattr(aitlrt.tasks.generate, "generate_tasks", generate)
    for source in found:
        for want in (2, 5, 5):
            generated_tasks(source, want, 110)
    assert calls == [
        ("pypi:small==1", 2, 0),
        ("pypi:small==1", 3, 2),  # found 1 of 3: out of candidates, never asked again
        ("pypi:large==1", 2, 0),
        ("pypi:large==1", 3, 2),
    ]
    assert len(generated_tasks("pypi:small==1", 5, 110).read_text().splitlines()) == 3


def test_run_tasks_give_each_sources_tasks_to_its_own_part_only(monkeypatch):
    import aitlrt.training.dataset as dataset
    from aitlrt.tasks.split import task_function
    from aitlrt.training.config import AgentScriptArguments

    rows = [
        {"instance_id": f"t{i}", "files": [f"{fn}.py"], "mutation": f"{fn}.py: changed `<` to `>` in {fn}{i % 3}"}
        for i, fn in enumerate("aabbbcccdd" * 2)
    ]
    asked: list[tuple[list[str], int]] = []

    def source_rows(sources, per_source, max_file_lines):
        asked.append((sources, per_source))
        return [{"instance_id": f"{s}-{i}"} for s in sources for i in range(per_source)]

    monkeypatch.setattr(dataset, "load_task_rows", lambda script: list(rows))
    monkeypatch.setattr(dataset, "source_rows", source_rows)
    script = AgentScriptArguments(
        heldout_share=0.3,
        warm_start="oracle",
        warm_start_share=0.5,
        warm_start_from=["pypi:w==1"],
        warm_start_from_tasks=2,
        grpo_from=["pypi:g==1", "pypi:h==1"],
        grpo_from_tasks=3,
    )
    tasks = dataset.run_tasks(script)
    ids = {part: {r["instance_id"] for r in getattr(tasks, part)} for part in ("grpo", "heldout", "warm_start")}
    assert {i for i in ids["grpo"] if "==" in i} == {f"pypi:{s}==1-{i}" for s in "gh" for i in range(3)}
    assert {i for i in ids["warm_start"] if "==" in i} == {"pypi:w==1-0", "pypi:w==1-1"}
    assert not {i for i in ids["heldout"] if "==" in i}, "other sources' tasks are never held out"
    script = AgentScriptArguments(heldout_share=0.3, heldout_from=["pypi:u==1"], heldout_from_tasks=2)
    unseen = dataset.run_tasks(script)
    assert {r["instance_id"] for r in unseen.heldout if "==" in r["instance_id"]} == {"pypi:u==1-0", "pypi:u==1-1"}
    assert not {r["instance_id"] for r in unseen.grpo if "==" in r["instance_id"]}, "held out only"
    with pytest.raises(ValueError, match="heldout_from pypi:g==1: also in grpo_from"):
        AgentScriptArguments(heldout_from=["pypi:g==1"], grpo_from=["pypi:g==1"])
    assert ids["heldout"] and ids["heldout"].isdisjoint(ids["grpo"] | ids["warm_start"])
    own = {part: {task_function(r) for r in getattr(tasks, part) if "mutation" in r} for part in ids}
    assert own["grpo"] and own["warm_start"] and own["grpo"].isdisjoint(own["warm_start"])
    assert asked[:2] == [(["pypi:w==1"], 2), (["pypi:g==1", "pypi:h==1"], 3)]
    assert not dataset.run_tasks(AgentScriptArguments(heldout_share=0.3)).warm_start
    held = tasks.heldout[0]["instance_id"]  # a source that gives a held-out task again (e.g. --generate_from's)
    monkeypatch.setattr(dataset, "source_rows", lambda sources, n, lines: [{"instance_id": held}] if sources else [])
    with pytest.raises(ValueError, match=rf"1 held-out tasks \({held}, ...\) .* would be trained on"):
        dataset.run_tasks(AgentScriptArguments(heldout_share=0.3, grpo_from=["pypi:cachetools==8.0.1"]))


def test_the_heldout_evaluation_has_its_own_reward_weights():
    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments, heldout_weights

    script = AgentScriptArguments(rewards=["tests_pass", "patch_similarity"], heldout_reward_weights=[1.0, 0.0])
    config = AgentGRPOConfig(output_dir="/tmp/x", reward_weights=[1.0, 0.5])
    assert heldout_weights(script, config) == [1.0, 0.0]
    assert heldout_weights(AgentScriptArguments(rewards=["tests_pass", "patch_similarity"]), config) == [1.0, 0.5]
    with pytest.raises(ValueError, match="grpo_from_tasks must be at least 1, got 0"):
        AgentScriptArguments(grpo_from_tasks=0)
    with pytest.raises(ValueError, match="1 weights for 2 rewards"):
        AgentScriptArguments(rewards=["tests_pass", "patch_similarity"], heldout_reward_weights=[1.0])

"""Trivial policies (no edit, an appended comment, a whitespace-only edit, a patch(1) reject file beside the task's
file, an appended ``pass``, the oracle's fix) scored by the scripted agent through a real aitlrt-serve + vLLM CPU
server, the real rollout runner and the real grader on a real task."""

from __future__ import annotations

from pathlib import Path

import pytest

from aitlrt.evaluation.checkpoints import TRIVIAL_POLICIES, evaluate
from aitlrt.evaluation.scoring import measure_funcs, paired
from aitlrt.rewards.builtin import REWARDS
from aitlrt.rollout.agents.scripted import trivial_edit
from aitlrt.rollout.batch import PreparedTask, RolloutSettings, prepare_tasks
from aitlrt.tasks.grading import apply_patch
from aitlrt.tasks.loader import load_tasks
from aitlrt.tasks.patches import changed_paths
from aitlrt.tasks.task import task_from_row

# A one-line operator flip (`and` -> `or`) in falconparser.py, which ends with a newline.
TASK = "marshmallow-code__webargs.dbde72fe.func_basic__cnxnquhd"


def test_trivial_edits_append_on_a_line_of_their_own(make_repo, tmp_path):
    repo = make_repo({"calc.py": "def add(a, b):\n    return a - b"})  # no newline at the end
    eof = "\\ No newline at end of file\n"
    oracle = f"--- a/calc.py\n+++ b/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n-    return a - b\n{eof}"
    oracle += f"+    return a + b\n{eof}"
    row = {"instance_id": "calc-1", "problem_statement": "add", "repo_path": str(repo), "patch": oracle}
    (task,) = prepare_tasks([task_from_row(row)])  # no files: the oracle's first path is the target
    expected = {
        "trivial:no-edit": "def add(a, b):\n    return a - b",
        "trivial:comment": "def add(a, b):\n    return a - b\n# reviewed\n",
        "trivial:whitespace": "def add(a, b):\n    return a - b\n\n",
        "trivial:reject-file": "def add(a, b):\n    return a - b",
        "trivial:no-op-code": "def add(a, b):\n    return a - b\npass\n",
        "trivial:oracle": "def add(a, b):\n    return a + b",
    }
    for policy, text in expected.items():
        copy = tmp_path / policy.replace(":", "_")
        copy.mkdir()
        (copy / "calc.py").write_text("def add(a, b):\n    return a - b")
        assert apply_patch(copy, trivial_edit(policy, task)) is None, policy
        assert (copy / "calc.py").read_text() == text, policy
        assert (copy / "calc.py.rej").exists() == (policy == "trivial:reject-file"), policy
    rejected = (tmp_path / "trivial_reject-file" / "calc.py.rej").read_text()
    assert rejected.startswith("--- a/calc.py\n+++ b/calc.py\n@@") and rejected.endswith("+# reviewed\n")
    with pytest.raises(ValueError, match="unknown trivial policy"):
        trivial_edit("trivial:nope", task)


@pytest.fixture(scope="module")
def webargs_task(data_dir: Path) -> list[PreparedTask]:
    return prepare_tasks(load_tasks(data_dir / "swesmith_webargs" / "tasks.jsonl", ids={TASK}).tasks)


def test_trivial_policies_through_the_proxy_runner_and_grader(served, webargs_task):
    settings = RolloutSettings(agent="single-call", n=3, seed=0, concurrency=1, timeout_s=120)  # n, seed: ignored
    funcs = {**measure_funcs(), "code_edit": REWARDS["code_edit"]}
    results = evaluate(list(TRIVIAL_POLICIES), webargs_task, settings, funcs, proxy=served.url)
    by_label = {r.label: r for r in results}
    assert list(by_label) == list(TRIVIAL_POLICIES)
    for result in results:  # one deterministic, unseeded rollout per task, recorded by the proxy like any other
        (outcome,) = result.batch.outcomes
        assert outcome.calls == 1 and outcome.failed_calls == 0 and not outcome.unscorable, outcome
        assert result.batch.seeds == [None] and not paired(result.batch, result.batch)
        assert result.summary["edit_rate"] == (0.0 if result.label == "trivial:no-edit" else 1.0)

    def scores(label: str) -> dict[str, float]:
        return {name: values[0] for name, values in by_label[label].rewards.items()}

    no_edit = by_label["trivial:no-edit"].batch.outcomes[0]
    assert no_edit.status == "no_patch" and no_edit.patch == ""
    assert scores("trivial:no-edit")["tests_pass"] == 0.0

    comment = by_label["trivial:comment"].batch.outcomes[0]
    whitespace = by_label["trivial:whitespace"].batch.outcomes[0]
    assert comment.status == whitespace.status == "ok"
    added = [line for line in comment.patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert added == ["+# reviewed"] and "src/webargs/falconparser.py" in comment.patch
    added = [line for line in whitespace.patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert added == ["+"] and "src/webargs/falconparser.py" in whitespace.patch
    rejected = by_label["trivial:reject-file"].batch.outcomes[0]
    assert rejected.status == "ok"
    assert changed_paths(rejected.patch) == ["src/webargs/falconparser.py.rej"], "no file of the task changes"
    for label in ("trivial:comment", "trivial:whitespace", "trivial:reject-file"):
        assert scores(label) == {
            "tests_pass": 0.0,
            "changed_lines_similarity": 0.0,
            "changed_lines_overlap": 0.0,
            "localised": 0.0,
            "keeps_pass_to_pass": 1.0,
            "code_edit": 0.0,
        }, label
    no_op = scores("trivial:no-op-code")  # a `pass` is code: a code edit, far from the fix's lines
    similar = no_op.pop("changed_lines_similarity")
    assert no_op == {
        "tests_pass": 0.0,
        "changed_lines_overlap": 0.0,  # no line of the fix's
        "localised": 0.0,
        "keeps_pass_to_pass": 1.0,
        "code_edit": 1.0,
    }
    assert 0.0 < similar < 0.2, "the characters any code line shares with the fix's (difflib's ratio)"

    oracle = by_label["trivial:oracle"].batch.outcomes[0]
    assert oracle.status == "ok"
    summary = by_label["trivial:oracle"].summary
    assert summary["resolve_rate"] == summary["localisation"] == summary["p2p_kept_edits"] == 1.0
    assert by_label["trivial:comment"].summary["resolve_rate"] == 0.0
    assert scores("trivial:oracle") == {
        "tests_pass": 1.0,
        "changed_lines_similarity": 1.0,
        "changed_lines_overlap": 1.0,
        "localised": 1.0,
        "keeps_pass_to_pass": 1.0,
        "code_edit": 1.0,
    }

"""The grader's result channel and what it refuses to believe; the test infrastructure a patch may not change; the
paths a patch may not write. The channel runs for real: this project's own pytest, in the sandbox, on a small repo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from aitlrt.tasks import envs
from aitlrt.tasks.grading import protected
from aitlrt.tasks.patches import unsafe_paths
from aitlrt.tasks.pytest_run import read_records, run_pytest

NONCE = "n0nce"


def records(*items: dict) -> bytes:
    return b"".join(json.dumps({"nonce": NONCE, "seq": i, **item}).encode() + b"\n" for i, item in enumerate(items, 1))


def phases(test: str, call: str = "passed", xfail: bool = False) -> list[dict]:
    return [
        {"kind": "report", "id": test, "when": "setup", "outcome": "passed", "xfail": False},
        {"kind": "report", "id": test, "when": "call", "outcome": call, "xfail": xfail},
        {"kind": "report", "id": test, "when": "teardown", "outcome": "passed", "xfail": False},
    ]


def test_a_complete_run_is_believed_with_its_statuses():
    data = records(
        {"kind": "started"},
        {"kind": "collected", "ids": ["t.py::a", "t.py::b", "t.py::c[x y]"]},
        *phases("t.py::a"),
        *phases("t.py::b", "skipped", xfail=True),
        *phases("t.py::c[x y]", "failed"),
        {"kind": "done", "exitstatus": 1},
    )
    statuses, problems = read_records(data, NONCE)
    assert problems == []
    assert statuses == {"t.py::a": "PASSED", "t.py::b": "XFAIL", "t.py::c[x y]": "FAILED", "t.py::c[x": "FAILED"}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"", "did not start"),
        (records({"kind": "started"}, {"kind": "collected", "ids": ["t.py::a"]}, *phases("t.py::a")), "did not finish"),
        (records({"kind": "started"}, {"kind": "collected", "ids": ["t.py::a"]}, {"kind": "done"}), "did not run"),
        (records({"kind": "started"}) + b'{"nonce": "guess", "seq": 2, "kind": "done"}\n', "forged"),
        (records({"kind": "started"}, {"kind": "done"}) + records({"kind": "started"}), "forged"),
        (records({"kind": "started"}, {"kind": "tamper", "what": ["x"]}, {"kind": "done"}), "machinery"),
    ],
    ids=["nothing", "no-done", "no-teardown", "no-nonce", "after-done-or-out-of-order", "tamper"],
)
def test_a_run_that_cannot_be_believed_says_why(data, problem):
    _, problems = read_records(data, NONCE)
    assert any(problem in p for p in problems), problems


def test_test_infrastructure_is_protected_and_library_code_is_not():
    targets = ["t/test_core.py"]
    for path in ["conftest.py", "src/pkg/conftest.py", "tests/helpers.py", "pkg/tests/data.json", "tox.ini",
                 "setup.cfg", "pyproject.toml", "pytest.ini", "src/sitecustomize.py", "x.pth", "test_a.py",
                 "a_test.py", "t/test_core.py"]:  # fmt: skip
        assert protected(path, targets), path
    for path in ["src/pkg/core.py", "pkg/testing.py", "setup.py", "README.md", "src/pkg/tester.py"]:
        assert not protected(path, targets), path


def test_patches_that_leave_the_repository_are_named():
    def new_file(path: str, mode: str = "100644") -> str:
        return f"diff --git a/{path} b/{path}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n+x\n"

    assert unsafe_paths(new_file("pkg/core.py")) == []
    assert unsafe_paths(new_file("pkg/../.git/config")) == ["pkg/../.git/config"]
    assert unsafe_paths(new_file(".git/hooks/pre-commit")) == [".git/hooks/pre-commit"]
    assert unsafe_paths("--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n") == ["/etc/passwd"]
    assert unsafe_paths(new_file("link", "120000"))[0].startswith("a symbolic link")
    rename = "diff --git a/a.py b/a.py\nsimilarity index 100%\nrename from a.py\nrename to ../b.py\n"
    assert unsafe_paths(rename) == ["../b.py"]


@pytest.fixture
def this_env(tmp_path: Path) -> envs.TestEnv:
    """This project's own venv as a test environment (it has pytest)."""
    root = tmp_path / "env"
    root.mkdir()
    (root / "venv").symlink_to(Path(sys.prefix))
    return envs.TestEnv(root, envs.EnvSpec(test_cmd="pytest -rA"))


def test_the_channel_reports_a_real_run_and_the_tests_get_a_clean_environment(this_env, make_repo, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-token")
    repo = make_repo(
        {
            "lib.py": "def f(x):\n    return x + 1\n",
            "pytest.ini": "[pytest]\naddopts = --no-such-option\n",  # the project's addopts are reset
            "tests/test_lib.py": (
                "import os\nfrom lib import f\n"
                "def test_passes():\n    assert f(1) == 2\n"
                "def test_fails():\n    assert f(1) == 3\n"
                "def test_no_secrets():\n"
                "    assert 'WANDB_API_KEY' not in os.environ and os.environ['HOME'] == '/tmp'\n"
            ),
        }
    )
    run = run_pytest(this_env, repo, ["tests/test_lib.py"], timeout=120)
    assert run.problems == (), (run.problems, run.output[-2000:])
    assert run.statuses == {
        "tests/test_lib.py::test_passes": "PASSED",
        "tests/test_lib.py::test_fails": "FAILED",
        "tests/test_lib.py::test_no_secrets": "PASSED",
    }


def test_training_refuses_to_grade_without_isolation_unless_told(monkeypatch, tmp_path, capsys):
    from aitlrt import train
    from aitlrt.tasks import sandbox

    monkeypatch.setattr(sandbox, "isolation", lambda: "none: nothing works here")
    argv = ["--output_dir", str(tmp_path), "--tasks", str(tmp_path / "no-such-tasks.jsonl"), "--serve", "none"]
    with pytest.raises(SystemExit, match=r"no isolation.*allow_unisolated_tests"):
        train.main(argv)
    assert sandbox.require_isolation(allow_none=True).startswith("none")
    assert "NO isolation" in capsys.readouterr().out  # aitlrt's own log handler


def test_the_plugin_is_written_for_old_pythons():
    """It runs under the test environment's Python (3.9 for SWE-bench's marshmallow; test_grading runs it there)."""
    import ast

    from aitlrt.tasks.pytest_run import CHANNEL_DIR

    source = (CHANNEL_DIR / "aitlrt_grade_channel.py").read_text()
    tree = ast.parse(source, feature_version=(3, 8))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and any(k.arg == "strict" for k in n.keywords)]
    assert calls == []  # zip(strict=...) is 3.10+


FINDER_LIB = (
    "import sys\n"
    "class LibFinder:\n"  # what toolz's tlz does: an import hook of the library's own, installed at import
    "    def find_spec(self, name, path=None, target=None):\n"
    "        return None\n"
    "sys.meta_path.append(LibFinder())\n"
)


@pytest.mark.parametrize(
    ("patched", "user", "tampered"),
    [
        (None, "", True),  # no patched files named: any workspace finder may be the patch's (as before)
        ([], "", False),  # the library's own unchanged hook is the base's behaviour
        (["finder_lib.py"], "", True),  # the patch changed the file that defines the hook
        (["user.py"], "import finder_lib\nfinder_lib.LibFinder.find_spec = lambda *a, **k: None\n", True),
        (
            ["user.py"],
            "import sys, finder_lib\nf = finder_lib.LibFinder()\nf.find_spec = lambda *a, **k: None\n"
            "sys.meta_path.append(f)\n",
            True,
        ),
        (
            ["user.py"],
            "import sys\nexec('class X:\\n    def find_spec(self, *a):\\n        return None\\n'"
            "'sys.meta_path.append(X())\\n', {'sys': sys, '__name__': 'finder_lib'})\n",
            True,
        ),
    ],
    ids=["unnamed", "unchanged-library", "patched-library", "swapped-method", "instance-method", "exec-class"],
)
def test_an_import_hook_is_tampering_unless_the_librarys_unchanged_code_installs_it(
    this_env, make_repo, patched, user, tampered
):
    repo = make_repo(
        {
            "finder_lib.py": FINDER_LIB,
            "user.py": user or "x = 1\n",
            "tests/test_lib.py": "import finder_lib, user\ndef test_it():\n    assert True\n",
        }
    )
    run = run_pytest(this_env, repo, ["tests/test_lib.py"], timeout=120, patched=patched)
    assert run.statuses == {"tests/test_lib.py::test_it": "PASSED"}, run.output[-2000:]
    assert any("sys.meta_path gained" in p for p in run.problems) == tampered, run.problems

"""The oracle teacher's shell actions for mini-swe-agent's text mode: each answer read back by mini-swe-agent's own
parser (from its venv), a conversation played out with the real ``nl``, ``sed`` and ``patch`` in a scratch copy
(locate, inspect, apply, submit; the files end fixed; each step acts on what the conversation shows), tasks that
share a problem statement told apart by what the shown lines are, and diffs that ``patch`` applies to files without a
final newline, created and deleted."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from aitlrt.rollout.agents.mini_swe import TEST_ALIAS, feedback_note, miniswe_venv
from aitlrt.warmstart.oracle import OracleFile, OracleTask
from aitlrt.warmstart.oracle_shell import (
    APPLY,
    LOCATE,
    SHOWN_CHARS,
    SUBMIT,
    answer_shell,
    apply_command,
    commands,
    fix_diff,
    inspection,
)

CALC = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(30)) + "def add(a, b):\n    return a - b\n"
STATEMENT = "The test suite of this repository has failing tests:\ntests/test_calc.py::test_add\n\nFix it."
SYSTEM = {"role": "system", "content": "You are a helpful assistant that can interact with a computer."}


def task(instance_id: str, *files: OracleFile, statement: str = STATEMENT) -> OracleTask:
    return OracleTask(instance_id, statement, files)


def opening(statement: str = STATEMENT) -> list[dict]:
    """mini-swe-agent's first request: its system prompt and the task in its instance template."""
    return [SYSTEM, {"role": "user", "content": f"Please solve this issue: {statement}\n\nYou can execute bash ..."}]


def write(root: Path, files: dict[str, str]) -> None:
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(content.encode())


def run(root: Path, command: str) -> dict:
    """What mini-swe-agent appends after running ``command``: its observation (``mini_textbased.yaml``'s form)."""
    done = subprocess.run(["bash", "-c", command], cwd=root, capture_output=True, text=True, timeout=30)
    output = done.stdout + done.stderr
    return {"role": "user", "content": f"<returncode>{done.returncode}</returncode>\n<output>\n{output}</output>"}


def play(root: Path, tasks: list[OracleTask], turns: int = 6) -> list[str]:
    """The oracle's answers to a mini-swe-agent run in ``root`` until it submits, each command run there."""
    messages, answers = opening(tasks[0].problem_statement), []
    for _ in range(turns):
        text = answer_shell(tasks, messages)
        answers.append(text)
        (command,) = commands(text)
        if command == SUBMIT:
            return answers
        messages += [{"role": "assistant", "content": text}, run(root, command)]
    raise AssertionError(f"no submit in {turns} turns: {answers}")


def test_locate_inspect_apply_submit_leaves_the_fixed_files(tmp_path):
    """Each step acts on what the conversation shows: the failing tests' file named in the task, the source files
    listed, the file read whole; then the fix."""
    fixed = CALC.replace("return a - b", "return a + b")
    oracle = task("calc", OracleFile("pkg/calc.py", CALC, fixed))
    write(tmp_path, {"pkg/calc.py": CALC, "pkg/__init__.py": "", "tests/test_calc.py": "def test_add(): ...\n"})
    answers = play(tmp_path, [oracle])
    steps = [commands(a)[0] for a in answers]
    assert steps == [LOCATE, "nl -ba pkg/calc.py", apply_command(oracle), SUBMIT]
    assert answers[0].startswith("THOUGHT: The failing tests are in tests/test_calc.py. Let me list the source")
    assert answers[1].startswith("THOUGHT: pkg/calc.py should hold the code the failing tests exercise. Let me read")
    assert all(a.startswith("THOUGHT: ") for a in answers)
    listed = run(tmp_path, LOCATE)["content"]
    assert "./pkg/calc.py" in listed and "test_calc" not in listed
    assert steps[2].startswith(f"{APPLY}\n--- a/pkg/calc.py\n+++ b/pkg/calc.py\n@@ -119,4 +119,4 @@\n")
    assert steps[2].endswith("\n+    return a + b\nEOF")
    assert (tmp_path / "pkg" / "calc.py").read_text() == fixed
    assert sorted(p.name for p in (tmp_path / "pkg").iterdir()) == ["__init__.py", "calc.py"]  # no .orig, no .rej


def test_with_test_feedback_the_oracle_runs_the_tests_once_after_its_fix(tmp_path):
    """A task that offers ``run-tests`` (mini-swe-agent's note) gets inspect, apply, run-tests, submit."""
    fixed = CALC.replace("return a - b", "return a + b")
    oracle = task("calc", OracleFile("calc.py", CALC, fixed), statement=STATEMENT + feedback_note(1))
    write(tmp_path, {"calc.py": CALC, "run-tests": "#!/bin/sh\necho 'AITLRT test feedback: all 3 tests pass'\n"})
    (tmp_path / "run-tests").chmod(0o755)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")  # a stand-in for the alias
        steps = [commands(a)[0] for a in play(tmp_path, [oracle])]
    assert steps == [LOCATE, inspection(oracle)[0], apply_command(oracle), TEST_ALIAS, SUBMIT]
    assert (tmp_path / "calc.py").read_text() == fixed


def test_tasks_sharing_a_statement_are_told_apart_by_the_lines_shown(tmp_path):
    early = CALC.replace("return x + 3", "return x - 3")  # another bug with the same failing test's statement
    other = "def sub(a, b):\n    return a + b\n"
    wrong = task("other", OracleFile("other.py", other, other.replace("a + b", "a - b")))
    twin = task("early", OracleFile("calc.py", early, CALC.replace("return a - b", "return a + b")))
    right = task("late", OracleFile("calc.py", CALC, CALC.replace("return a - b", "return a + b")))
    write(tmp_path, {"calc.py": CALC, "other.py": other.replace("a + b", "a - b")})
    steps = [commands(a)[0] for a in play(tmp_path, [wrong, twin, right])]
    # the first candidate's file shows another start (its bug is not there): the next file is read, and of the two
    # candidates in it the one whose start the listing shows is fixed
    assert inspection(twin)[0] == inspection(right)[0] == "nl -ba calc.py"
    assert steps == [LOCATE, "nl -ba other.py", "nl -ba calc.py", apply_command(right), SUBMIT]
    assert (tmp_path / "calc.py").read_text() == CALC.replace("return a - b", "return a + b")


def test_a_stranger_is_told_to_submit_and_a_fix_only_creating_files_is_applied_at_once(tmp_path):
    stranger = answer_shell([task("calc", OracleFile("calc.py", CALC, CALC + "\n"))], opening("another issue"))
    assert commands(stranger) == [SUBMIT]
    new = task("new", OracleFile("pkg/new.py", "", "X = 1\n"))
    steps = [commands(a)[0] for a in play(tmp_path, [new])]
    assert steps == [LOCATE, apply_command(new), SUBMIT] and (tmp_path / "pkg" / "new.py").read_text() == "X = 1\n"


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("a\nb\nc", "a\nB\nc"),  # no final newline, kept
        ("a\nb\n", "a\nb\nc"),  # one taken away
        ("a\r\nb\r\n", "a\r\nB\r\n"),  # CRLF
        ("x = '```'\nEOF = 1\n", "```\nEOF\n"),  # lines that read as mini's fence or the here-document's end
    ],
)
def test_patch_applies_the_diff_exactly(tmp_path, before, after):
    oracle = task("t", OracleFile("m.py", before, after), OracleFile("gone.py", "G = 1\n", ""))
    write(tmp_path, {"m.py": before, "gone.py": "G = 1\n"})
    look = inspection(oracle)[0]
    shown = opening()
    for command in (LOCATE, look):
        shown += [{"role": "assistant", "content": f"```mswea_bash_command\n{command}\n```"}, run(tmp_path, command)]
    (command,) = commands(answer_shell([oracle], shown))
    assert command == apply_command(oracle) and fix_diff(oracle) in command
    done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "m.py").read_bytes() == after.encode() and not (tmp_path / "gone.py").exists()


def test_an_inspection_stays_short_of_minis_elision():
    big = "".join(f"    value_{i} = compute_something_rather_long({i}, another_argument)\n" for i in range(400))
    files = [OracleFile(f"m{k}.py", big, big.replace(f"({k * 90}, ", f"({k * 90 + 1}, ")) for k in range(4)]
    files.append(OracleFile("whole.py", big, ""))  # a file deleted: its first SHOWN_LINES lines
    command, shown = inspection(task("big", *files))
    assert command is not None and 0 < sum(len(line) + 1 for line in shown) <= SHOWN_CHARS
    assert command.startswith("nl -ba m0.py | sed -n '1,4p' && nl -ba m1.py | sed -n '88,94p'")


@pytest.mark.skipif(not (miniswe_venv() / "bin" / "python").exists(), reason="run jobs/setup.sh first")
def test_mini_swe_agents_own_parser_reads_one_action_per_answer(tmp_path):
    oracle = task("calc", OracleFile("calc.py", "x = '```'\n", "```\n"))
    write(tmp_path, {"calc.py": "x = '```'\n"})
    answers = play(tmp_path, [oracle])
    assert len(answers) == 4  # locate, inspect, apply, submit
    read = (
        "import json, sys\n"
        "from minisweagent.models.litellm_textbased_model import LitellmTextbasedModelConfig as C\n"
        "from minisweagent.models.utils.actions_text import parse_regex_actions\n"
        "regex = C.model_fields['action_regex'].default\n"
        "print(json.dumps([parse_regex_actions(a, action_regex=regex, format_error_template='') for a in "
        "json.load(sys.stdin)]))"
    )
    python = str(miniswe_venv() / "bin" / "python")
    env = {"MSWEA_SILENT_STARTUP": "1", "MSWEA_CONFIGURED": "true", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [python, "-c", read], input=json.dumps(answers), env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == [[{"command": c}] for a in answers for c in commands(a)]

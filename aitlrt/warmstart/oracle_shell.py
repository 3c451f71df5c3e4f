"""The oracle teacher's answers for an agent whose only tool is a shell: mini-swe-agent in its text mode
(``mini_textbased.yaml``: one ```` ```mswea_bash_command ```` block per answer, a THOUGHT before it). Pure
functions; ``aitlrt.warmstart.oracle_server`` serves them (format ``SHELL``).

mini-swe-agent's history is append-only: each request holds the task (its first user message), every earlier answer
and each command's output. The oracle reads where the work stands from that and answers, one command a turn, each
step acting on what the conversation shows, so that a policy imitating it can act the same way (``SHELL_VERSION``):

1. **locate**: ``LOCATE`` lists the repository's source files (tests left out), among them the module that the
   failing tests the task names exercise;
2. **inspect**: ``nl -ba FILE``, the whole file at the task's start where its numbered listing fits ``SHOWN_CHARS``,
   else the lines around each hunk of the fix (``nl -ba FILE | sed -n 'a,bp'``);
3. **apply**: the fix as a unified diff piped to ``patch -p1`` from a here-document (GNU patch and ``nl`` are in
   the sandbox, which binds the host read-only; a diff line never starts with ```` ``` ```` nor reads ``EOF``, so
   neither mini's action fence nor the here-document ends early);
4. **test**, where the rollout has test feedback (the task names ``run-tests``, ``aitlrt.rollout.agents.mini_swe``):
   ``run-tests``, which grades the work tree on the grader's copy and prints that all its tests pass;
5. **submit**: ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (mini-swe-agent 2.x submits when that is the first
   line of a command's output).

The task is the one whose problem statement the first user message holds. Generated tasks often share one (the same
failing tests; 7 of 31 cachetools tasks, 15 of 18 toolz): then the candidates are inspected in turn, and the first
whose lines the output shows exactly, line numbers included, is the one fixed.
"""

from __future__ import annotations

import difflib
import re
import shlex
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from aitlrt.rollout.agents.mini_swe import TEST_ALIAS
from aitlrt.warmstart.oracle import OracleFile, OracleTask, message_text

SHELL = "shell"
"""The oracle's answer format for mini-swe-agent's text mode."""
ACTION = re.compile(r"```mswea_bash_command\s*\n(.*?)\n```", re.DOTALL)
"""mini-swe-agent's ``action_regex`` (``LitellmTextbasedModelConfig``, 2.4.6); each action is ``.strip()``-ed."""
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
APPLY = "patch -p1 --no-backup-if-mismatch <<'EOF'"
"""The apply command's first line (no ``.orig`` left in the patch where a hunk lands off by some lines)."""
CONTEXT = 3
"""Lines of context around each hunk, shown and in the diff (git's default)."""
SHOWN_LINES = 60
"""Lines shown of one hunk at most (a removed method: its start)."""
SHOWN_CHARS = 8000
"""Characters an inspection shows at most: mini-swe-agent elides the middle of an output over 10,000."""
LOCATE = "find . -name '*.py' -not -path './.git/*' -not -path '*/tests/*' -not -name 'test_*.py' | sort"
"""The first command: the source files, where the module the failing tests exercise is found by its name."""
SHELL_VERSION = 2
"""In the warm start's cache key (``aitlrt.warmstart.recipe``): 1 inspected the fix's lines at once, which nothing
in the conversation showed (its warm start's first command read a file of its training packages in 28 of 34
held-out rollouts, docs/warm-start.md); 2 locates the file first and reads it whole."""
_TEST_FILE = re.compile(r"([\w./-]+\.py)::")


def action(thought: str, command: str) -> str:
    """An answer in mini-swe-agent's text format."""
    return f"THOUGHT: {thought}\n\n```mswea_bash_command\n{command}\n```"


def commands(text: str) -> list[str]:
    """The actions of an answer, as mini-swe-agent reads them."""
    return [found.strip() for found in ACTION.findall(text)]


def _split(text: str) -> list[str]:
    """``text``'s lines, ends kept, split at ``\\n`` only (as ``nl`` and ``patch`` split)."""
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def regions(f: OracleFile) -> list[tuple[int, int]]:
    """The 1-based inclusive line ranges of ``f.before`` around each hunk of the fix (``CONTEXT`` lines each side,
    at most ``SHOWN_LINES``); none for a file the fix creates."""
    before = _split(f.before)
    if not before:
        return []
    matcher = difflib.SequenceMatcher(None, before, _split(f.after), autojunk=False)
    out = []
    for group in matcher.get_grouped_opcodes(CONTEXT):
        first, end = group[0][1], min(len(before), max(group[-1][2], group[0][1] + 1))
        out.append((first + 1, min(end, first + SHOWN_LINES)))
    return out


def _numbered(line: str, number: int) -> str:
    """``line`` as ``nl -ba`` prints it: the number right-aligned in 6 columns, a tab (trailing blanks dropped)."""
    return f"{number:6d}\t{line}".rstrip()


@cache
def inspection(task: OracleTask) -> tuple[str | None, frozenset[str]]:
    """The command that shows ``task``'s files at its start (None: no file to show) and the lines it prints, with
    their numbers: a file whole while the listing stays within ``SHOWN_CHARS``, else the lines around its hunks, at
    most ``SHOWN_CHARS`` in all (the first hunk always, up to ``SHOWN_LINES``)."""
    parts: list[str] = []
    shown: set[str] = set()
    size = 0
    for f in task.files:
        lines, ranges = _split(f.before), []
        whole = [_numbered(line.rstrip("\n"), n) for n, line in enumerate(lines, 1)]
        listed = sum(len(p) + 1 for p in whole)
        if lines and size + listed <= SHOWN_CHARS:
            size += listed
            parts.append(f"nl -ba {shlex.quote(f.path)}")
            shown.update(whole)
            continue
        for first, last in regions(f):
            printed = [_numbered(lines[n - 1].rstrip("\n"), n) for n in range(first, last + 1)]
            size += sum(len(p) + 1 for p in printed)
            if shown and size > SHOWN_CHARS:
                break
            ranges.append(f"{first},{last}p")
            shown.update(printed)
        if ranges:
            parts.append(f"nl -ba {shlex.quote(f.path)} | sed -n '{';'.join(ranges)}'")
        if shown and size > SHOWN_CHARS:
            break
    return (" && ".join(parts) or None), frozenset(shown)


def fix_diff(task: OracleTask) -> str:
    """The fix as a unified diff that ``patch -p1`` applies to the files at the task's start: ``a/``, ``b/`` paths,
    ``/dev/null`` for a file created or deleted, ``\\ No newline at end of file`` where a file ends without one."""
    out = []
    for f in task.files:
        old = f"a/{f.path}" if f.before else "/dev/null"
        new = f"b/{f.path}" if f.after else "/dev/null"
        for line in difflib.unified_diff(_split(f.before), _split(f.after), old, new, n=CONTEXT):
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def apply_command(task: OracleTask) -> str:
    return f"{APPLY}\n{fix_diff(task)}EOF"


def candidates(tasks: Sequence[OracleTask], messages: Sequence[Mapping[str, Any]]) -> list[OracleTask]:
    """The tasks whose problem statement the conversation's first user message holds (mini-swe-agent's task)."""
    first = next((message_text(m) for m in messages if m.get("role") == "user"), "")
    return [t for t in tasks if t.problem_statement.strip() and t.problem_statement.strip() in first]


def has_tests(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the task (the first user message) offers ``run-tests``."""
    first = next((message_text(m) for m in messages if m.get("role") == "user"), "")
    return f"`{TEST_ALIAS}`" in first


def next_step(tasks: Sequence[OracleTask], messages: Sequence[Mapping[str, Any]]) -> tuple[str, OracleTask | None]:
    """What to do next (``locate``, ``inspect``, ``apply``, ``test`` or ``submit``) and for which task: once a fix
    was applied, test where the task offers it and that was not done yet, else submit; submit when no task fits;
    locate first; else apply the first candidate whose inspected lines the outputs show, or inspect the first not
    inspected yet, or apply the first with nothing to inspect (its fix only creates files)."""
    done = [c for m in messages if m.get("role") == "assistant" for c in commands(message_text(m))]
    if any(c.startswith(APPLY) or c == SUBMIT for c in done):
        return ("test" if has_tests(messages) and TEST_ALIAS not in done else "submit"), None
    output = {line.rstrip() for m in messages if m.get("role") == "user" for line in message_text(m).split("\n")}
    found = candidates(tasks, messages)
    if found and LOCATE not in done:
        return "locate", found[0]
    for task in found:
        command, shown = inspection(task)
        if command is not None and command in done and shown <= output:
            return "apply", task
    for task in found:
        command, _ = inspection(task)
        if command is not None and command not in done:
            return "inspect", task
    blind = [task for task in found if inspection(task)[0] is None]
    return ("apply", blind[0]) if blind else ("submit", None)


def answer_shell(tasks: Sequence[OracleTask], messages: Sequence[Mapping[str, Any]]) -> str:
    """The oracle's reply to one request of mini-swe-agent (see the module docstring)."""
    step, task = next_step(tasks, messages)
    command = inspection(task)[0] if task is not None else None
    if step == "locate" and task is not None:
        tests = list(dict.fromkeys(_TEST_FILE.findall(task.problem_statement)))[:2]
        named = f"The failing tests are in {' and '.join(tests)}." if tests else "Some tests fail."
        return action(f"{named} Let me list the source files to find the code they exercise.", LOCATE)
    if step == "inspect" and task is not None and command is not None:
        paths = ", ".join(f.path for f in task.files if f.before)
        how = "read it" if " | sed " not in command else "read the code around the relevant lines"
        return action(f"{paths} should hold the code the failing tests exercise. Let me {how}.", command)
    if step == "apply" and task is not None:
        paths = ", ".join(f.path for f in task.files)
        return action(f"I found the bug. I will fix {paths} with a patch.", apply_command(task))
    if step == "test":
        return action("The fix is in place. Let me run the tests that decide the task.", TEST_ALIAS)
    return action("The fix is in place. I submit my changes.", SUBMIT)

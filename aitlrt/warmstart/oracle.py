"""The oracle teacher's answers: a task's oracle fix written in Aider's own edit formats, for the conversation
Aider sends. Pure functions; ``aitlrt.warmstart.oracle_server`` reads the files and serves the answers.

Aider shows each file added to the chat in a user message as its path on one line, an opening fence, the file's
content and a closing fence (``Coder.get_files_content``; the fence is the first of Aider's fences that no line
of the files starts with). A request is matched to a task by the (path, content) of the task's files found in
it (as at the task's start, fixed, or *edited*: another content near the start, the nearest task's), its problem
statement otherwise, and answered with:

- the edit, when the task's files are in the chat as they are at its start or edited: ``whole`` (each changed file
  in full, ``WholeFileCoder``'s *file listing*) or ``diff`` (one SEARCH/REPLACE block per hunk, ``EditBlockCoder``,
  written against the file as the chat shows it);
- a request to add the files (Aider adds the paths a reply names, then asks again) when some are missing;
- ``DONE`` otherwise (the edit already applied, or no known task): Aider then ends.

With ``decoy_first`` (multi-turn trajectories, Aider's test-feedback loop on), a request with the files at their
start and no test output in the chat (no user message with a line starting ``FEEDBACK``) is answered with the
*decoy* instead (``decoy``: a comment line above the first line the fix changes, an edit that applies and fixes
nothing); Aider applies it, runs the tests and sends their output back, and that request gets the fix, written
against the file that now holds the decoy.
"""

from __future__ import annotations

import difflib
import io
import tokenize
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any

from aitlrt.rollout.agents.edit_format import DIVIDER, REPLACE, SEARCH, is_marker
from aitlrt.tasks.feedback import HEADER as FEEDBACK

FENCES: tuple[tuple[str, str], ...] = (
    ("```", "```"),
    ("````", "````"),
    ("<source>", "</source>"),
    ("<code>", "</code>"),
    ("<pre>", "</pre>"),
    ("<codeblock>", "</codeblock>"),
    ("<sourcecode>", "</sourcecode>"),
)
"""Aider's fences, in its order of preference (``aider.coders.base_coder.all_fences``)."""
_CLOSE = dict(FENCES)
EDIT_FORMATS = ("whole", "diff")
DONE = "Done."
"""The answer when there is nothing (more) to edit."""
_LANGUAGES = {".py": "python", ".pyi": "python", ".js": "javascript", ".ts": "typescript", ".rs": "rust"}
DECOY_COMMENT = "# FIXME: the reported bug may come from here"
"""The decoy's line, indented like the line below it."""


@dataclass(frozen=True)
class OracleFile:
    path: str
    before: str
    """At the task's starting commit ("" for a file the fix creates)."""
    after: str
    """With the oracle fix applied ("" for a file it deletes)."""


@dataclass(frozen=True)
class OracleTask:
    instance_id: str
    problem_statement: str
    files: tuple[OracleFile, ...]
    """The files the oracle fix changes."""


def _lines(text: str) -> list[str]:
    """``text`` compared line-wise: CRLF and trailing whitespace ignored, trailing blank lines dropped."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def listing_fence(lines: Sequence[str], path: str, content: str) -> tuple[str, str] | None:
    """The fence of a listing of ``path`` holding ``content`` in a message's ``lines`` (``_lines``), or None."""
    want = _lines(content)
    for i in range(len(lines) - 1):
        close = _CLOSE.get(lines[i + 1].strip())
        if close is None or lines[i].strip() != path:
            continue
        start, end = i + 2, i + 2 + len(want)
        if lines[start:end] == want:
            rest = end
            while rest < len(lines) and not lines[rest]:
                rest += 1
            if rest < len(lines) and lines[rest] == close:
                return (lines[i + 1].strip(), close)
        elif (
            want and lines[start : end - 1] == want[:-1] and end - 1 < len(lines) and lines[end - 1] == want[-1] + close
        ):
            return (lines[i + 1].strip(), close)  # a file without a final newline: the fence closes its last line
    return None


def listed(text: str, path: str, like: str) -> tuple[tuple[str, str], str] | None:
    """The fence and the content, as shown, of the listing of ``path`` in a message's ``text``, or None: the lines
    after the path and an opening fence up to the closing fence, alone on a line or closing a last line without a
    newline; where both readings are possible (a line of the file ends with the fence), the one nearer ``like``."""
    raw = text.replace("\r\n", "\n").split("\n")
    for i in range(len(raw) - 1):
        close = _CLOSE.get(raw[i + 1].strip())
        if close is None or raw[i].strip() != path:
            continue
        readings = []  # (glued, content)
        for j in range(i + 2, len(raw)):
            if raw[j].rstrip() == close:
                readings.append((False, "".join(f"{line}\n" for line in raw[i + 2 : j])))
                break
            if raw[j].rstrip().endswith(close):
                body = "".join(f"{line}\n" for line in raw[i + 2 : j])
                readings.append((True, body + raw[j][: raw[j].rindex(close)]))
        if readings:
            want = _lines(like)
            _, content = min(readings, key=lambda r: (distance(want, _lines(r[1])), r[0]))
            return (raw[i + 1].strip(), close), content
    return None


def distance(before: Sequence[str], shown: Sequence[str]) -> int:
    """How many lines apart two files' ``_lines`` are: the longer of their parts between the lines they start and
    end with alike (a line inserted: 1)."""
    n = min(len(before), len(shown))
    start = 0
    while start < n and before[start] == shown[start]:
        start += 1
    end = 0
    while end < n - start and before[-1 - end] == shown[-1 - end]:
        end += 1
    return max(len(before), len(shown)) - start - end


def _near(before: Sequence[str], shown: Sequence[str]) -> bool:
    """Whether ``shown`` can be ``before`` edited: at most half its lines (or 3) apart."""
    return distance(before, shown) <= max(3, len(before) // 2)


def message_text(message: Mapping[str, Any]) -> str:
    """A chat message's text: its content, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


@dataclass(frozen=True)
class Match:
    task: OracleTask
    fence: tuple[str, str]
    at_start: tuple[str, ...]
    """Changed files shown as they are at the task's start."""
    done: tuple[str, ...]
    """Changed files shown with the fix applied."""
    edited: tuple[tuple[str, str], ...] = ()
    """Changed files shown in another state near their start: (path, content as shown)."""
    distance: int = 0
    """Lines by which the ``edited`` files are apart from their start, in all."""


def _match_in(text: str, tasks: Iterable[OracleTask]) -> list[Match]:
    lines = _lines(text)
    found = []
    for task in tasks:
        fence: tuple[str, str] | None = None
        at_start, done, edited, apart = [], [], [], 0
        for f in task.files:
            if f.before and (seen := listing_fence(lines, f.path, f.before)):
                at_start.append(f.path)
                fence = fence or seen
            elif f.after and (seen := listing_fence(lines, f.path, f.after)):
                done.append(f.path)
                fence = fence or seen
            elif f.before and (shown := listed(text, f.path, f.before)) and _near(_lines(f.before), _lines(shown[1])):
                edited.append((f.path, shown[1]))
                apart += distance(_lines(f.before), _lines(shown[1]))
                fence = fence or shown[0]
        if fence is not None:
            found.append(Match(task, fence, tuple(at_start), tuple(done), tuple(edited), apart))
    return found


def identify(tasks: Sequence[OracleTask], messages: Sequence[Mapping[str, Any]]) -> Match | None:
    """The task a conversation is about: the one whose changed files the last user message showing any task's
    files shows most of at their start, then most of in another known state (fixed, or edited: the nearest first;
    ties: the one whose problem statement the user wrote, then the first), else the first task whose problem
    statement a user message holds (no file shown, ``fence`` ```)."""
    user = [message_text(m) for m in messages if m.get("role") == "user"]
    everything = "\n".join(user)
    for text in reversed(user):
        if found := _match_in(text, tasks):
            # max() keeps the first of equals
            return max(
                found,
                key=lambda m: (
                    len(m.at_start),
                    len(m.done) + len(m.edited),
                    -m.distance,
                    m.task.problem_statement.strip() in everything,
                ),
            )
    for task in tasks:
        if task.problem_statement.strip() and task.problem_statement.strip() in everything:
            return Match(task, FENCES[0], (), ())
    return None


def _needed(task: OracleTask) -> list[str]:
    """The changed files that exist at the start: the agent must have them in the chat to edit them."""
    return [f.path for f in task.files if f.before]


def feedback_turn(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a user message holds the output of the task's tests that Aider sent back (a line starting
    ``FEEDBACK``)."""
    return any(
        line.lstrip().startswith(FEEDBACK)
        for m in messages
        if m.get("role") == "user"
        for line in message_text(m).splitlines()
    )


def answer(
    tasks: Sequence[OracleTask], messages: Sequence[Mapping[str, Any]], edit_format: str, *, decoy_first: bool = False
) -> str:
    """The oracle's reply to one request of Aider (see the module docstring)."""
    match = identify(tasks, messages)
    if match is None:
        return DONE
    edited = dict(match.edited)
    missing = [path for path in _needed(match.task) if path not in (*match.at_start, *match.done, *edited)]
    if missing:
        return f"Please add {', '.join(missing)} to the chat."
    if decoy_first and not match.done and not edited and not feedback_turn(messages) and (first := decoy(match.task)):
        return render(first, edit_format, match.fence)
    todo = [
        replace(f, before=edited[f.path]) if f.path in edited else f
        for f in match.task.files
        if f.path in match.at_start or f.path in edited or not f.before
    ]
    if not todo or (match.done and not match.at_start and not edited):
        return DONE
    return render(todo, edit_format, match.fence)


def decoy(task: OracleTask) -> tuple[OracleFile, ...]:
    """The oracle's first answer when it answers decoy first: the first Python file the fix changes with
    ``DECOY_COMMENT`` inserted above the first line the fix changes (or the nearest line below it where a comment
    line changes nothing: not in a string, not after a backslash), so the edit applies, the tests fail as before
    and the fix, written against the decoyed file, is still the oracle's. Empty when there is no such line."""
    for f in task.files:
        if f.before and PurePosixPath(f.path).suffix in (".py", ".pyi"):
            decoyed = _commented(f.before, f.after, f.path)
            if decoyed is not None:
                return (OracleFile(f.path, f.before, decoyed),)
    return ()


def _commented(before: str, after: str, path: str) -> str | None:
    """``before`` with ``DECOY_COMMENT`` on its own line where ``decoy`` puts it, or None."""
    lines = io.StringIO(before).readlines()  # the lines tokenize numbers
    safe = _comment_rows(before)
    changes = difflib.SequenceMatcher(None, lines, io.StringIO(after).readlines(), autojunk=False).get_opcodes()
    for tag, a1, a2, _, _ in changes:
        if tag == "equal":
            continue
        for row in range(a1, max(a2, a1 + 1)):
            if row not in safe or (row == len(lines) and not lines[-1].endswith("\n")):
                continue
            below = next((line for line in lines[row:] if line.strip()), "")
            comment = below[: len(below) - len(below.lstrip())] + DECOY_COMMENT + "\n"
            decoyed = "".join([*lines[:row], comment, *lines[row:]])
            try:  # both the decoy and the fix from it must be writable
                search_replace(before, decoyed, path)
                search_replace(decoyed, after, path)
            except ValueError:
                continue
            return decoyed
    return None


def _comment_rows(source: str) -> set[int]:
    """The indices of the lines of Python ``source`` above which a comment line can go without changing the code:
    the first line and each line after a line that ends outside a string and without a backslash (every line
    tokenize ends with a NEWLINE or NL token). Empty when ``source`` does not tokenize."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return set()
    return {0} | {tok.end[0] for tok in tokens if tok.type in (tokenize.NEWLINE, tokenize.NL)}


def render(files: Sequence[OracleFile], edit_format: str, fence: tuple[str, str] = FENCES[0]) -> str:
    """The edit that turns every file's ``before`` into its ``after``, in Aider's ``whole`` or ``diff`` format.
    Files the fix deletes cannot be written in either format: ValueError."""
    if edit_format not in EDIT_FORMATS:
        raise ValueError(f"the oracle writes the edit formats {EDIT_FORMATS}, not {edit_format!r}")
    deleted = [f.path for f in files if f.before and not f.after]
    if deleted:
        raise ValueError(f"the fix deletes {', '.join(deleted)}: Aider's {edit_format} format cannot say so")
    if edit_format == "whole":
        return "\n".join(whole_listing(f.path, f.after, fence) for f in files)
    blocks = [
        edit_block(f.path, search, replace, fence)
        for f in files
        for search, replace in search_replace(f.before, f.after, f.path, fence)
    ]
    return "\n".join(blocks)


def whole_listing(path: str, content: str, fence: tuple[str, str] = FENCES[0]) -> str:
    """A *file listing* of the ``whole`` format: the path alone on a line, then the file in full, fenced."""
    body = content if not content or content.endswith("\n") else content + "\n"
    return f"{path}\n{fence[0]}\n{body}{fence[1]}\n"


def edit_block(path: str, search: str, replace: str, fence: tuple[str, str] = FENCES[0]) -> str:
    """One SEARCH/REPLACE block of the ``diff`` format, as in Aider's own examples."""
    language = _LANGUAGES.get(PurePosixPath(path).suffix, "")
    return f"{path}\n{fence[0]}{language}\n{SEARCH}\n{search}{DIVIDER}\n{replace}{REPLACE}\n{fence[1]}\n"


def _occurrences(lines: Sequence[str], part: Sequence[str]) -> int:
    n = len(part)
    return sum(1 for i in range(len(lines) - n + 1) if lines[i] == part[0] and list(lines[i : i + n]) == list(part))


def _has_marker(part: Sequence[str]) -> bool:
    return any(is_marker(line) for line in part)


def _usable(part: Sequence[str], path: str, fence: tuple[str, str]) -> bool:
    """Whether Aider reads ``part`` back as written: no marker line, and nothing its ``strip_quoted_wrapping``
    removes (a last line that is empty, a first line ending with the file's name, or a fenced whole)."""
    if _has_marker(part) or (part and part[-1] == "\n"):
        return False
    if part and part[0].strip().endswith(PurePosixPath(path).name):
        return False
    return not (part and part[0].startswith(fence[0]) and part[-1].startswith(fence[1]))


def search_replace(before: str, after: str, path: str, fence: tuple[str, str] = FENCES[0]) -> list[tuple[str, str]]:
    """(search, replace) per hunk of the change from ``before`` to ``after``, in file order.

    Aider applies the blocks one after the other, each to the first exact match of its search lines in the file
    as the blocks before it left it; so each search is the hunk's old lines plus the fewest context lines (above
    first on a tie) that make it unique in that state and non-blank (a blank search appends). ValueError when no
    context makes a hunk writable (a line that reads as a SEARCH/REPLACE marker)."""
    a = [line if line.endswith("\n") else line + "\n" for line in before.splitlines(keepends=True)]
    b = [line if line.endswith("\n") else line + "\n" for line in after.splitlines(keepends=True)]
    if not a:
        return [("", "".join(b))]  # a new file: an empty search creates it
    out: list[tuple[str, str]] = []
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    for group in matcher.get_grouped_opcodes(3):
        changes = [op for op in group if op[0] != "equal"]
        a1, a2, b1, b2 = changes[0][1], changes[-1][2], changes[0][3], changes[-1][4]
        if _has_marker(a[a1:a2] + b[b1:b2]):
            raise ValueError(f"{path}: the hunk at line {a1 + 1} has a line that reads as a SEARCH/REPLACE marker")
        state = b[:b1] + a[a1:]  # the file once the blocks before this one are applied
        old = a2 - a1
        for total in range(len(state) + 1):
            picked = None
            for up in range(min(total, b1), -1, -1):
                down = total - up
                if down > len(a) - a2:
                    continue
                search = state[b1 - up : b1 + old + down]
                replace = b[b1 - up : b2] + a[a2 : a2 + down]
                if (
                    "".join(search).strip()
                    and _usable(search, path, fence)
                    and _usable(replace, path, fence)
                    and _occurrences(state, search) == 1
                ):
                    picked = ("".join(search), "".join(replace))
                    break
            if picked:
                out.append(picked)
                break
        else:
            raise ValueError(f"{path}: the hunk at line {a1 + 1} cannot be written as a SEARCH/REPLACE block")
    return out

"""Unified diffs as text: split per file, normalise, reverse, and compare (SWE-RL's similarity, and the similarity
and base lines of the effective changed lines)."""

from __future__ import annotations

import difflib
import io
import re
import tokenize
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

_HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@")
_GIT_HEADER = re.compile(r"^diff --git a/(.*) b/(.*)$")


def _path(line: str) -> str:
    """The path of a ``---``/``+++`` line, without the ``a/``/``b/`` prefix or a trailing timestamp."""
    name = line[4:].split("\t", 1)[0].strip()
    return name.split("/", 1)[1] if name[:2] in ("a/", "b/") else name


def _match(pattern: re.Pattern[str], line: str) -> re.Match[str]:
    """``pattern``'s match of ``line``, a line ``_roles`` classified by that pattern."""
    if found := pattern.match(line):
        return found
    raise ValueError(f"not a {pattern.pattern!r} line: {line!r}")


def _count(span: str) -> int:
    return int(span.split(",")[1]) if "," in span else 1


def _roles(patch: str) -> Iterator[tuple[str, str]]:
    """Each line of a unified diff with its role: ``git`` (``diff --git``), ``old``/``new`` (file headers),
    ``hunk`` (``@@``), ``body`` (inside a hunk, counted, so a removed ``-- x`` is never taken for a header)
    or ``meta`` (anything else: index, mode, binary lines, text between files)."""
    lines = patch.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if hunk := _HUNK.match(line):
            yield "hunk", line
            old, new = _count(hunk.group(1)), _count(hunk.group(2))
            i += 1
            while i < len(lines) and (old > 0 or new > 0 or lines[i].startswith("\\")):
                tag = lines[i][:1]
                old -= tag in (" ", "", "-")
                new -= tag in (" ", "", "+")
                yield "body", lines[i]
                i += 1
            continue
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            yield "old", line
            yield "new", lines[i + 1]
            i += 2
            continue
        yield ("git" if _GIT_HEADER.match(line) else "meta"), line
        i += 1


def split_files(patch: str) -> dict[str, list[str]]:
    """The lines of ``patch`` grouped by the file they change (new path; old path for deletions)."""
    files: dict[str, list[str]] = {}
    current: list[str] = []
    in_git = False
    old = ""
    for role, line in _roles(patch):
        if role == "git":
            current, in_git = [], True
            files[_match(_GIT_HEADER, line).group(2)] = current
        elif role == "old":
            if not in_git:
                current = []
            old = _path(line)
        elif role == "new" and not in_git:
            new = _path(line)
            files[old if new == "/dev/null" else new] = current
        elif role == "hunk":
            in_git = False
        current.append(line)
    return files


def normalise(lines: list[str]) -> str:
    """One file's change as SWE-RL compares it: the hunks only (``@@ -a,b +c,d @@`` without git's function
    context), trailing whitespace and CRLF stripped, file headers and ``\\ No newline`` markers dropped."""
    out = []
    for role, line in _roles("\n".join(lines)):
        if role == "hunk":
            hunk = _match(_HUNK, line)
            out.append(f"@@ -{hunk.group(1)} +{hunk.group(2)} @@")
        elif role == "body" and not line.startswith("\\"):
            out.append(line.rstrip())
        elif role == "meta" and line.startswith(("GIT binary patch", "Binary files")):
            out.append(line)
    return "\n".join(out)


def normalised_files(patch: str) -> dict[str, str]:
    """``{path: normalised change}`` for every file the patch really changes."""
    changes = {path: normalise(lines) for path, lines in split_files(patch).items()}
    return {path: change for path, change in changes.items() if change}


def similarity(predicted: str, oracle: str) -> float:
    """SWE-RL's patch similarity in [0, 1]: per file in the union of both patches,
    ``SequenceMatcher(autojunk=False).ratio()`` of the normalised changes (0 when one side lacks the file),
    averaged over the files; 1.0 when both patches are empty."""
    pred, gold = normalised_files(predicted), normalised_files(oracle)
    return _mean_ratio(pred, gold) if pred or gold else 1.0


def _mean_ratio(pred: dict[str, str], gold: dict[str, str]) -> float:
    """Per file in the union, ``SequenceMatcher(autojunk=False).ratio()`` of the two texts (0 when one side lacks
    the file), averaged over the files."""
    paths = pred.keys() | gold.keys()
    ratios = [
        difflib.SequenceMatcher(None, pred[p], gold[p], autojunk=False).ratio() if p in pred and p in gold else 0.0
        for p in paths
    ]
    return sum(ratios) / len(ratios)


PYTHON_SUFFIXES = (".py", ".pyi")
"""The files whose ``#`` comments ``changed_lines`` strips (in any other file a ``#`` line is text)."""


def _strip_comment(line: str) -> str:
    """``line`` (no indentation) without the comment Python's tokenizer finds in it, the line read alone: a ``#``
    after an unclosed quote stays (a string's), while a line inside a multi-line string is read as code."""
    if "#" not in line:
        return line
    try:
        for token in tokenize.generate_tokens(io.StringIO(line).readline):
            if token.type == tokenize.COMMENT:
                return line[: token.start[1]]
    except (tokenize.TokenError, SyntaxError):  # an open bracket or string: tokens before it were read
        pass
    return line


def _normal_line(line: str, python: bool) -> tuple[int, str]:
    """A changed line as ``changed_runs`` compares it: its indentation's width in a Python file (where it is code;
    0 elsewhere), and its text with the comment stripped (``python``) and whitespace collapsed."""
    text = line.strip()
    indent = len(line.expandtabs(8)) - len(line.expandtabs(8).lstrip()) if python and text else 0
    return indent, " ".join((_strip_comment(text) if python else text).split())


def code_lines(text: str) -> list[str]:
    """Python ``text`` line by line as ``changed_lines`` reads it, indentation aside: comments stripped, whitespace
    collapsed, blank lines dropped (two texts with equal code lines differ by a comment or whitespace only)."""
    return [code for code in (_normal_line(line, True)[1] for line in text.splitlines()) if code]


@dataclass(frozen=True)
class ChangedRun:
    """A run of adjacent ``-``/``+`` lines of a hunk, reduced to its effective change: blank lines (after
    normalisation, ``_normal_line``) dropped, and the removed and added lines that normalise alike (their longest
    common subsequence) cancelled, so that a comment, whitespace or a line re-added as it was changes nothing (a
    Python line re-indented changes its block: it stays)."""

    start: int
    """The base line number of the run's first removed line, or, for a run that removes none, of the line the
    added lines go before."""
    size: int
    """The number of base lines the run removes, cancelled ones included."""
    removed: tuple[tuple[int, str], ...]
    """The effective removed lines: (base line number, normalised text)."""
    added: tuple[str, ...]
    """The effective added lines, normalised."""

    def base_lines(self) -> set[int]:
        """The base lines the effective change touches: its removed lines; for a pure insertion (added lines only)
        the run's whole base span with the line above and the line below it (an insertion between lines 4 and 5
        touches both)."""
        if self.removed:
            return {number for number, _ in self.removed}
        if not self.added:
            return set()
        return {n for n in range(self.start - 1, self.start + self.size + 1) if n >= 1}

    def text(self) -> list[str]:
        return [f"-{line}" for _, line in self.removed] + [f"+{line}" for line in self.added]


def _effective_run(start: int, removed: list[str], added: list[str], python: bool) -> ChangedRun:
    old = [(start + i, _normal_line(line, python)) for i, line in enumerate(removed)]
    old = [(n, line) for n, line in old if line[1]]
    new = [line for line in (_normal_line(line, python) for line in added) if line[1]]
    matcher = difflib.SequenceMatcher(None, [line for _, line in old], new, autojunk=False)
    kept_old, kept_new = set(range(len(old))), set(range(len(new)))
    for block in matcher.get_matching_blocks():
        kept_old -= set(range(block.a, block.a + block.size))
        kept_new -= set(range(block.b, block.b + block.size))
    return ChangedRun(
        start,
        len(removed),
        tuple((old[i][0], old[i][1][1]) for i in sorted(kept_old)),
        tuple(new[i][1] for i in sorted(kept_new)),
    )


def _file_runs(lines: list[str], python: bool) -> list[ChangedRun]:
    """The runs of changed lines of one file's part of a patch (``split_files``), reduced (``ChangedRun``)."""
    runs: list[ChangedRun] = []
    removed: list[str] = []
    added: list[str] = []
    line = start = 0
    for role, text in [*_roles("\n".join(lines)), ("end", "")]:
        changed = role == "body" and text[:1] in ("-", "+")
        if (removed or added) and not changed and not text.startswith("\\"):
            runs.append(_effective_run(start, removed, added, python))
            removed, added = [], []
        if role == "hunk":
            old = _match(_HUNK, text).group(1)
            line = int(old.split(",")[0]) + (_count(old) == 0)  # an empty old range names the line above
        elif changed:
            start = start if removed or added else line
            (removed if text[0] == "-" else added).append(text[1:])
            line += text[0] == "-"
        elif role == "body" and not text.startswith("\\"):
            line += 1
    return [run for run in runs if run.removed or run.added]


def changed_runs(patch: str) -> dict[str, list[ChangedRun]]:
    """``{path: its runs of changed lines, reduced to their effective change}`` for every file whose change is
    effective (``ChangedRun``); ``#`` comments are stripped in Python files (``PYTHON_SUFFIXES``) only."""
    runs = {path: _file_runs(lines, path.endswith(PYTHON_SUFFIXES)) for path, lines in split_files(patch).items()}
    return {path: effective for path, effective in runs.items() if effective}


def changed_lines(patch: str) -> dict[str, str]:
    """``{path: its effective changed lines}``: per run the removed lines (``-``) then the added ones (``+``),
    normalised, without context, headers or line numbers (``changed_runs``)."""
    return {path: "\n".join(line for run in runs for line in run.text()) for path, runs in changed_runs(patch).items()}


def changed_lines_similarity(predicted: str, oracle: str) -> float:
    """SWE-RL's similarity over the effective changed lines only (``changed_lines``): per file in the union of both
    patches the ``SequenceMatcher`` ratio of the two texts (0 when one side lacks the file), averaged over the files.
    0 when ``predicted`` changes nothing effective (no edit, a comment, whitespace), 1 for the exact fix. Unlike
    ``similarity``, context lines and line numbers weigh nothing: a comment on the buggy line shares a hunk's context
    with the fix, and ``similarity`` pays it most of the way."""
    pred = changed_lines(predicted)
    return _mean_ratio(pred, changed_lines(oracle)) if pred else 0.0


def changed_lines_overlap(predicted: str, oracle: str) -> float:
    """How many of the oracle's effective changed lines ``predicted`` has, line for line (``changed_lines``): per file
    in the union of both patches the Dice coefficient of the two multisets of ``-``/``+`` lines, 2|P ∩ O| / (|P| +
    |O|) (0 when one side lacks the file), averaged over the files. 0 when ``predicted`` changes nothing effective;
    1 for the exact fix; a line is paid only whole, so a line that shares characters with the fix's (a ``pass``, a
    copy of a line near the bug) earns nothing, while ``changed_lines_similarity`` pays it a little. A wrong change
    of the buggy line earns its removed line's share (1/2 on a one-line fix)."""
    pred, gold = changed_runs(predicted), changed_runs(oracle)
    if not pred:
        return 0.0
    scores = []
    for path in pred.keys() | gold.keys():
        mine, theirs = (Counter(line for run in runs.get(path, []) for line in run.text()) for runs in (pred, gold))
        total = mine.total() + theirs.total()
        scores.append(2 * (mine & theirs).total() / total if mine and theirs else 0.0)
    return sum(scores) / len(scores)


def changed_base_lines(patch: str) -> dict[str, set[int]]:
    """``{path: the base line numbers its effective changes touch}`` (``ChangedRun.base_lines``): what localisation
    compares."""
    return {path: set().union(*(run.base_lines() for run in runs)) for path, runs in changed_runs(patch).items()}


def shares_changed_line(predicted: str, oracle: str) -> float:
    """1.0 when ``predicted``'s effective changes touch a base line that ``oracle``'s touch, in the same file
    (``changed_base_lines``): the patch is localised; else 0.0."""
    pred, gold = changed_base_lines(predicted), changed_base_lines(oracle)
    return float(any(pred[path] & gold[path] for path in pred.keys() & gold.keys()))


def changed_paths(patch: str) -> list[str]:
    """The files a patch touches, in order."""
    return list(split_files(patch))


def created_paths(patch: str) -> set[str]:
    """The files ``patch`` creates: those whose old side is ``/dev/null`` (a ``.rej`` that ``patch`` left, a new
    module)."""
    created, old = set(), ""
    for role, line in _roles(patch):
        if role == "old":
            old = _path(line)
        elif role == "new" and old == "/dev/null":
            created.add(_path(line))
    return created


def reverse(patch: str) -> str:
    """The inverse of a text unified diff (what ``git apply -R`` applies), as git would write it: old and new
    sides swapped, and in each run of changed lines the removals before the additions."""
    out: list[str] = []
    removed: list[str] = []
    added: list[str] = []
    last = removed
    old = ""

    def flush() -> None:
        out.extend(removed + added)
        removed.clear()
        added.clear()

    for role, line in _roles(patch):
        if role == "body" and line[:1] in ("+", "-"):
            last = removed if line[0] == "+" else added
            last.append({"+": "-", "-": "+"}[line[0]] + line[1:])
            continue
        if role == "body" and line.startswith("\\") and (removed or added):
            last.append(line)  # "\ No newline" belongs to the line before it
            continue
        flush()
        if role == "git":
            a, b = _match(_GIT_HEADER, line).groups()
            out.append(f"diff --git a/{b} b/{a}")
        elif role == "old":
            old = line[4:]
        elif role == "new":
            out += ["--- " + _swap_prefix(line[4:], "b/", "a/"), "+++ " + _swap_prefix(old, "a/", "b/")]
        elif role == "hunk":
            hunk = _match(_HUNK, line)
            out.append(f"@@ -{hunk.group(2)} +{hunk.group(1)} @@{line[hunk.end() :]}")
        elif role == "meta" and line.startswith("index ") and ".." in line:
            ids, _, mode = line[6:].partition(" ")
            a, b = ids.split("..", 1)
            out.append(f"index {b}..{a}" + (f" {mode}" if mode else ""))
        elif role == "meta" and line.startswith(("new file mode", "deleted file mode")):
            out.append(("deleted" if line.startswith("new") else "new") + " file mode " + line.rsplit(" ", 1)[1])
        elif role == "meta" and line.startswith(("old mode", "new mode")):
            out.append(("new" if line.startswith("old") else "old") + line[3:])
        else:
            out.append(line)
    flush()
    return "\n".join(out) + ("\n" if patch.endswith("\n") else "")


def _swap_prefix(path: str, old: str, new: str) -> str:
    return new + path[len(old) :] if path.startswith(old) else path


def unsafe_paths(patch: str) -> list[str]:
    """The paths of ``patch``'s file headers that leave the repository or enter a ``.git`` folder (absolute, with
    a ``..`` or ``.git`` component), and any file it makes a symbolic link (mode 120000): ``patch`` writes
    through neither safely."""
    unsafe = []
    for role, line in _roles(patch):
        if role == "git" and (found := _GIT_HEADER.match(line)):
            names = [found.group(1), found.group(2)]
        elif role in ("old", "new"):
            names = [_path(line)]
        elif role == "meta" and line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            names = [line.split(" ", 2)[2]]
        elif role == "meta" and line.endswith(" 120000") and line.startswith(("new file mode", "new mode")):
            unsafe.append(f"a symbolic link ({line})")
            continue
        else:
            continue
        for name in names:
            parts = name.strip('"').split("/")
            if name != "/dev/null" and (name.startswith("/") or ".." in parts or ".git" in parts):
                unsafe.append(name)
    return list(dict.fromkeys(unsafe))

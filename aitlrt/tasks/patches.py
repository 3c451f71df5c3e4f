"""Unified diffs as text: split per file, normalise, reverse, and compare (SWE-RL's similarity)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator

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
    paths = pred.keys() | gold.keys()
    if not paths:
        return 1.0
    ratios = [
        difflib.SequenceMatcher(None, pred[p], gold[p], autojunk=False).ratio() if p in pred and p in gold else 0.0
        for p in paths
    ]
    return sum(ratios) / len(ratios)


def changed_paths(patch: str) -> list[str]:
    """The files a patch touches, in order."""
    return list(split_files(patch))


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

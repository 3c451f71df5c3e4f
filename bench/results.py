"""The benches' history: one JSON row per bench run in ``bench/results.jsonl``, and ``docs/results.md`` from it.

A bench's ``__main__`` runs its ``main`` through ``recorded(NAME, main)``: the run's stdout is still printed as it
comes and also kept, and when ``main`` returns, a row is appended with the bench's name, the date, the git commit,
the machine (CPU model, cores, GPU), the arguments, the ``TARGET`` lines parsed (name, value, goal, PASS/MISS), what
the run was where the bench says so (``RUN key=value ...`` lines: ``bench/learning.py`` names its recipe's config and
agent; the row's ``run``) and the summary the bench printed just before the TARGET lines (its table). A run that
prints no ``TARGET`` line (``--help``, ``bench/learning.py --validate``: a comparison, read in the notebook) or that
raises appends nothing.

``python bench/results.py`` regenerates ``docs/results.md`` (a table of every bench's runs, newest first, and the
latest run's summary); ``--check`` exits 1 when the page is not what the file gives (a unit test runs it). Rows
with ``"source": "notebook"`` were reconstructed from the notebook's readings before the benches wrote rows.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.jsonl"
PAGE = ROOT / "docs" / "results.md"
SUMMARY_LINES = 40  # a bench's table before its TARGET lines: learning.py prints ~25 lines, proxy.py ~15
ORDER = ("proxy", "rollouts", "rewards", "train_step", "step", "learning")  # the page's order: bottom layer first
T = TypeVar("T")


class _Tee(io.TextIOBase):
    """Writes through to the real stdout and keeps a copy (a bench's output is long: learning.py runs ~50 min)."""

    def __init__(self, out: Any) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def parse_target(line: str) -> dict[str, Any]:
    """``TARGET name value goal PASS|MISS`` → its fields; the value as a number where it reads as one."""
    name, value, *goal, verdict = line.split()[1:]
    try:
        number: float | str = float(value)
    except ValueError:
        number = value
    return {"name": name, "value": number, "goal": " ".join(goal), "verdict": verdict}


def parse_run(output: str) -> dict[str, str]:
    """The ``RUN key=value ...`` lines of a bench's output as one mapping (a later key wins): what the run was, e.g.
    ``bench/learning.py``'s ``RUN config=configs/cpu_demo_miniswe.yaml agent=mini-swe-agent``."""
    run: dict[str, str] = {}
    for line in output.splitlines():
        if line.startswith("RUN "):
            run.update(word.partition("=")[::2] for word in line.split()[1:] if "=" in word)
    return run


def summarise(output: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The TARGET lines of a bench's output and up to ``SUMMARY_LINES`` lines of what it printed before them."""
    lines = output.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("TARGET ")), len(lines))
    targets = [parse_target(line) for line in lines if line.startswith("TARGET ") and len(line.split()) >= 4]
    before = [line.rstrip() for line in lines[:first] if not line.startswith(("[bench]", "RUN "))]
    while before and not before[0].strip():
        before.pop(0)
    while before and not before[-1].strip():
        before.pop()
    return targets, before[-SUMMARY_LINES:]


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def machine() -> dict[str, Any]:
    """The CPU model and cores (bench numbers on 2 cores are not those of 16) and the GPU, if any."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    gpu = None
    if shutil.which("nvidia-smi"):
        query = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
        )
        gpu = ", ".join(query.stdout.split("\n")).strip(", ") or None
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "gpu": gpu}


def row(bench: str, output: str, args: list[str]) -> dict[str, Any] | None:
    """The results row of one run, or None when it printed no TARGET line."""
    targets, summary = summarise(output)
    if not targets:
        return None
    now = dt.datetime.now(dt.UTC)
    run = parse_run(output)
    return {
        "bench": bench,
        "date": now.date().isoformat(),
        "time": now.isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(),
        "args": args,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("AITLRT_BENCH_")},
        "targets": targets,
        "summary": summary,
        "source": "run",
        **({"run": run} if run else {}),
    }


def append(entry: dict[str, Any], path: Path = RESULTS) -> None:
    with path.open("a") as f:
        f.write(json.dumps(entry, ensure_ascii=False) + "\n")


def recorded(bench: str, main: Callable[[], T], path: Path = RESULTS) -> T:
    """Run a bench's ``main`` with its output kept; append its row to ``path`` when it returns."""
    tee = _Tee(sys.stdout)
    real, sys.stdout = sys.stdout, tee
    try:
        result = main()
    finally:
        sys.stdout = real
    entry = row(bench, tee.kept.getvalue(), sys.argv[1:])
    if entry is not None:
        append(entry, path)
        print(f"[bench] results: one row appended to {path} (python bench/results.py regenerates {PAGE.name})")
    return result


def load(path: Path = RESULTS) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cell(target: dict[str, Any] | None) -> str:
    if target is None:
        return ""
    value = target["value"]
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{shown} {target['verdict']}"


def render(rows: list[dict[str, Any]]) -> str:
    """docs/results.md: per bench, every run newest first with its TARGET values, then the latest summary."""
    out = [
        "# Bench results",
        "",
        "Generated by `python bench/results.py` from `bench/results.jsonl` (one row per bench run, appended by the",
        "bench itself); do not edit by hand. How to run each bench and what its targets mean:",
        "[benchmarks](benchmarks.md). Rows marked *notebook* were reconstructed from the notebook's readings",
        "([DIARY](../DIARY.md)) before the benches appended rows; `*` after a commit: uncommitted changes.",
        "",
    ]
    benches = sorted({r["bench"] for r in rows}, key=lambda b: (ORDER.index(b) if b in ORDER else len(ORDER), b))
    for bench in benches:
        runs = sorted((r for r in rows if r["bench"] == bench), key=lambda r: r["time"], reverse=True)
        names = list(dict.fromkeys(t["name"] for r in runs for t in r["targets"]))
        out += [f"## {bench}", "", f"`python bench/{bench}.py` — {len(runs)} run(s).", ""]
        out.append("| date | commit | machine | source | " + " | ".join(names) + " |")
        out.append("|---" * (4 + len(names)) + "|")
        for r in runs:
            by_name = {t["name"]: t for t in r["targets"]}
            m = r["machine"]
            where = f"{m['cpu']}, {m['cores']} cores" + (f", {m['gpu']}" if m.get("gpu") else "")
            commit = r["commit"] + ("*" if r.get("dirty") else "")
            source = r["source"]
            if r.get("run"):  # what the run was: bench/learning.py's recipe and agent
                source += " (" + ", ".join(f"{key} `{value}`" for key, value in r["run"].items()) + ")"
            if r.get("entry"):  # a path from the repository's root; this page is in docs/
                link = r["entry"].removeprefix("docs/") if r["entry"].startswith("docs/") else "../" + r["entry"]
                source += f" ([entry]({link}))"
            source += f": {r['note']}" if r.get("note") else ""
            cells = [r["date"], f"`{commit}`", where, source] + [_cell(by_name.get(n)) for n in names]
            out.append("| " + " | ".join(cells) + " |")
        if runs[0]["summary"]:
            out += ["", f"Latest run ({runs[0]['date']}), as printed:", "", "```", *runs[0]["summary"], "```"]
        out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when docs/results.md is not up to date")
    args = parser.parse_args()
    page = render(load())
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE} is not up to date: run python bench/results.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A static HTML report of rollouts that a person can open: per step the reward curves, per rollout the
conversation, the patch and the rewards. ``aitlrt report RUN_DIR`` writes ``RUN_DIR/report.html`` from a training
run's ``rollouts/step_XXXX.jsonl``; ``aitlrt eval`` writes one for its rollouts."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from html import escape
from pathlib import Path
from typing import Any

STYLE = """body{font:14px system-ui,sans-serif;margin:2em;max-width:1100px}pre{background:#f6f8fa;padding:.6em;
overflow-x:auto;white-space:pre-wrap}details{border:1px solid #ddd;margin:.4em 0;padding:.3em .6em}
summary{cursor:pointer}table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:.2em .6em;text-align:right}
.role{font-weight:bold;margin-top:.6em}.ok{color:#1a7f37}.bad{color:#cf222e}"""


def read_run(run_dir: Path) -> list[dict[str, Any]]:
    """Every saved rollout of a training run, step by step."""
    records = []
    for path in sorted((run_dir / "rollouts").glob("step_*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return records


def _curve(points: dict[str, list[tuple[int, float]]]) -> str:
    """An inline SVG line chart of each series (x = step, y in [0, 1])."""
    if not any(len(p) > 1 for p in points.values()):
        return ""
    steps = [s for series in points.values() for s, _ in series]
    lo, hi = min(steps), max(steps) or 1
    colours = ["#0969da", "#1a7f37", "#cf222e", "#8250df", "#bf8700", "#57606a"]
    lines, legend = [], []
    for (name, series), colour in zip(sorted(points.items()), colours * 4, strict=False):
        xy = " ".join(
            f"{40 + 520 * (s - lo) / max(1, hi - lo):.1f},{190 - 170 * max(0.0, min(1.0, v)):.1f}" for s, v in series
        )
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{xy}"/>')
        legend.append(f'<span style="color:{colour}">■ {escape(name)}</span>')
    axes = (
        '<line x1="40" y1="190" x2="560" y2="190" stroke="#999"/><line x1="40" y1="20" x2="40" y2="190" stroke="#999"/>'
    )
    labels = f'<text x="40" y="205">step {lo}</text><text x="520" y="205">step {hi}</text><text x="5" y="25">1.0</text>'
    return f'<svg width="580" height="210">{axes}{labels}{"".join(lines)}</svg><p>{" ".join(legend)}</p>'


def render(records: list[dict[str, Any]], title: str) -> str:
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[int(r.get("step", 0))].append(r)
    names = sorted({n for r in records for n in r.get("rewards", {})})
    points = {
        n: [(s, statistics.fmean(r["rewards"][n] for r in rs)) for s, rs in sorted(by_step.items())] for n in names
    }
    rows = "".join(
        f"<tr><td>{s}</td><td>{len(rs)}</td>"
        + "".join(f"<td>{statistics.fmean(r['rewards'].get(n, 0.0) for r in rs):.3f}</td>" for n in names)
        + f"<td>{statistics.fmean(r.get('calls', 0) for r in rs):.1f}</td></tr>"
        for s, rs in sorted(by_step.items())
    )
    table = (
        "<table><tr><th>step</th><th>rollouts</th>"
        + "".join(f"<th>{escape(n)}</th>" for n in names)
        + f"<th>calls</th></tr>{rows}</table>"
    )
    items = []
    for r in records:
        status = escape(str(r.get("status", "")))
        css = "ok" if r.get("status") == "ok" else "bad"
        scores = ", ".join(f"{escape(k)}={v:.3f}" for k, v in r.get("rewards", {}).items())
        turns = "".join(
            f'<div class="role">{escape(str(m.get("role", "?")))}</div><pre>{escape(_text(m))}</pre>'
            for m in r.get("conversation") or []
        )
        items.append(
            f"<details><summary>step {r.get('step', 0)} · {escape(r.get('rollout_id', ''))} · "
            f"{escape(r.get('instance_id', ''))} · <span class={css}>{status}</span> · {scores}"
            + (f" · advantage {r['advantage']:.3f}" if "advantage" in r else "")
            + f"</summary><p>{escape(r.get('reason', ''))}</p><h4>patch</h4><pre>{escape(r.get('patch') or '(empty)')}"
            f"</pre><h4>conversation</h4>{turns or '<p>(no recorded call)</p>'}</details>"
        )
    return (
        f"<!doctype html><meta charset=utf-8><title>{escape(title)}</title><style>{STYLE}</style>"
        f"<h1>{escape(title)}</h1>{_curve(points)}{table}<h2>rollouts</h2>{''.join(items)}"
    )


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else json.dumps(content, indent=1)


def write_report(records: list[dict[str, Any]], out: Path, title: str) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(records, title))
    return out

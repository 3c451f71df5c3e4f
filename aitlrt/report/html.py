"""The run report: one static, self-contained HTML page (inline SVG and CSS, no script, nothing fetched) that shows
within seconds whether training worked.

Top to bottom: the headline (reward, resolve and edit rate at the start and the end of the run, held-out
before → after); per-step curves from ``OUTPUT/metrics.jsonl`` (``aitlrt.report.metrics_log``), each with its own
y-scale: weighted reward, reward per function, edit/resolve rate, loss, informative groups (skipped updates
marked), logprob gap, seconds per step by stage; the held-out evaluation (``OUTPUT/heldout/rollouts.jsonl``,
``aitlrt.evaluation.checkpoints.write_results``) per checkpoint and per task; and every rollout, collapsed: status,
rewards, advantage, the agent's diff beside the oracle patch, the conversation.

``write_run_report(RUN_DIR)`` builds a training run's report; ``write_report`` any set of rollouts (``aitlrt eval``
passes its rollouts as ``heldout``). A part without data is left out or noted."""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em auto;max-width:1500px;padding:0 1em;color:#1f2328}
h1{font-size:1.4em;margin:.2em 0}h2{font-size:1.15em;border-bottom:1px solid #ddd;margin-top:1.4em}
.meta,.note{color:#57606a}.note{font-style:italic}
pre{background:#f6f8fa;padding:.5em;overflow-x:auto;white-space:pre-wrap;margin:.2em 0}
details{border:1px solid #ddd;margin:.3em 0;padding:.2em .6em}details details{border-color:#eee}
summary{cursor:pointer}table{border-collapse:collapse;margin:.4em 0}
td,th{border:1px solid #ddd;padding:.15em .55em;text-align:right}th{background:#f6f8fa}td.l,th.l{text-align:left}
.ok{color:#1a7f37}.bad{color:#cf222e}.up{color:#1a7f37}.down{color:#cf222e}.flat{color:#57606a}
.headline{display:flex;flex-wrap:wrap;gap:.5em 1.6em;padding:0;list-style:none;font-size:1.05em}
.charts{display:flex;flex-wrap:wrap;gap:.8em}figure{margin:0;border:1px solid #eee;padding:.3em .5em}
figcaption{font-weight:600}.chart text{font-size:11px;fill:#57606a}.chart .grid{stroke:#eee}
.chart .frame{stroke:#999}.chart .skipped{stroke:#cf222e;stroke-dasharray:3 3}
.legend{font-size:12px;max-width:460px}.legend span{margin-right:1em;white-space:nowrap}
.legend i{display:inline-block;width:.8em;height:.8em;margin-right:.3em;vertical-align:-1px}
.sbs{display:grid;grid-template-columns:1fr 1fr;gap:.6em}.sbs h4{margin:.3em 0}
.diff{font:12px ui-monospace,monospace;background:#f6f8fa;overflow-x:auto}.dl{white-space:pre-wrap;padding:0 .4em}
.dl.add{background:#dafbe1;color:#116329}.dl.del{background:#ffebe9;color:#82071e}
.dl.hunk{background:#ddf4ff;color:#0550ae}.dl.meta{color:#57606a;font-weight:600}
.role{font-weight:bold;margin-top:.5em}"""

CSP = "\"default-src 'none'; style-src 'unsafe-inline'\""
"""The page's content security policy: nothing is fetched and no script runs (a violation is a console error)."""
PALETTE = ["#0969da", "#1a7f37", "#cf222e", "#8250df", "#bf8700", "#57606a", "#e16f24", "#1b7c83"]

LABELS = {
    "reward": "weighted reward",
    "rollouts/non_empty_patch_rate": "edit rate",
    "rewards/tests_pass/mean": "resolve rate",
    "rollouts/ok": "ok rollouts",
    "sampling/groups": "groups",
    "sampling/informative_groups": "informative groups",
    "zero_variance_groups": "zero-variance groups",
    "logprob_gap/mean": "mean",
    "time/rollouts_s": "rollouts",
    "time/rewards_s": "rewards",
    "time/rows_s": "rows",
    "time/update_s": "update",
    "time/sync_s": "sync",
    "time/model_busy_s": "model busy",
    "time/agent_outside_calls_s": "agent outside calls (mean)",
}
STAGES = ("time/rollouts_s", "time/rewards_s", "time/rows_s", "time/update_s", "time/sync_s")
REWARD_MEAN = re.compile(r"^rewards/(.+)/mean$")
HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
W, H = 420, 200
X0, X1, Y0, Y1 = 64, W - 18, 10, H - 36
"""Chart size and its plot area (SVG units)."""
SMOOTH_ABOVE = 20
"""A series of more points is drawn faint, with its moving average (``_smooth``) over it."""
MAX_STEPS_LISTED = 12
"""The rollouts of at most this many steps are in the page (a long run's would make it too large to open)."""


# ---- reading ------------------------------------------------------------------------------------------------
def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def read_run(run_dir: Path) -> list[dict[str, Any]]:
    """Every saved rollout of a training run, step by step."""
    return [r for path in sorted((run_dir / "rollouts").glob("step_*.jsonl")) for r in _jsonl(path)]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The entries of a ``metrics.jsonl`` merged per step (a later entry's values win), by step; [] without the
    file. A line that is not JSON (a run killed mid-write) is skipped with a warning."""
    if not path.exists():
        return []
    merged: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d: not JSON, skipped", path, n)
            continue
        merged.setdefault(int(entry.get("step", 0)), {}).update(entry)
    return [merged[s] for s in sorted(merged)]


def read_heldout(run_dir: Path) -> list[dict[str, Any]]:
    """The held-out evaluation's rollouts of a training run (``heldout/rollouts.jsonl``), or []."""
    return _jsonl(run_dir / "heldout" / "rollouts.jsonl")


# ---- numbers ------------------------------------------------------------------------------------------------
def _num(v: Any) -> float | None:
    """``v`` as a finite float, else None (missing, NaN, not a number)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def _mean(values: Iterable[Any]) -> float | None:
    nums = [x for x in map(_num, values) if x is not None]
    return statistics.fmean(nums) if nums else None


def _fmt(v: float | None, digits: int = 3) -> str:
    return "&ndash;" if v is None else f"{v:.{digits}f}"


def _tick(v: float) -> str:
    """A short label: 3 significant digits, as ``-2.25e-4`` where plain digits would be long."""
    text = f"{v:.3g}"
    if "e" in text or len(text) > 6:
        mantissa, exponent = f"{v:.2e}".split("e")
        text = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return text


def _edited(record: dict[str, Any]) -> bool:
    return bool((record.get("patch") or "").strip())


def metrics_from_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-step metrics computed from saved rollouts (for a run without ``metrics.jsonl``): the mean of each reward,
    the edit rate and the share of ``ok`` rollouts."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_step[int(r.get("step", 0))].append(r)
    out = []
    for step, rs in sorted(by_step.items()):
        entry: dict[str, Any] = {"step": step}
        for name in sorted({n for r in rs for n in r.get("rewards", {})}):
            entry[f"rewards/{name}/mean"] = _mean(r.get("rewards", {}).get(name) for r in rs)
        entry["rollouts/non_empty_patch_rate"] = statistics.fmean(_edited(r) for r in rs)
        entry["rollouts/ok"] = statistics.fmean(r.get("status") == "ok" for r in rs)
        out.append(entry)
    return out


def _series(metrics: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every entry with a finite ``key``."""
    return [(int(m["step"]), v) for m in metrics if (v := _num(m.get(key))) is not None]


# ---- charts -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chart:
    title: str
    unit: str
    """The y axis' label."""
    keys: tuple[str, ...]
    rate: bool = False
    """A share or a reward in [0, 1]: the y axis spans at least [0, 1]."""
    zero: bool = True
    """The y axis includes 0."""
    stacked: bool = False
    """Stacked bars (the parts of a total) instead of lines."""
    labels: dict[str, str] = field(default_factory=dict)
    """Legend names in this chart, where not ``LABELS``."""


def _charts(metrics: Sequence[dict[str, Any]]) -> list[Chart]:
    """The charts that have data in ``metrics``."""
    keys = {k for m in metrics for k in m}
    per_function = tuple(sorted(k for k in keys if REWARD_MEAN.match(k)))
    charts = [
        Chart("weighted reward", "reward", ("reward",)),
        Chart("reward per function (mean)", "reward", per_function, rate=True,
              labels={k: k.split("/")[1] for k in per_function}),
        Chart("edit and resolve rate", "share of rollouts", (
            "rollouts/non_empty_patch_rate", "rewards/tests_pass/mean", "rollouts/ok"), rate=True),
        Chart("loss", "loss", ("loss",), zero=False),
        Chart("groups per step", "groups", ("sampling/groups", "sampling/informative_groups", "zero_variance_groups")),
        Chart("logprob gap |trainer - sampler|", "nats / token", ("logprob_gap/mean",)),
        Chart("seconds per step", "seconds", STAGES, stacked=True),
        Chart("rollout time", "seconds", ("time/rollouts_s", "time/model_busy_s", "time/agent_outside_calls_s")),
    ]  # fmt: skip
    return [c for c in charts if any(_series(metrics, k) for k in c.keys)]


def _label(key: str) -> str:
    if key in LABELS:
        return LABELS[key]
    match = REWARD_MEAN.match(key)
    return match.group(1) if match else key


def _ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """About ``count`` round intervals covering [lo, hi] (lo < hi), outermost ticks included."""
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def _domain(values: Sequence[float], chart: Chart) -> list[float]:
    """The y ticks (first and last: the axis' ends) for ``values``."""
    lo, hi = min(values), max(values)
    if chart.zero or chart.rate:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if chart.rate:
        hi = max(hi, 1.0)
    if hi - lo < 1e-12:
        lo, hi = (lo - abs(lo) * 0.1, hi + abs(hi) * 0.1) if lo else (0.0, 1.0)
    return _ticks(lo, hi)


def _smooth(series: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The centred moving average of ``series`` over about a twentieth of its points."""
    half = max(1, len(series) // 40)
    sums = list(itertools.accumulate((v for _, v in series), initial=0.0))
    out = []
    for i, (step, _) in enumerate(series):
        lo, hi = max(0, i - half), min(len(series), i + half + 1)
        out.append((step, (sums[hi] - sums[lo]) / (hi - lo)))
    return out


def _svg_chart(chart: Chart, metrics: Sequence[dict[str, Any]], marks: Sequence[int] = ()) -> str:
    """A figure: the chart as inline SVG (one ``polyline.series`` per metric, or stacked ``rect.bar``s), with axes,
    tick labels, ``marks`` (steps drawn as dashed red lines) and a legend with each metric's last value."""
    data = {k: found for k in chart.keys if (found := _series(metrics, k))}
    steps = sorted({s for series in data.values() for s, _ in series})
    if chart.stacked:
        totals: dict[int, float] = defaultdict(float)
        for series in data.values():
            for step, v in series:
                totals[step] += v
        yticks = _domain([*totals.values(), *(v for series in data.values() for _, v in series)], chart)
    else:
        yticks = _domain([v for series in data.values() for _, v in series], chart)
    ylo, yhi = yticks[0], yticks[-1]
    gap = min((b - a for a, b in itertools.pairwise(steps)), default=1)
    pad = gap / 2 if chart.stacked else 0
    xlo, xhi = steps[0] - pad, steps[-1] + pad
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1

    def x(step: float) -> float:
        return X0 + (X1 - X0) * (step - xlo) / (xhi - xlo)

    def y(value: float) -> float:
        return Y1 - (Y1 - Y0) * (value - ylo) / (yhi - ylo)

    parts = []
    for t in yticks:
        parts.append(f'<line class="grid" x1="{X0}" y1="{y(t):.1f}" x2="{X1}" y2="{y(t):.1f}"/>')
        parts.append(f'<text x="{X0 - 5}" y="{y(t) + 4:.1f}" text-anchor="end">{_tick(t)}</text>')
    for t in [t for t in _ticks(xlo, xhi, 5) if t == int(t) and xlo <= t <= xhi]:
        parts.append(f'<text x="{x(t):.1f}" y="{Y1 + 14}" text-anchor="middle">{int(t)}</text>')
    parts.append(f'<polyline class="frame" fill="none" points="{X0},{Y0} {X0},{Y1} {X1},{Y1}"/>')
    parts.append(f'<text class="axis" x="{(X0 + X1) / 2}" y="{H - 4}" text-anchor="middle">step</text>')
    parts.append(
        f'<text class="axis" transform="translate(11,{(Y0 + Y1) / 2}) rotate(-90)" text-anchor="middle">'
        f"{escape(chart.unit)}</text>"
    )
    for s in marks:
        parts.append(
            f'<line class="skipped" x1="{x(s):.1f}" y1="{Y0}" x2="{x(s):.1f}" y2="{Y1}">'
            f"<title>step {s}: update skipped (no group with reward variance)</title></line>"
        )
    colours = dict(zip(data, PALETTE * 4, strict=False))
    name = {k: chart.labels.get(k) or _label(k) for k in data}
    if chart.stacked:
        width = max(1.0, min(24.0, 0.8 * (x(steps[0] + gap) - x(steps[0]))))
        base: dict[int, float] = defaultdict(float)
        for key, series in data.items():
            for s, v in series:
                top, bottom = y(base[s] + v), y(base[s])
                base[s] += v
                parts.append(
                    f'<rect class="bar" data-series="{escape(key)}" x="{x(s) - width / 2:.1f}" y="{top:.1f}" '
                    f'width="{width:.1f}" height="{bottom - top:.1f}" fill="{colours[key]}">'
                    f"<title>step {s}: {escape(name[key])} {_tick(v)} {escape(chart.unit)}</title></rect>"
                )
    else:
        for key, series in data.items():
            noisy = len(series) > SMOOTH_ABOVE
            points = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in series)
            parts.append(
                f'<polyline class="series" data-series="{escape(key)}" fill="none" stroke="{colours[key]}" '
                f'stroke-width="{1 if noisy else 2}" stroke-opacity="{0.35 if noisy else 1}" points="{points}"/>'
            )
            if noisy:
                smooth = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in _smooth(series))
                parts.append(
                    f'<polyline class="smooth" data-series="{escape(key)}" fill="none" stroke="{colours[key]}" '
                    f'stroke-width="2" points="{smooth}"/>'
                )
            if len(series) <= 60:
                parts += [
                    f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colours[key]}">'
                    f"<title>step {s}: {escape(name[key])} {_tick(v)}</title></circle>"
                    for s, v in series
                ]
    legend = "".join(
        f'<span><i style="background:{colours[k]}"></i>{escape(name[k])} {_tick(series[-1][1])}</span>'
        for k, series in data.items()
    )
    if marks:
        legend += f'<span class="bad">┆ {len(marks)} skipped update(s)</span>'
    return (
        f'<figure data-chart="{escape(chart.title)}"><figcaption>{escape(chart.title)}</figcaption>'
        f'<svg class="chart" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
        f'aria-label="{escape(chart.title)}">{"".join(parts)}</svg><div class="legend">{legend}</div></figure>'
    )


# ---- sections -----------------------------------------------------------------------------------------------
def _section(name: str, title: str, body: str) -> str:
    return f'<section id="{name}"><h2>{escape(title)}</h2>{body}</section>'


def _change(name: str, first: float | None, last: float | None, note: str) -> str:
    """One headline item: ``name first → last`` coloured by the direction (up is good)."""
    if first is None or last is None:
        return ""
    delta = last - first
    css, arrow = ("up", "▲") if delta > 1e-9 else ("down", "▼") if delta < -1e-9 else ("flat", "=")
    return (
        f'<li data-headline="{escape(name)}">{escape(name)} <b>{first:.3f} → {last:.3f}</b> '
        f'<span class="{css}">{arrow} {delta:+.3f}</span> <span class="meta">{escape(note)}</span></li>'
    )


def _steps(series: Sequence[tuple[int, float]]) -> str:
    """The steps of ``series`` as ``a`` or ``a-b``."""
    return str(series[0][0]) if len(series) == 1 else f"{series[0][0]}-{series[-1][0]}"


def _headline(metrics: Sequence[dict[str, Any]], heldout: Sequence[dict[str, Any]]) -> str:
    items = []
    for key in ("reward", "rewards/tests_pass/mean", "rollouts/non_empty_patch_rate"):
        series = _series(metrics, key)
        if len(series) >= 2:
            k = max(1, len(series) // 10)
            first, last = _steps(series[:k]), _steps(series[-k:])
            note = f"(training, step{'s' if k > 1 else ''} {first} → {last})"
            values = [v for _, v in series]
            items.append(_change(_label(key), statistics.fmean(values[:k]), statistics.fmean(values[-k:]), note))
    skipped = sum(1 for m in metrics if _num(m.get("sampling/skipped_update")))
    if skipped:
        items.append(f'<li class="bad">{skipped} of {len(metrics)} steps skipped their update</li>')
    summary = _checkpoint_summary(heldout)
    if len(summary) >= 2:
        (first, a), (last, b) = summary[0], summary[-1]
        for name in ("resolve rate", "edit rate"):
            items.append(_change(f"held-out {name}", a[name], b[name], f"({first} → {last})"))
    items = [i for i in items if i]
    return f'<ul class="headline">{"".join(items)}</ul>' if items else ""


def _curves(metrics: Sequence[dict[str, Any]], derived: bool) -> str:
    marks = [int(m["step"]) for m in metrics if _num(m.get("sampling/skipped_update"))]
    figures = [_svg_chart(c, metrics, marks if c.title == "groups per step" else ()) for c in _charts(metrics)]
    note = (
        '<p class="note">no metrics.jsonl: curves computed from the saved rollouts (step = the step they were '
        "generated at)</p>"
        if derived
        else ""
    )
    return (
        _section("curves", "training curves", f'{note}<div class="charts">{"".join(figures)}</div>') if figures else ""
    )


def _step_table(metrics: Sequence[dict[str, Any]]) -> str:
    """Every step's main numbers, collapsed."""
    names = [k for m in metrics for k in m if REWARD_MEAN.match(k)]
    columns = [*dict.fromkeys(["reward", *names, "rollouts/non_empty_patch_rate", "rollouts/ok", "loss"])]
    columns += ["sampling/informative_groups", "zero_variance_groups", "logprob_gap/mean"]
    columns = [c for c in columns if any(_num(m.get(c)) is not None for m in metrics)]
    timed = any(_num(m.get(k)) is not None for m in metrics for k in STAGES)
    if not columns:
        return ""
    head = "".join(f"<th>{escape(_label(c))}</th>" for c in columns) + ("<th>seconds</th>" if timed else "")
    rows = []
    for m in metrics:
        cells = "".join(f"<td>{_fmt(_num(m.get(c)))}</td>" for c in columns)
        seconds = [v for k in STAGES if (v := _num(m.get(k))) is not None]
        cells += f"<td>{_fmt(sum(seconds), 1)}</td>" if timed else ""
        rows.append(f"<tr><td>{m['step']}</td>{cells}</tr>")
    return (
        f'<details class="table"><summary>numbers per step ({len(metrics)})</summary>'
        f"<table><tr><th>step</th>{head}</tr>{''.join(rows)}</table></details>"
    )


def _group(records: Sequence[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    """``records`` by their ``key`` value (as text), in order of first appearance."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(str(r.get(key, "")), []).append(r)
    return groups


def _rates(records: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Edit rate, resolve rate (``tests_pass``) and mean similarity of ``records``."""
    return {
        "edit rate": statistics.fmean(_edited(r) for r in records),
        "resolve rate": _mean(r.get("rewards", {}).get("tests_pass") for r in records),
        "similarity": _mean(r.get("rewards", {}).get("patch_similarity") for r in records),
    }


def _checkpoint_summary(heldout: Sequence[dict[str, Any]]) -> list[tuple[str, dict[str, float | None]]]:
    """Per checkpoint (in order): rollouts, ok share, edit/resolve rate, similarity, every other reward's mean and
    the weighted reward (``reward``) where recorded."""
    names = sorted({n for r in heldout for n in r.get("rewards", {})} - {"tests_pass", "patch_similarity"})
    weighted = any("reward" in r for r in heldout)
    out = []
    for label, rs in _group(heldout, "checkpoint").items():
        row: dict[str, float | None] = {"rollouts": len(rs)}
        row |= {"ok": statistics.fmean(r.get("status") == "ok" for r in rs), **_rates(rs)}
        row |= {n: _mean(r.get("rewards", {}).get(n) for r in rs) for n in names}
        if weighted:
            row["weighted reward"] = _mean(r.get("reward") for r in rs)
        out.append((label, row))
    return out


def _heldout(heldout: Sequence[dict[str, Any]]) -> str:
    """The held-out tables: per checkpoint (with last - first, the trivial policies' rows left out of it), per task
    and checkpoint; then the rollouts."""
    summary = _checkpoint_summary(heldout)
    columns = list(summary[0][1])

    def cells(row: dict[str, float | None]) -> str:
        return "".join(
            f'<td data-metric="{escape(c)}">{_fmt(row[c], 0) if c == "rollouts" else _fmt(row[c])}</td>'
            for c in columns
        )

    rows = [
        f'<tr data-checkpoint="{escape(lab)}"><th class="l">{escape(lab)}</th>{cells(r)}</tr>' for lab, r in summary
    ]
    policies = [row for label, row in summary if not label.startswith("trivial:")]  # the trivial policies: beside
    if len(policies) >= 2:
        a, b = policies[0], policies[-1]
        delta = {c: None if c == "rollouts" or (u := a[c]) is None or (v := b[c]) is None else v - u for c in columns}
        rows.append(f'<tr data-checkpoint="Δ"><th class="l">&Delta; last &minus; first</th>{cells(delta)}</tr>')
    per_checkpoint = (
        '<table class="checkpoints"><tr><th class="l">checkpoint</th>'
        + "".join(f"<th>{escape(c)}</th>" for c in columns)
        + f"</tr>{''.join(rows)}</table>"
    )
    labels = [lab for lab, _ in summary]
    metrics = ("edit rate", "resolve rate", "similarity")
    head = "".join(f'<th colspan="{len(metrics)}">{escape(lab)}</th>' for lab in labels)
    sub = "".join(f"<th>{m}</th>" for _ in labels for m in metrics)
    task_rows = []
    for task, rs in sorted(_group(heldout, "instance_id").items()):
        by_checkpoint = _group(rs, "checkpoint")
        cells_ = ""
        for lab in labels:
            rates = _rates(by_checkpoint[lab]) if lab in by_checkpoint else dict.fromkeys(metrics)
            cells_ += "".join(
                f'<td data-checkpoint="{escape(lab)}" data-metric="{m}">{_fmt(rates[m], 2)}</td>' for m in metrics
            )
        task_rows.append(f'<tr data-task="{escape(task)}"><td class="l">{escape(task)}</td>{cells_}</tr>')
    per_task = (
        f'<table class="tasks"><tr><th class="l" rowspan="2">task</th>{head}</tr><tr>{sub}</tr>'
        f"{''.join(task_rows)}</table>"
    )
    listed = "".join(
        f'<details class="group"><summary>{escape(lab)}: {len(rs)} rollouts</summary>'
        f"{''.join(_rollout(r) for r in rs)}</details>"
        for lab, rs in _group(heldout, "checkpoint").items()
    )
    return _section(
        "heldout", "held-out evaluation", f"{per_checkpoint}<h3>per task</h3>{per_task}<h3>rollouts</h3>{listed}"
    )


def diff_lines(patch: str) -> list[tuple[str, str]]:
    """Each line of a unified diff with its kind: ``add``, ``del``, ``ctx``, ``hunk`` (``@@`` headers) or ``meta``
    (file headers). Hunk bodies are counted from their headers, so a removed ``-- x`` line is no file header."""
    out, old, new = [], 0, 0
    for line in patch.splitlines():
        if (old > 0 or new > 0) and line[:1] in "+- ":
            kind = {"+": "add", "-": "del"}.get(line[:1], "ctx")
            old -= kind != "add"
            new -= kind != "del"
        elif match := HUNK.match(line):
            kind = "hunk"
            old, new = (int(n) if n is not None else 1 for n in match.groups())
        else:
            kind = "meta"
        out.append((kind, line))
    return out


def _diff(patch: str | None) -> str:
    """The diff, one ``div.dl.KIND`` per line (``diff_lines``)."""
    if patch is None:
        return '<div class="diff"><div class="dl meta">(not recorded)</div></div>'
    if not patch.strip():
        return '<div class="diff"><div class="dl meta">(empty)</div></div>'
    lines = "".join(f'<div class="dl {kind}">{escape(line) or " "}</div>' for kind, line in diff_lines(patch))
    return f'<div class="diff">{lines}</div>'


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else json.dumps(content, indent=1)


def _rollout(r: dict[str, Any]) -> str:
    """One rollout, collapsed: status, rewards, advantage; the agent's diff beside the oracle; the conversation."""
    status = str(r.get("status", ""))
    scores = ", ".join(f"{escape(k)}={_fmt(_num(v))}" for k, v in r.get("rewards", {}).items())
    advantage = _num(r.get("advantage"))
    patch = r.get("patch") or ""
    kinds = [kind for kind, _ in diff_lines(patch)]
    conversation = r.get("conversation") or []
    turns = "".join(
        f'<div class="role">{escape(str(m.get("role", "?")))}</div><pre>{escape(_text(m))}</pre>' for m in conversation
    )
    return (
        f"<details><summary>{escape(str(r.get('rollout_id', '')))} · {escape(str(r.get('instance_id', '')))} · "
        f'<span class="{"ok" if status == "ok" else "bad"}">{escape(status)}</span> · {scores}'
        + (f" · advantage {advantage:.3f}" if advantage is not None else "")
        + (f" · {r['calls']} calls" if "calls" in r else "")
        + f'</summary><p class="meta">{escape(str(r.get("reason") or ""))}</p>'
        f'<div class="sbs"><div><h4>agent\'s patch (+{kinds.count("add")} &minus;{kinds.count("del")})</h4>'
        f"{_diff(patch)}</div>"
        f"<div><h4>oracle patch</h4>{_diff(r.get('oracle_patch'))}</div></div>"
        f'<details class="conv"><summary>conversation ({len(conversation)} messages)</summary>'
        f"{turns or '<p>(no recorded call)</p>'}</details></details>"
    )


def _rollouts(records: Sequence[dict[str, Any]]) -> str:
    """The rollouts of at most ``MAX_STEPS_LISTED`` steps (the first, the last and evenly between), one group per
    step."""
    by_step = _group(sorted(records, key=lambda r: int(r.get("step", 0))), "step")
    steps = list(by_step)
    count = min(MAX_STEPS_LISTED, len(steps))
    shown = sorted({round(i * (len(steps) - 1) / max(1, count - 1)) for i in range(count)})
    note = (
        f'<p class="note">the rollouts of {len(shown)} of {len(steps)} steps; all are in rollouts/step_XXXX.jsonl</p>'
        if len(shown) < len(steps)
        else ""
    )
    groups = []
    for i in shown:
        rs = by_step[steps[i]]
        rates = _rates(rs)
        groups.append(
            f'<details class="group"><summary>step {escape(steps[i])}: {len(rs)} rollouts · edit rate '
            f"{_fmt(rates['edit rate'], 2)} · resolve rate {_fmt(rates['resolve rate'], 2)}</summary>"
            f"{''.join(_rollout(r) for r in rs)}</details>"
        )
    return _section("rollouts", "rollouts", note + "".join(groups))


def render(
    records: Sequence[dict[str, Any]],
    title: str,
    metrics: Sequence[dict[str, Any]] = (),
    heldout: Sequence[dict[str, Any]] = (),
) -> str:
    """The page for a training run's saved rollouts (``records``), its logged ``metrics`` (per-step dicts with
    ``step``; without them the curves come from ``records``) and held-out rollouts (with ``checkpoint``)."""
    curve_metrics = metrics or metrics_from_records(records)
    training = bool(metrics or records)
    body = [_headline(curve_metrics, heldout), _curves(curve_metrics, derived=not metrics), _step_table(metrics)]
    if heldout:
        body.append(_heldout(heldout))
    elif training:
        body.append(_section("heldout", "held-out evaluation", '<p class="note">none (heldout/rollouts.jsonl)</p>'))
    if records:
        body.append(_rollouts(records))
    elif training:
        body.append(_section("rollouts", "rollouts", '<p class="note">none saved (rollouts/step_XXXX.jsonl)</p>'))
    facts = [f"{len(metrics)} logged steps" if metrics else "", f"{len(records)} saved rollouts" if records else ""]
    facts.append(f"{len(heldout)} held-out rollouts" if heldout else "")
    return (
        f"<!doctype html><html lang=en><meta charset=utf-8><meta http-equiv=Content-Security-Policy content={CSP}>"
        f"<title>{escape(title)}</title><style>{STYLE}</style>"
        f'<h1>{escape(title)}</h1><p class="meta">{" · ".join(f for f in facts if f)}</p>{"".join(body)}</html>'
    )


def write_report(
    records: Sequence[dict[str, Any]],
    out: Path,
    title: str,
    *,
    metrics: Sequence[dict[str, Any]] = (),
    heldout: Sequence[dict[str, Any]] = (),
) -> Path:
    """``render`` into ``out``; return it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(records, title, metrics, heldout))
    log.info("report: %s", out)
    return out


def write_run_report(run_dir: Path, out: Path | None = None) -> Path:
    """A training run's report (default ``RUN_DIR/report.html``) from its ``metrics.jsonl``, ``rollouts/`` and
    ``heldout/rollouts.jsonl``, whichever exist; FileNotFoundError when none does."""
    records, metrics, heldout = read_run(run_dir), read_metrics(run_dir / "metrics.jsonl"), read_heldout(run_dir)
    if not (records or metrics or heldout):
        raise FileNotFoundError(
            f"no metrics.jsonl, rollouts/step_*.jsonl or heldout/rollouts.jsonl under {run_dir}: not a training run"
        )
    out = out or run_dir / "report.html"
    return write_report(records, out, f"aitlrt run {run_dir}", metrics=metrics, heldout=heldout)

"""The run report's charts: a metric's per-step series as an inline SVG figure (lines, or stacked bars for the parts
of a total), with axes, round ticks, a legend with each series' last value, and a moving average over a noisy
series. No script: the page (``aitlrt.report.html``) only places the figures."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from aitlrt.report import metric_names as names

PALETTE = ["#0969da", "#1a7f37", "#cf222e", "#8250df", "#bf8700", "#57606a", "#e16f24", "#1b7c83"]

LABELS = {
    names.REWARD: "weighted reward",
    names.EDIT_RATE: "edit rate",
    names.RESOLVE_RATE: "resolve rate",
    names.ROLLOUTS_OK: "ok rollouts",
    names.GROUPS: "groups",
    names.INFORMATIVE_GROUPS: "informative groups",
    names.ZERO_VARIANCE_GROUPS: "zero-variance groups",
    names.LOGPROB_GAP_MEAN: "mean",
    names.TIME_ROLLOUTS: "rollouts",
    names.TIME_REWARDS: "rewards",
    names.TIME_ROWS: "rows",
    names.TIME_UPDATE: "update",
    names.TIME_SYNC: "sync",
    names.TIME_MODEL_BUSY: "model busy",
    names.TIME_AGENT_OUTSIDE_CALLS: "agent outside calls (mean)",
}
"""What a metric is called on the page, where not its name."""
W, H = 420, 200
X0, X1, Y0, Y1 = 64, W - 18, 10, H - 36
"""Chart size and its plot area (SVG units)."""
SMOOTH_ABOVE = 20
"""A series of more points is drawn faint, with its moving average (``smooth``) over it."""


def number(v: Any) -> float | None:
    """``v`` as a finite float, else None (missing, NaN, not a number)."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def tick(v: float) -> str:
    """A short label: 3 significant digits, as ``-2.25e-4`` where plain digits would be long."""
    text = f"{v:.3g}"
    if "e" in text or len(text) > 6:
        mantissa, exponent = f"{v:.2e}".split("e")
        text = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return text


def series_of(metrics: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every entry with a finite ``key``."""
    return [(int(m[names.STEP]), v) for m in metrics if (v := number(m.get(key))) is not None]


def label(key: str) -> str:
    """A metric's name on the page: ``LABELS``, a reward's name for its mean, else the key."""
    if key in LABELS:
        return LABELS[key]
    match = names.REWARD_MEAN_PATTERN.match(key)
    return match.group(1) if match else key


@dataclass(frozen=True)
class Chart:
    """A figure: the series of ``keys`` on one y scale."""

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


def run_charts(metrics: Sequence[dict[str, Any]]) -> list[Chart]:
    """The charts that have data in ``metrics``."""
    keys = {k for m in metrics for k in m}
    per_function = tuple(sorted(k for k in keys if names.REWARD_MEAN_PATTERN.match(k)))
    charts = [
        Chart("weighted reward", "reward", (names.REWARD,)),
        Chart("reward per function (mean)", "reward", per_function, rate=True,
              labels={k: k.split("/")[1] for k in per_function}),
        Chart("edit and resolve rate", "share of rollouts", (
            names.EDIT_RATE, names.RESOLVE_RATE, names.ROLLOUTS_OK), rate=True),
        Chart("loss", "loss", (names.LOSS,), zero=False),
        Chart("groups per step", "groups", (names.GROUPS, names.INFORMATIVE_GROUPS, names.ZERO_VARIANCE_GROUPS)),
        Chart("logprob gap |trainer - sampler|", "nats / token", (names.LOGPROB_GAP_MEAN,)),
        Chart("seconds per step", "seconds", names.STAGES, stacked=True),
        Chart("rollout time", "seconds", (names.TIME_ROLLOUTS, names.TIME_MODEL_BUSY, names.TIME_AGENT_OUTSIDE_CALLS)),
    ]  # fmt: skip
    return [c for c in charts if any(series_of(metrics, k) for k in c.keys)]


def ticks(lo: float, hi: float, count: int = 4) -> list[float]:
    """About ``count`` round intervals covering [lo, hi] (lo < hi), outermost ticks included."""
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def domain(values: Sequence[float], chart: Chart) -> list[float]:
    """The y ticks (first and last: the axis' ends) for ``values``."""
    lo, hi = min(values), max(values)
    if chart.zero or chart.rate:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if chart.rate:
        hi = max(hi, 1.0)
    if hi - lo < 1e-12:
        lo, hi = (lo - abs(lo) * 0.1, hi + abs(hi) * 0.1) if lo else (0.0, 1.0)
    return ticks(lo, hi)


def smooth(series: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The centred moving average of ``series`` over about a twentieth of its points."""
    half = max(1, len(series) // 40)
    sums = list(itertools.accumulate((v for _, v in series), initial=0.0))
    out = []
    for i, (step, _) in enumerate(series):
        lo, hi = max(0, i - half), min(len(series), i + half + 1)
        out.append((step, (sums[hi] - sums[lo]) / (hi - lo)))
    return out


def svg_chart(chart: Chart, metrics: Sequence[dict[str, Any]], marks: Sequence[int] = ()) -> str:
    """A figure: the chart as inline SVG (one ``polyline.series`` per metric, or stacked ``rect.bar``s), with axes,
    tick labels, ``marks`` (steps drawn as dashed red lines) and a legend with each metric's last value."""
    data = {k: found for k in chart.keys if (found := series_of(metrics, k))}
    steps = sorted({s for series in data.values() for s, _ in series})
    if chart.stacked:
        totals: dict[int, float] = defaultdict(float)
        for series in data.values():
            for step, v in series:
                totals[step] += v
        yticks = domain([*totals.values(), *(v for series in data.values() for _, v in series)], chart)
    else:
        yticks = domain([v for series in data.values() for _, v in series], chart)
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
        parts.append(f'<text x="{X0 - 5}" y="{y(t) + 4:.1f}" text-anchor="end">{tick(t)}</text>')
    for t in [t for t in ticks(xlo, xhi, 5) if t == int(t) and xlo <= t <= xhi]:
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
    name = {k: chart.labels.get(k) or label(k) for k in data}
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
                    f"<title>step {s}: {escape(name[key])} {tick(v)} {escape(chart.unit)}</title></rect>"
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
                averaged = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in smooth(series))
                parts.append(
                    f'<polyline class="smooth" data-series="{escape(key)}" fill="none" stroke="{colours[key]}" '
                    f'stroke-width="2" points="{averaged}"/>'
                )
            if len(series) <= 60:
                parts += [
                    f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colours[key]}">'
                    f"<title>step {s}: {escape(name[key])} {tick(v)}</title></circle>"
                    for s, v in series
                ]
    legend = "".join(
        f'<span><i style="background:{colours[k]}"></i>{escape(name[k])} {tick(series[-1][1])}</span>'
        for k, series in data.items()
    )
    if marks:
        legend += f'<span class="bad">┆ {len(marks)} skipped update(s)</span>'
    return (
        f'<figure data-chart="{escape(chart.title)}"><figcaption>{escape(chart.title)}</figcaption>'
        f'<svg class="chart" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
        f'aria-label="{escape(chart.title)}">{"".join(parts)}</svg><div class="legend">{legend}</div></figure>'
    )

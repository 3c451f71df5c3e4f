"""The run report: one static, self-contained HTML page (inline SVG and CSS, no script, nothing fetched) that shows
within seconds whether training worked.

Top to bottom: the headline (reward, resolve and edit rate at the start and the end of the run, held-out
before → after); per-step curves (``aitlrt.report.charts``) from ``OUTPUT/metrics.jsonl``
(``aitlrt.report.metrics_file``), each with its own y-scale: weighted reward, reward per function, edit/resolve rate,
loss, informative groups (skipped updates marked), logprob gap, seconds per step by stage; the held-out evaluation
(``OUTPUT/heldout/rollouts.jsonl``, ``aitlrt.evaluation.checkpoints.write_results``) per checkpoint and per task; and
every rollout (``aitlrt.rollout.record``), collapsed: status, rewards, advantage, the agent's diff beside the oracle
patch, the conversation.

``write_run_report(RUN_DIR)`` builds a training run's report; ``write_report`` any set of rollouts (``aitlrt eval``
passes its rollouts as ``heldout``). A part without data is left out or noted."""

from __future__ import annotations

import json
import logging
import re
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from html import escape
from pathlib import Path
from typing import Any

from aitlrt.report import metric_names as names
from aitlrt.report.charts import label, number, run_charts, series_of, svg_chart
from aitlrt.report.metrics_file import read_metrics
from aitlrt.rollout.record import RolloutRecord, read_rollouts, read_run_rollouts

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
HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
MAX_STEPS_LISTED = 12
"""The rollouts of at most this many steps are in the page (a long run's would make it too large to open)."""


# ---- numbers ------------------------------------------------------------------------------------------------
def _mean(values: Iterable[Any]) -> float | None:
    nums = [x for x in map(number, values) if x is not None]
    return statistics.fmean(nums) if nums else None


def _fmt(v: float | None, digits: int = 3) -> str:
    return "&ndash;" if v is None else f"{v:.{digits}f}"


def metrics_from_records(records: Sequence[RolloutRecord]) -> list[dict[str, Any]]:
    """Per-step metrics computed from saved rollouts (for a run without ``metrics.jsonl``): the mean of each reward,
    the edit rate and the share of ``ok`` rollouts."""
    by_step: dict[int, list[RolloutRecord]] = defaultdict(list)
    for r in records:
        by_step[r.step].append(r)
    out = []
    for step, rs in sorted(by_step.items()):
        entry: dict[str, Any] = {names.STEP: step}
        for name in sorted({n for r in rs for n in r.rewards}):
            entry[names.reward_stat(name, "mean")] = _mean(r.rewards.get(name) for r in rs)
        entry[names.EDIT_RATE] = statistics.fmean(r.edited for r in rs)
        entry[names.ROLLOUTS_OK] = statistics.fmean(r.status == "ok" for r in rs)
        out.append(entry)
    return out


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


def _headline(metrics: Sequence[dict[str, Any]], heldout: Sequence[RolloutRecord]) -> str:
    items = []
    for key in (names.REWARD, names.RESOLVE_RATE, names.EDIT_RATE):
        series = series_of(metrics, key)
        if len(series) >= 2:
            k = max(1, len(series) // 10)
            first, last = _steps(series[:k]), _steps(series[-k:])
            note = f"(training, step{'s' if k > 1 else ''} {first} → {last})"
            values = [v for _, v in series]
            items.append(_change(label(key), statistics.fmean(values[:k]), statistics.fmean(values[-k:]), note))
    skipped = sum(1 for m in metrics if number(m.get(names.SKIPPED_UPDATE)))
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
    marks = [int(m[names.STEP]) for m in metrics if number(m.get(names.SKIPPED_UPDATE))]
    figures = [svg_chart(c, metrics, marks if c.title == "groups per step" else ()) for c in run_charts(metrics)]
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
    rewards = [k for m in metrics for k in m if names.REWARD_MEAN_PATTERN.match(k)]
    columns = [*dict.fromkeys([names.REWARD, *rewards, names.EDIT_RATE, names.ROLLOUTS_OK, names.LOSS])]
    columns += [names.INFORMATIVE_GROUPS, names.ZERO_VARIANCE_GROUPS, names.LOGPROB_GAP_MEAN]
    columns = [c for c in columns if any(number(m.get(c)) is not None for m in metrics)]
    timed = any(number(m.get(k)) is not None for m in metrics for k in names.STAGES)
    if not columns:
        return ""
    head = "".join(f"<th>{escape(label(c))}</th>" for c in columns) + ("<th>seconds</th>" if timed else "")
    rows = []
    for m in metrics:
        cells = "".join(f"<td>{_fmt(number(m.get(c)))}</td>" for c in columns)
        seconds = [v for k in names.STAGES if (v := number(m.get(k))) is not None]
        cells += f"<td>{_fmt(sum(seconds), 1)}</td>" if timed else ""
        rows.append(f"<tr><td>{m[names.STEP]}</td>{cells}</tr>")
    return (
        f'<details class="table"><summary>numbers per step ({len(metrics)})</summary>'
        f"<table><tr><th>step</th>{head}</tr>{''.join(rows)}</table></details>"
    )


def _group(records: Sequence[RolloutRecord], key: Callable[[RolloutRecord], object]) -> dict[str, list[RolloutRecord]]:
    """``records`` by their ``key`` (as text), in order of first appearance."""
    groups: dict[str, list[RolloutRecord]] = {}
    for r in records:
        groups.setdefault(str(key(r)), []).append(r)
    return groups


def _checkpoint(r: RolloutRecord) -> str:
    return r.checkpoint or ""


def _task(r: RolloutRecord) -> str:
    return r.instance_id


def _rates(records: Sequence[RolloutRecord]) -> dict[str, float | None]:
    """Edit rate, resolve rate (``tests_pass``) and mean similarity of ``records``."""
    return {
        "edit rate": statistics.fmean(r.edited for r in records),
        "resolve rate": _mean(r.rewards.get("tests_pass") for r in records),
        "similarity": _mean(r.rewards.get("patch_similarity") for r in records),
    }


def _checkpoint_summary(heldout: Sequence[RolloutRecord]) -> list[tuple[str, dict[str, float | None]]]:
    """Per checkpoint (in order): rollouts, ok share, edit/resolve rate, similarity, every other reward's mean and
    the weighted reward (``reward``) where recorded."""
    others = sorted({n for r in heldout for n in r.rewards} - {"tests_pass", "patch_similarity"})
    weighted = any(r.reward is not None for r in heldout)
    out = []
    for checkpoint, rs in _group(heldout, _checkpoint).items():
        row: dict[str, float | None] = {"rollouts": len(rs)}
        row |= {"ok": statistics.fmean(r.status == "ok" for r in rs), **_rates(rs)}
        row |= {n: _mean(r.rewards.get(n) for r in rs) for n in others}
        if weighted:
            row["weighted reward"] = _mean(r.reward for r in rs)
        out.append((checkpoint, row))
    return out


def _heldout(heldout: Sequence[RolloutRecord]) -> str:
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
    for task, rs in sorted(_group(heldout, _task).items()):
        by_checkpoint = _group(rs, _checkpoint)
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
        for lab, rs in _group(heldout, _checkpoint).items()
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


def _rollout(r: RolloutRecord) -> str:
    """One rollout, collapsed: status, rewards, advantage; the agent's diff beside the oracle; the conversation."""
    status = r.status
    scores = ", ".join(f"{escape(k)}={_fmt(number(v))}" for k, v in r.rewards.items())
    advantage = number(r.advantage)
    patch = r.patch
    kinds = [kind for kind, _ in diff_lines(patch)]
    conversation = r.conversation
    turns = "".join(
        f'<div class="role">{escape(str(m.get("role", "?")))}</div><pre>{escape(_text(m))}</pre>' for m in conversation
    )
    return (
        f"<details><summary>{escape(r.rollout_id)} · {escape(r.instance_id)} · "
        f'<span class="{"ok" if status == "ok" else "bad"}">{escape(status)}</span> · {scores}'
        + (f" · advantage {advantage:.3f}" if advantage is not None else "")
        + (f" · {r.calls} calls" if r.calls is not None else "")
        + f'</summary><p class="meta">{escape(r.reason)}</p>'
        f'<div class="sbs"><div><h4>agent\'s patch (+{kinds.count("add")} &minus;{kinds.count("del")})</h4>'
        f"{_diff(patch)}</div>"
        f"<div><h4>oracle patch</h4>{_diff(r.oracle_patch)}</div></div>"
        f'<details class="conv"><summary>conversation ({len(conversation)} messages)</summary>'
        f"{turns or '<p>(no recorded call)</p>'}</details></details>"
    )


def _rollouts(records: Sequence[RolloutRecord]) -> str:
    """The rollouts of at most ``MAX_STEPS_LISTED`` steps (the first, the last and evenly between), one group per
    step."""
    by_step = _group(sorted(records, key=lambda r: r.step), lambda r: r.step)
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
    records: Sequence[RolloutRecord],
    title: str,
    metrics: Sequence[dict[str, Any]] = (),
    heldout: Sequence[RolloutRecord] = (),
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
    records: Sequence[RolloutRecord],
    out: Path,
    title: str,
    *,
    metrics: Sequence[dict[str, Any]] = (),
    heldout: Sequence[RolloutRecord] = (),
) -> Path:
    """``render`` into ``out``; return it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(records, title, metrics, heldout))
    log.info("report: %s", out)
    return out


def write_run_report(run_dir: Path, out: Path | None = None) -> Path:
    """A training run's report (default ``RUN_DIR/report.html``) from its ``metrics.jsonl``, ``rollouts/`` and
    ``heldout/rollouts.jsonl``, whichever exist; FileNotFoundError when none does."""
    records, metrics = read_run_rollouts(run_dir), read_metrics(run_dir / "metrics.jsonl")
    heldout = read_rollouts(run_dir / "heldout" / "rollouts.jsonl")
    if not (records or metrics or heldout):
        raise FileNotFoundError(
            f"no metrics.jsonl, rollouts/step_*.jsonl or heldout/rollouts.jsonl under {run_dir}: not a training run"
        )
    out = out or run_dir / "report.html"
    return write_report(records, out, f"aitlrt run {run_dir}", metrics=metrics, heldout=heldout)

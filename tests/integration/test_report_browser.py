"""The run report in a real headless Chromium: the page a person opens shows the curves, the held-out table and the
diffs, loads nothing, runs no script and logs no console message; its screenshot is not blank.

Chromium comes from ``jobs/setup.sh`` (Debian's ``chromium``); without it these tests fail, unless
``AITLRT_NO_BROWSER=1``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from aitlrt.report.html import write_run_report
from aitlrt.report.metrics_log import MetricsLog
from tests.helpers.multirank_run import tiny_trainer

VOID = {"meta", "link", "br", "hr", "img", "input", "source", "area", "base", "col", "embed", "track", "wbr"}
TIMES = ("time/rollouts_s", "time/rewards_s", "time/update_s", "time/sync_s")
NAN = float("nan")


# ---- a DOM from Chromium's --dump-dom ---------------------------------------------------------------------------
@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        """Every descendant with this tag, class and attributes (``data_x`` means ``data-x``)."""
        found = []
        for child in self.children:
            if isinstance(child, str):
                continue
            wanted = {k.replace("_", "-"): v for k, v in attrs.items()}
            if (
                (tag is None or child.tag == tag)
                and (cls is None or cls in child.classes)
                and all(child.attrs.get(k) == v for k, v in wanted.items())
            ):
                found.append(child)
            found += child.all(tag, cls, **attrs)
        return found

    def one(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> Node:
        (node,) = self.all(tag, cls, **attrs)
        return node


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        while self.stack[-1].tag != tag:
            self.stack.pop()
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def chromium() -> str:
    """The Chromium binary; fails (skips with ``AITLRT_NO_BROWSER=1``) when there is none."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    if os.environ.get("AITLRT_NO_BROWSER") == "1":
        pytest.skip("AITLRT_NO_BROWSER=1: no browser test")
    pytest.fail(
        "no Chromium on PATH: `bash jobs/setup.sh` installs Debian's `chromium` when run as root "
        "(or `apt-get install -y --no-install-recommends chromium`); AITLRT_NO_BROWSER=1 skips these tests"
    )


def browse(page: Path, tmp_path: Path) -> tuple[Node, Path]:
    """Load ``page`` in headless Chromium: its DOM after rendering and a full-width screenshot; fail on any
    console message (script errors, blocked loads)."""
    base = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0"]
    base.append(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    dom = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0 and dom.stdout.startswith("<!DOCTYPE html>"), dom.stderr[-3000:]
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    shot = tmp_path / "report.png"
    args = [*base, "--hide-scrollbars", "--window-size=1400,1600", f"--screenshot={shot}", page.as_uri()]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.exists(), done.stderr[-3000:]
    builder = _Builder()
    builder.feed(dom.stdout)
    return builder.root, shot


def assert_not_blank(shot: Path, colour: tuple[int, int, int]) -> None:
    """The screenshot has ink (not white) on over 1% of its pixels and some pixels of ``colour`` (a curve)."""
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    pixels = list(image.getdata())
    ink = sum(1 for p in pixels if min(p) < 200)
    assert ink > 0.01 * len(pixels), f"{ink} of {len(pixels)} pixels not white"
    assert sum(1 for p in pixels if all(abs(a - b) < 40 for a, b in zip(p, colour, strict=True))) > 50


# ---- a realistic run ------------------------------------------------------------------------------------------
CALC_ORACLE = (
    "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,3 +1,3 @@\n def add(a, b):\n"
    "-    return a - b\n+    return a + b\n \n"
)
TEXT_ORACLE = (
    "diff --git a/text.py b/text.py\n--- a/text.py\n+++ b/text.py\n@@ -1,2 +1,2 @@\n def shout(s):\n"
    "-    return s.lower()\n+    return s.upper()\n"
)
# A wrong fix that removes a SQL comment line ("-- ..."): inside a hunk, not a file header.
TEXT_WRONG = (
    "diff --git a/text.py b/text.py\n--- a/text.py\n+++ b/text.py\n@@ -1,3 +1,3 @@\n def shout(s):\n"
    "--- old comment\n+    # new comment\n     return s.lower()\n"
)


def conversation(task: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You are Aider. <script>alert('not run')</script>"},
        {"role": "user", "content": f"Fix {task}"},
        {"role": "assistant", "content": "calc.py\n```python\ndef add(a, b):\n    return a + b\n```"},
    ]


def rollout(step: int, i: int, task: str, status: str, patch: str, rewards: dict[str, float], adv: float) -> dict:
    return {
        "step": step,
        "rollout_id": f"s{step:05d}-r0-abc123-{i:03d}",
        "instance_id": task,
        "status": status,
        "reason": "" if status == "ok" else f"{status} after 2 calls",
        "patch": patch,
        "oracle_patch": CALC_ORACLE if task == "calc-1" else TEXT_ORACLE,
        "rewards": rewards,
        "advantage": adv,
        "calls": 2,
        "completion_tokens": 120,
        "conversation": conversation(task),
    }


def scores(tests: float, similarity: float, edited: float) -> dict[str, float]:
    return {"tests_pass": tests, "patch_similarity": similarity, "non_empty_patch": edited}


METRICS = [  # step, then the values trl logs (None: not logged that step)
    dict(reward=0.40, tests=0.00, sim=0.30, edit=0.50, ok=0.75, loss=0.80, gap=0.020, groups=4, inf=2, skip=0.0),
    dict(reward=0.35, tests=0.00, sim=0.25, edit=0.50, ok=0.50, loss=None, gap=None, groups=6, inf=0, skip=1.0),
    dict(reward=0.90, tests=0.25, sim=0.55, edit=0.75, ok=1.00, loss=-0.30, gap=0.050, groups=4, inf=3, skip=0.0),
    dict(reward=1.60, tests=0.50, sim=0.80, edit=1.00, ok=1.00, loss=2.40, gap=0.030, groups=8, inf=5, skip=0.0),
]


def fake_run(run: Path) -> Path:
    """A run dir as a training run leaves it: ``metrics.jsonl`` written by ``MetricsLog`` (4 steps, one update
    skipped, a NaN), two steps of saved rollouts, a held-out evaluation before/after."""
    callback = MetricsLog(run / "metrics.jsonl")
    state = SimpleNamespace(is_world_process_zero=True, global_step=0)
    callback.on_train_begin(None, state, None)
    for step, m in enumerate(METRICS, 1):
        state.global_step = step
        logs = {
            "reward": m["reward"],
            "rewards/tests_pass/mean": m["tests"],
            "rewards/patch_similarity/mean": m["sim"],
            "rewards/non_empty_patch/mean": m["edit"],
            "rollouts/non_empty_patch_rate": m["edit"],
            "rollouts/ok": m["ok"],
            "logprob_gap/mean": NAN if m["gap"] is None else m["gap"],
            "zero_variance_groups": m["groups"] - m["inf"],
            "sampling/groups": m["groups"],
            "sampling/informative_groups": m["inf"],
            "sampling/rounds": 1 + (m["inf"] < 2),
            "sampling/skipped_update": m["skip"],
            "epoch": step / 4,
        } | {key: 10.0 * (k + 1) + step for k, key in enumerate(TIMES)}
        logs |= {"time/model_busy_s": 8.0 + step, "time/agent_outside_calls_s": 0.5}
        if m["loss"] is not None:
            logs["loss"] = m["loss"]
        callback.on_log(None, state, None, logs=logs)
    callback.on_log(None, state, None, logs={"train_runtime": 321.0, "train_loss": 1.0})

    (run / "rollouts").mkdir(parents=True)
    for step in (0, 1):
        records = [
            rollout(step, 0, "calc-1", "ok", CALC_ORACLE, scores(1.0, 1.0, 1.0), 1.2),
            rollout(step, 1, "calc-1", "no_patch", "", scores(0.0, 0.0, 0.0), -0.9),
            rollout(step, 2, "text-2", "ok", TEXT_WRONG, scores(0.0, 0.4, 1.0), 0.1),
            rollout(step, 3, "text-2", "agent_error", "", scores(NAN, NAN, NAN), 0.0),
        ]
        (run / "rollouts" / f"step_{step:04d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    heldout = []
    outcomes = {  # per checkpoint and task: (tests_pass, similarity, patch) of its two rollouts
        "before": {"calc-1": [(0, 0.2, "x"), (1, 1.0, "x")], "text-2": [(0, 0.0, ""), (0, 0.5, "x")]},
        "after": {"calc-1": [(1, 1.0, "x"), (1, 1.0, "x")], "text-2": [(1, 1.0, "x"), (0, 0.6, "x")]},
    }
    for position, (label, tasks) in enumerate(outcomes.items()):
        for task, results in tasks.items():
            for i, (tests, sim, patch) in enumerate(results):
                record = rollout(position, i, task, "ok" if patch else "no_patch", "", {}, 0.0)
                record |= {"patch": CALC_ORACLE if patch and task == "calc-1" else TEXT_WRONG if patch else ""}
                record |= {"checkpoint": label, "rewards": scores(tests, sim, float(bool(patch)))}
                del record["advantage"]
                heldout.append(record)
    (run / "heldout").mkdir()
    (run / "heldout" / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout))
    return run


def points(polyline: Node) -> int:
    return len(polyline.attrs["points"].split())


def test_run_report_in_chromium(tmp_path):
    run = fake_run(tmp_path / "run")
    page = write_run_report(run)
    dom, shot = browse(page, tmp_path)

    # No script ran or exists (the conversation's <script> is text), nothing was fetched (no console message).
    assert not dom.all("script") and "<script>alert('not run')</script>" in dom.text

    # The headline: training reward, resolve and edit rate up; held-out resolve rate 0.250 -> 0.750.
    headline = {li.attrs.get("data-headline"): li.text for li in dom.one("ul", "headline").all("li")}
    assert "0.250 → 0.750" in headline["held-out resolve rate"] and "▲ +0.500" in headline["held-out resolve rate"]
    assert "▲" in headline["resolve rate"] and "▲" in headline["edit rate"] and "▲" in headline["weighted reward"]
    assert any("1 of 4 steps skipped" in li.text for li in dom.one("ul", "headline").all("li"))

    # One curve per metric, one point per step that logged it; each chart its own y-scale and axis labels.
    figures = {f.attrs["data-chart"]: f for f in dom.all("figure")}
    assert set(figures) == {
        "weighted reward",
        "reward per function (mean)",
        "edit and resolve rate",
        "loss",
        "groups per step",
        "logprob gap |trainer - sampler|",
        "seconds per step",
        "rollout time",
    }
    expected = {
        "time/model_busy_s": 4,  # the rollout time's split, beside the rollouts' wall time
        "time/agent_outside_calls_s": 4,
        "rewards/tests_pass/mean": 4,
        "rewards/patch_similarity/mean": 4,
        "rewards/non_empty_patch/mean": 4,
        "rollouts/non_empty_patch_rate": 4,
        "reward": 4,
        "loss": 3,  # not logged at the skipped step
        "logprob_gap/mean": 3,  # NaN at step 2 (null in metrics.jsonl)
        "sampling/informative_groups": 4,
    }
    for key, n in expected.items():
        lines = dom.all("polyline", "series", data_series=key)
        assert lines and all(points(p) == n for p in lines), (key, [points(p) for p in lines])
    rate_ticks = [
        float(t.text) for t in figures["edit and resolve rate"].all("text") if t.attrs.get("text-anchor") == "end"
    ]
    assert min(rate_ticks) == 0 and max(rate_ticks) == 1
    loss_ticks = [float(t.text) for t in figures["loss"].all("text") if t.attrs.get("text-anchor") == "end"]
    assert min(loss_ticks) <= -0.3 and max(loss_ticks) >= 2.4 and max(loss_ticks) < 5
    axis = {f: [t.text for t in figures[f].all("text", "axis")] for f in ("loss", "seconds per step")}
    assert axis == {"loss": ["step", "loss"], "seconds per step": ["step", "seconds"]}
    bars = figures["seconds per step"].all("rect", "bar")
    assert len(bars) == 4 * len(TIMES) and {b.attrs["data-series"] for b in bars} == set(TIMES)
    assert len(figures["groups per step"].all("line", "skipped")) == 1  # step 2's update was skipped

    # Held-out before/after per checkpoint, the difference, and per task.
    table = dom.one("table", "checkpoints")
    cell = {
        (tr.attrs["data-checkpoint"], td.attrs["data-metric"]): td.text
        for tr in table.all("tr")
        if "data-checkpoint" in tr.attrs
        for td in tr.all("td")
    }
    assert cell["before", "rollouts"] == "4" and cell["after", "rollouts"] == "4"
    assert (cell["before", "resolve rate"], cell["after", "resolve rate"], cell["Δ", "resolve rate"]) == (
        "0.250",
        "0.750",
        "0.500",
    )
    assert (cell["before", "edit rate"], cell["after", "edit rate"], cell["Δ", "edit rate"]) == (
        "0.750",
        "1.000",
        "0.250",
    )
    assert (cell["before", "similarity"], cell["after", "similarity"]) == ("0.425", "0.900")
    tasks = dom.one("table", "tasks")
    calc = tasks.one("tr", data_task="calc-1")
    assert calc.one("td", data_checkpoint="before", data_metric="resolve rate").text == "0.50"
    assert calc.one("td", data_checkpoint="after", data_metric="resolve rate").text == "1.00"

    # Every rollout (8 saved + 8 held-out) with the agent's diff beside the oracle's, lines classed by kind.
    rollouts = [d for d in dom.one("section", id="rollouts").all("details") if not d.classes]
    heldout = [d for d in dom.one("section", id="heldout").all("details") if not d.classes]
    assert len(rollouts) == len(heldout) == 8 and all(len(r.all("div", "sbs")) == 1 for r in rollouts + heldout)
    first = rollouts[0]
    assert "advantage 1.200" in first.all("summary")[0].text
    agent, oracle = first.one("div", "sbs").all("div", "diff")
    for diff in (agent, oracle):
        assert [d.text for d in diff.all("div", "add")] == ["+    return a + b"]
        assert [d.text for d in diff.all("div", "del")] == ["-    return a - b"]
        assert [d.text for d in diff.all("div", "hunk")] == ["@@ -1,3 +1,3 @@"]
        assert len(diff.all("div", "meta")) == 3  # diff --git, ---, +++
    wrong = rollouts[2].one("div", "sbs").all("div", "diff")[0]
    assert [d.text for d in wrong.all("div", "del")] == ["--- old comment"]  # inside the hunk: a removed line
    assert "agent's patch (+1 \u22121)" in rollouts[2].one("div", "sbs").text
    assert "(empty)" in rollouts[1].one("div", "sbs").all("div", "diff")[0].text
    conv = first.one("details", "conv")
    assert "3 messages" in conv.one("summary").text and "open" not in conv.attrs

    assert_not_blank(shot, (0x09, 0x69, 0xDA))


def test_report_of_a_real_training_run_in_chromium(scripted_upstream, start_proxy, make_repo, tmp_path):
    """Two steps of the real trainer (tiny model, counting agent, scripted upstream) with ``MetricsLog``."""
    repo = make_repo({"README": "tiny\n"})
    out = tmp_path / "run"
    trainer = tiny_trainer(
        start_proxy(scripted_upstream).url, str(repo), str(out), max_steps=2, per_device_train_batch_size=4
    )
    trainer.add_callback(MetricsLog(out / "metrics.jsonl"))
    trainer.train()
    trainer.close()
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in logged if "reward" in e] == [1, 2]

    dom, shot = browse(write_run_report(out), tmp_path)
    figures = {f.attrs["data-chart"] for f in dom.all("figure")}
    assert {"weighted reward", "reward per function (mean)", "loss", "seconds per step"} <= figures
    for key in ("reward", "rewards/calls_reward/mean", "loss"):
        (line,) = dom.all("polyline", "series", data_series=key)
        assert points(line) == 2, key
    rollouts = [d for d in dom.one("section", id="rollouts").all("details") if not d.classes]
    assert len(rollouts) == 8 and all(r.all("div", "sbs") for r in rollouts)  # 2 steps x 4
    assert "none" in dom.one("section", id="heldout").text
    assert_not_blank(shot, (0x09, 0x69, 0xDA))

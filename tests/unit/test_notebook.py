"""The notebook a newcomer reads: DIARY.md as the index, decision records, the generated bench results page."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = sorted((ROOT / "docs" / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md"))
NOTEBOOK = sorted((ROOT / "docs" / "notebook").glob("2026-*.md"))
VERDICTS = ("adopted", "rejected", "inconclusive", "fixed", "measured")
LINKED = [
    ROOT / "DIARY.md",
    ROOT / "CHANGELOG.md",
    ROOT / "docs" / "results.md",
    ROOT / "docs" / "benchmarks.md",
    ROOT / "docs" / "notebook" / "benchmarks-history.md",
    *NOTEBOOK,
    *DECISIONS,
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def results_module():
    spec = importlib.util.spec_from_file_location("bench_results", ROOT / "bench" / "results.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def anchors(page: Path) -> set[str]:
    """Explicit ``<a id>`` anchors and GitHub's heading slugs (lowercase, punctuation dropped, spaces to hyphens)."""
    text = page.read_text()
    ids = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.+)$", text, flags=re.M):
        ids.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return ids


def test_every_decision_record_has_context_decision_evidence_and_consequence_in_about_forty_lines():
    assert len(DECISIONS) >= 15
    for record in DECISIONS:
        text = record.read_text()
        assert text.startswith(f"# {record.name[:4]} "), record.name
        sections = re.findall(r"^## (.+)$", text, flags=re.M)
        assert sections == ["Context", "Decision", "Evidence", "Consequence"], record.name
        assert len(text.splitlines()) <= 45, record.name
        assert "## Evidence" in text and re.search(r"\d", text.split("## Evidence")[1]), record.name


def test_the_diary_lists_every_decision_record_once():
    diary = (ROOT / "DIARY.md").read_text()
    for record in DECISIONS:
        assert diary.count(f"(docs/decisions/{record.name})") == 1, record.name


def test_every_notebook_heading_is_short_and_tagged_with_its_verdict():
    pages = [ROOT / "DIARY.md", *NOTEBOOK]
    entries = [line for page in pages for line in page.read_text().splitlines() if line.startswith("### ")]
    assert len(entries) >= 39
    for heading in entries:
        assert len(heading) <= 90, heading
        assert re.search(r" \[(" + "|".join(VERDICTS) + r")\]$", heading), heading


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_of_the_notebook_resolves_to_a_file_and_anchor(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target}"
        if anchor and resolved.is_file():
            assert anchor in anchors(resolved), f"{page.name}: {target}"


def test_configs_cite_decision_records_that_exist_and_no_time_of_day():
    numbers = {record.name[:4] for record in DECISIONS}
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        text = config.read_text()
        assert "DIARY 2026" not in text and "DIARY 11-" not in text, config.name
        for cited in re.findall(r"docs/decisions/(\d{4})((?:, \d{4})*)", text):
            for number in [cited[0], *re.findall(r"\d{4}", cited[1])]:
                assert number in numbers, f"{config.name}: {number}"


def test_docs_results_md_is_what_bench_results_jsonl_gives():
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "results.py"), "--check"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_a_bench_run_appends_one_row_with_its_targets_and_table_and_a_run_without_targets_none(tmp_path, capsys):
    results = results_module()
    path = tmp_path / "results.jsonl"

    def bench() -> int:
        print("[bench] starting")
        print("| measure | value |\n|---|---|\n| overhead | 0.07 s |")
        print("TARGET warm_overhead_s 0.073 0.2 PASS")
        print("TARGET heldout_resolve_gain_rl +0.000 >0_all_seeds_and_>=+0.05 MISS")
        return 7

    assert results.recorded("rollouts", bench, path) == 7
    assert results.recorded("learning", lambda: print("validation table, no TARGET line"), path) is None
    assert "TARGET warm_overhead_s" in capsys.readouterr().out  # still printed as it comes
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["bench"] == "rollouts" and row["source"] == "run" and row["machine"]["cores"] >= 1
    assert re.fullmatch(r"[0-9a-f]{7,}", row["commit"])
    assert row["targets"] == [
        {"name": "warm_overhead_s", "value": 0.073, "goal": "0.2", "verdict": "PASS"},
        {"name": "heldout_resolve_gain_rl", "value": 0.0, "goal": ">0_all_seeds_and_>=+0.05", "verdict": "MISS"},
    ]
    assert row["summary"] == ["| measure | value |", "|---|---|", "| overhead | 0.07 s |"]
    page = results.render(rows)
    assert "| warm_overhead_s | heldout_resolve_gain_rl |" in page and "0.073 PASS" in page


def test_the_committed_results_rows_name_a_bench_a_machine_and_parsed_targets():
    results = results_module()
    rows = results.load()
    assert {row["bench"] for row in rows} >= {"proxy", "rollouts", "rewards", "train_step", "step", "learning"}
    for row in rows:
        assert row["source"] in {"run", "notebook"} and row["targets"], row
        assert {"cpu", "cores"} <= set(row["machine"])
        assert all(t["verdict"] in {"PASS", "MISS"} for t in row["targets"]), row

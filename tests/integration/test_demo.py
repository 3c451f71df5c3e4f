"""The proxy demo (`aitlrt demo`, docs/setup.md) works end to end: it serves, records one call and cleans up."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests.conftest import httpx_down


def test_demo_serves_records_and_cleans_up(tmp_path):
    run_dir = tmp_path / "demo"
    out = subprocess.run(
        [sys.executable, "-m", "aitlrt.cli", "demo", "--run-dir", str(run_dir), "--max-tokens", "24"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "decoded sampled ids == text the agent received: True" in out.stdout
    assert "forced sampling: temperature=1.0 (agent asked 0)" in out.stdout
    (record,) = [json.loads(line) for line in (run_dir / "calls.jsonl").read_text().splitlines()]
    assert len(record["completion_token_ids"]) == len(record["logprobs"]) == 24
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps, "the demo's aitlrt-serve outlived it"
    vllm_port = re.search(r"starting vLLM: .* --port (\d+)", (run_dir / "serve.log").read_text()).group(1)
    assert httpx_down(f"http://127.0.0.1:{vllm_port}/health"), "the demo's vLLM outlived it"

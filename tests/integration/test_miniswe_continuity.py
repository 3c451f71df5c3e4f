"""Rows per rollout of real mini-swe-agent rollouts (text mode, on a real vLLM CPU server), with token continuity
(aitlrt-serve's default) and without (``--no-continuity``), through two proxies on the same vLLM: the same task and
seeds through each (3 rollouts, or ``$AITLRT_CONTINUITY_ROLLOUTS``). The model is the bundled one, or the folder in
``$AITLRT_CONTINUITY_MODEL`` (a mini-swe-agent warm start writes well-formed actions, which mini-swe-agent keeps in
its history; it drops a malformed answer, and the bundled model writes hardly any other)."""

from __future__ import annotations

import itertools
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest

from aitlrt.common import keys
from aitlrt.common.git import git
from aitlrt.common.procs import free_port
from aitlrt.rollout.agents import AgentTask, make_agent
from aitlrt.rollout.agents.mini_swe import miniswe_venv
from aitlrt.rollout.runner import RolloutRequest, RolloutRunner
from aitlrt.serving.process import ServeProcess
from aitlrt.training.rows import build_rows

pytestmark = pytest.mark.skipif(not (miniswe_venv() / "bin" / "mini").exists(), reason="run jobs/setup.sh first")
ROLLOUTS = int(os.environ.get("AITLRT_CONTINUITY_ROLLOUTS", "3"))
CALLS = 4
APPEND_ONLY_FALLBACKS = {"first_call", "history_rewritten", "answer_rewritten", "previous_finish"}
"""Why a call of a real mini-swe-agent rollout may take the ordinary path: its history was not append-only."""


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Path:
    return Path(os.environ.get("AITLRT_CONTINUITY_MODEL") or model_dir)


@pytest.fixture(scope="module")
def served_256(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The bundled model behind aitlrt-serve (256 tokens per answer, room for an action): its URL and vLLM's."""
    run_dir = tmp_path_factory.mktemp("served256c")
    vllm_port = free_port()
    args = ["--model", str(model), "--run-dir", str(run_dir), "--vllm-port", str(vllm_port),
            "--vllm-log", str(run_dir / "vllm.log"), "--max-tokens", "256", "--temperature", "1.0",
            "--enforce-eager", "--max-model-len", "8192"]  # fmt: skip
    with ServeProcess(args, port=free_port(), log_path=run_dir / "serve.log") as serve:
        yield serve.url, f"http://127.0.0.1:{vllm_port}"


def rollouts(url: str, model: str, src: Path, base: str, workspaces: Path, arm: str) -> list[list[dict]]:
    task = AgentTask("real", "Fix the bug in add() in calc.py: it must return a + b.")
    requests = [RolloutRequest(f"{arm}-{i}", task, src, base, seed=i) for i in range(ROLLOUTS)]
    agent = make_agent("mini-swe-agent", max_calls=CALLS)
    with closing(agent), RolloutRunner(agent, url, model, workspaces=workspaces, timeout_s=400, max_calls=CALLS,
                                       concurrency=1) as runner:  # fmt: skip
        outs = runner.run(requests)
    for out in outs:
        assert out.status in ("ok", "no_patch", "call_limit"), (out.status, out.reason, out.log_tail[-3000:])
    return [out.trace for out in outs]


@pytest.mark.timeout(2400)
def test_rows_per_rollout_of_real_miniswe_rollouts_with_and_without_continuity(
    served_256, model, make_repo: Callable[..., Path], start_proxy, monkeypatch, tmp_path, record_property
):
    url, vllm_url = served_256  # the managed proxy's key opens vLLM
    src = make_repo({"calc.py": "def add(a, b):\n    return a - b\n"}, name="src")
    base = git("rev-parse", "HEAD", cwd=src).strip()
    monkeypatch.setenv("VLLM_KEY", keys.vllm_key(keys.admin_key(url) or ""))
    # two proxies attached to the same vLLM with the same sampling (the managed one's): only continuity differs
    sampling = ["--upstream-api-key-env", "VLLM_KEY", "--max-tokens", "256", "--temperature", "1.0"]
    off, on = start_proxy(vllm_url, *sampling, "--no-continuity"), start_proxy(vllm_url, *sampling)
    measured = {}
    for arm, proxy_url in (("off", off.url), ("on", on.url)):
        traces = rollouts(proxy_url, model.name, src, base, tmp_path / arm, arm)
        rows, calls, outcomes = [], [], Counter()
        for trace in traces:
            built, stats = build_rows(trace)
            rows.append(len(built))
            calls.append(stats.used_calls)
            outcomes.update(c["continuity"] for c in trace if c["status"] == 200)
            for prev, call in itertools.pairwise(trace):
                if call["continued_from"] is not None:  # a continued call extends the one it continues exactly
                    held = prev["prompt_token_ids"] + prev["completion_token_ids"]
                    assert call["continued_from"] == prev["call_index"]
                    assert call["prompt_token_ids"][: len(held)] == held
            if arm == "on":  # every call but the continued ones starts a row
                assert len(built) == stats.used_calls - sum(c["continued_from"] is not None for c in trace)
        measured[arm] = (rows, calls, dict(outcomes))
        print(f"mini-swe-agent, continuity {arm}: calls per rollout {calls}, rows per rollout {rows}, "
              f"calls by continuity {dict(outcomes)}")  # fmt: skip
        record_property(f"rows_per_rollout_{arm}", rows)
        record_property(f"calls_per_rollout_{arm}", calls)
    assert set(measured["off"][2]) == {"off"}
    # with continuity, every call of an append-only history was continued: the others rewrote it
    assert set(measured["on"][2]) <= {"continued", *APPEND_ONLY_FALLBACKS}, measured["on"][2]

"""A vLLM that dies or hangs mid-run, behind a real ``aitlrt-serve`` (the scripted upstream), stops a tiny training
run after ``max_unscorable_steps`` steps with an error naming the cause, instead of skipping updates to
``max_steps``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from aitlrt.common.procs import free_port, wait_http
from aitlrt.training.failures import UnscorableStepsError
from tests.helpers.multirank_run import tiny_trainer


@pytest.mark.parametrize("fault", ["dead", "hung"])
def test_a_dead_or_hung_server_stops_the_run(fault, start_proxy, make_repo, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "tests.helpers.scripted_upstream", "--port", str(port)]
    upstream = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", upstream)
        proxy = start_proxy(f"http://127.0.0.1:{port}", "--request-timeout", "2").url
        repo = str(make_repo({"README": "tiny\n"}))
        out = tmp_path / "run"
        one_round = dict(per_device_train_batch_size=4, max_sampling_rounds=1, rollout_concurrency=4)
        trainer = tiny_trainer(proxy, repo, str(out), max_steps=10, max_unscorable_steps=2, **one_round)
        trainer.server.connect()  # the first step's handshake, while vLLM is up
        if fault == "dead":
            upstream.kill()
        else:
            os.kill(upstream.pid, signal.SIGSTOP)  # accepts connections, never answers: the proxy's 504
        try:
            with pytest.raises(UnscorableStepsError) as err:
                trainer.train()
        finally:
            trainer.close()
    finally:
        os.kill(upstream.pid, signal.SIGCONT) if upstream.poll() is None else None
        upstream.kill()
        upstream.wait(10)
    text = str(err.value)
    assert "2 consecutive steps (to step 2)" in text, text
    assert "/health: 503" in text and "upstream_unavailable" in text, text
    assert "agent_error: the server failed the last call" in text, text
    assert ("502" if fault == "dead" else "504") in text, text
    assert len(list((out / "rollouts").glob("step_*.jsonl"))) == 2  # nothing ran past the second step

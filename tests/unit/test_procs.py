"""Process groups an interrupted run must not leave behind (``aitlrt.common.procs``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from aitlrt.common.procs import kill_group, kill_sessions, run_process_group, start_session
from tests.conftest import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A leader that starts a grandchild (as Aider starts git) and prints its pid, then both sleep.
LEADER = "import subprocess, sys, time; c = subprocess.Popen(['sleep', '60']); print(c.pid, flush=True); time.sleep(60)"


def test_kill_sessions_stops_every_group_still_running_and_only_those():
    done = start_session([sys.executable, "-c", "pass"])
    done.wait()
    kill_group(done)  # killed already: forgotten
    leaders = [start_session([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    children = [int(p.stdout.readline()) for p in leaders]  # type: ignore[union-attr]
    assert all(os.getpgid(c) == p.pid for c, p in zip(children, leaders, strict=True))
    assert kill_sessions() >= 2  # (and any an earlier test left)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p.pid) for p in leaders) and not any(alive(pid) for pid in children)
    assert kill_sessions() == 0


def test_a_finished_process_group_is_forgotten(tmp_path):
    cmd = [sys.executable, "-c", "print('hi')"]
    out = run_process_group(cmd, cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "log", timeout_s=30)
    assert out.returncode == 0 and "hi" in out.log_tail
    assert kill_sessions() == 0

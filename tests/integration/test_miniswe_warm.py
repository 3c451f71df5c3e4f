"""mini-swe-agent 2.4.6 in warm workers (fork servers), through a real aitlrt-serve with scripted answers: a warm
rollout sends the model what the CLI sends and leaves the same patch, log and trajectory; the next one reuses the
worker for a fraction of the CLI's start-up; a timed-out rollout is killed with its sandboxed command and the worker
goes on; a worker and its rollout die with their owner."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from aitlrt.common.git import git
from aitlrt.common.workspace import Workspace
from aitlrt.rollout.agents import AgentExit, AgentTask, ModelEndpoint, make_agent
from aitlrt.rollout.agents.mini_swe import MiniSweAgent, miniswe_venv
from aitlrt.rollout.runner import RolloutOutcome, RolloutRequest, RolloutRunner
from tests.conftest import alive, keyed_env
from tests.helpers.processes import processes

BASE = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

pytestmark = pytest.mark.skipif(not (miniswe_venv() / "bin" / "mini").exists(), reason="run jobs/setup.sh first")


@pytest.fixture
def repo(make_repo: Callable[..., Path]) -> tuple[Path, str]:
    src = make_repo({"calc.py": BASE}, name="src")
    return src, git("rev-parse", "HEAD", cwd=src).strip()


@pytest.fixture(scope="module")
def agent() -> Iterator[MiniSweAgent]:
    """The default ``mini-swe-agent``: warm workers, shared by this module's rollouts."""
    warm = make_agent("mini-swe-agent", max_calls=3)
    assert isinstance(warm, MiniSweAgent) and warm.warm
    yield warm
    warm.close()


@dataclass
class Keeping:
    """An agent that keeps each rollout's trajectory file (the runner removes the workspace after the rollout)."""

    agent: MiniSweAgent
    name: str = "keeping"
    trajectories: dict[str, Any] = field(default_factory=dict)

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        exit = self.agent.run(task, ws, endpoint, timeout_s)
        trajectory = ws.scratch / "trajectory.json"
        self.trajectories[endpoint.base_url] = json.loads(trajectory.read_text()) if trajectory.exists() else None
        return exit


def script(upstream: str, match: str, command: str) -> None:
    """Every later call whose messages contain ``match`` is answered with ``command`` in its text format."""
    reply = f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"
    httpx.post(f"{upstream}/script", json={"match": match, "reply": reply}).raise_for_status()


def messages(outcome: RolloutOutcome) -> list[list[tuple[str, str]]]:
    """Each call's messages as the model got them (role, content)."""
    return [[(m["role"], m["content"]) for m in c["request"]["messages"]] for c in outcome.trace]


def outside_the_model(outcome: RolloutOutcome) -> float:
    return outcome.timings["agent_s"] - sum(c["ended_at"] - c["started_at"] for c in outcome.trace)


def sleepers(sleeper: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", sleeper], capture_output=True, text=True).stdout
    return [pid for pid in map(int, out.split()) if alive(pid)]


def eventually(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    start = time.monotonic()
    while not (found := check()):
        assert time.monotonic() - start < timeout_s, f"{what} after {timeout_s:.0f}s"
        time.sleep(0.1)
    return found


def test_a_warm_rollout_is_the_clis_and_the_next_reuses_its_worker(
    repo, scripted_upstream, start_proxy, agent, tmp_path, record_property
):
    src, base = repo
    mark = f"WARM{uuid.uuid4().hex[:8]}"
    proxy = start_proxy(scripted_upstream)
    script(scripted_upstream, mark, f"printf '{FIXED}' > calc.py && echo {mark}-EDITED-$((2+3))")
    script(scripted_upstream, f"{mark}-EDITED-5", SUBMIT)
    task = AgentTask("warm", f"{mark}: fix add() in calc.py")
    cold, warm = Keeping(MiniSweAgent(step_limit=3, warm=False)), Keeping(agent)
    outs, workers = {}, {}
    for name, keeping in (("cli", cold), ("warm", warm), ("warm-again", warm)):
        with RolloutRunner(keeping, proxy.url, "scripted", workspaces=tmp_path / name, timeout_s=120,
                           max_calls=3) as runner:  # fmt: skip
            (outs[name],) = runner.run([RolloutRequest(f"{name}-{mark}", task, src, base)])
        workers[name] = list(agent._all)
    for name, out in outs.items():
        assert out.status == "ok" and out.calls == 2, (name, out.status, out.reason, out.log_tail[-3000:])
        assert out.patch == outs["cli"].patch and "+    return a + b" in out.patch
        assert "\nisolation: bwrap" in out.log_tail[-200:], out.log_tail[-500:]  # appended after the agent's exit
        assert messages(out) == messages(outs["cli"])  # what the model was sent, observations included
    assert workers["cli"] == [] and len(workers["warm"]) == 1 and workers["warm-again"] == workers["warm"]
    trajectories = [*cold.trajectories.values(), *warm.trajectories.values()]
    assert len(trajectories) == 3 and {t["info"]["exit_status"] for t in trajectories} == {"Submitted"}
    assert len({json.dumps([(m["role"], m["content"]) for m in t["messages"]]) for t in trajectories}) == 1
    overhead = {name: round(outside_the_model(out), 3) for name, out in outs.items()}
    print(f"seconds outside the model per rollout: {overhead}")
    record_property("overhead_s", overhead)
    assert overhead["warm-again"] < overhead["cli"] / 3, overhead  # the CLI imports litellm: 4-14 s here


def test_a_timed_out_warm_rollout_is_killed_with_its_command_and_the_worker_goes_on(
    repo, scripted_upstream, start_proxy, agent, tmp_path
):
    src, base = repo
    mark = f"HUNG{uuid.uuid4().hex[:8]}"
    proxy = start_proxy(scripted_upstream)
    sleeper = f"sleep {600 + int(mark[4:10], 16) % 9000}.5"
    script(scripted_upstream, mark, sleeper)  # a command outlasting the rollout (commands may run 60 s)
    script(scripted_upstream, f"{mark}-NEXT", SUBMIT)
    if not agent._all:
        agent.prestart(1, wait=True)
    (worker,) = agent._all
    hung = RolloutRequest(f"hung-{mark}", AgentTask("hung", f"{mark}: wait"), src, base)
    with (
        RolloutRunner(agent, proxy.url, "scripted", workspaces=tmp_path / "ws", timeout_s=10) as runner,
        ThreadPoolExecutor(1) as pool,
    ):
        future = pool.submit(runner.run, [hung])
        eventually(lambda: sleepers(sleeper), 10, "the sandboxed command never ran")
        (child,) = processes(ppid=worker.proc.pid)
        (out,) = future.result()
    assert out.status == "timeout" and out.calls == 1, (out.status, out.reason, out.log_tail[-3000:])
    assert "isolation: bwrap" in out.log_tail
    assert not alive(child) and processes(session=child) == [] and sleepers(sleeper) == []
    assert agent._all == [worker] and worker.alive(), "the worker did not survive its rollout's timeout"

    nxt = RolloutRequest(f"next-{mark}", AgentTask("next", f"{mark}-NEXT: submit"), src, base)
    with RolloutRunner(agent, proxy.url, "scripted", workspaces=tmp_path / "ws2", timeout_s=60) as runner:
        (out,) = runner.run([nxt])
    assert out.status == "no_patch" and out.calls == 1, (out.status, out.reason, out.log_tail[-3000:])
    assert agent._all == [worker]
    agent.close()
    assert agent._all == [] and not alive(worker.proc.pid) and processes(ppid=worker.proc.pid) == []


OWNER = """
import sys
from pathlib import Path
from aitlrt.rollout.agents import AgentTask, make_agent
from aitlrt.rollout.runner import RolloutRequest, RolloutRunner

proxy, src, base, ws, mark = sys.argv[1:]
with RolloutRunner(make_agent("mini-swe-agent", max_calls=2), proxy, "scripted", workspaces=Path(ws)) as runner:
    runner.run([RolloutRequest("owner-" + mark, AgentTask("owner", mark + ": wait"), Path(src), base)])
"""


def test_a_worker_and_its_rollout_die_with_their_owner(repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    mark = f"OWNER{uuid.uuid4().hex[:8]}"
    proxy = start_proxy(scripted_upstream)
    sleeper = f"sleep {600 + int(mark[5:11], 16) % 9000}.5"
    script(scripted_upstream, mark, sleeper)
    with open(tmp_path / "owner.log", "wb") as log:
        owner = subprocess.Popen(
            [sys.executable, "-c", OWNER, proxy.url, str(src), base, str(tmp_path / "ws"), mark],
            env=keyed_env(proxy.url),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        eventually(lambda: sleepers(sleeper), 120, "the owner's rollout never ran its command")
        (worker,) = processes(ppid=owner.pid, marker="miniswe_worker.py")
        (child,) = processes(ppid=worker)
    finally:
        owner.kill()  # SIGKILL: no finally block, no close()
        owner.wait()
    eventually(lambda: not alive(worker), 5, "the worker outlived its owner")
    eventually(lambda: not alive(child) and not sleepers(sleeper), 5, "the rollout outlived its worker")
    assert processes(session=child) == []

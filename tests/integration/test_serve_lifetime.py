"""A managed ``aitlrt-serve`` dies with the process that started it (a SIGKILLed trainer), and its vLLM dies with it:
a SIGKILLed proxy (the OOM killer, a scheduler) takes vLLM's whole process group along, engine cores included (they
do not watch their parent); ``--upstream`` leaves a vLLM it did not start alone, and a new proxy re-attaches to it.
A run stopped mid-rollout (one process, or two training ranks under torchrun) takes its agents along.

Stand-in vLLMs (a script as ``VLLMServer``'s python, with a grandchild like vLLM's EngineCore) for the
mechanics, and one real vLLM CPU server for the real thing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from aitlrt.common.procs import free_port
from aitlrt.serving.process import ServeProcess
from aitlrt_server.upstream import GUARD_GRACE_S, VLLMServer
from tests.conftest import admin, alive, chat, keyed_env
from tests.helpers.processes import processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# Takes the place of `python -m vllm.entrypoints.openai.api_server ... --port P`: serves GET /health and starts an
# "engine" grandchild that does not watch its parent (FAKE_STUBBORN: it ignores SIGTERM too); writes both pids.
FAKE_VLLM = """#!{python}
import http.server, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
engine = "import os, signal, time\\nif os.environ.get('FAKE_STUBBORN'): signal.signal(signal.SIGTERM, signal.SIG_IGN)"
child = subprocess.Popen([sys.executable, "-c", engine + "\\ntime.sleep(600)"])
with open(os.environ["FAKE_DIR"] + "/pids.tmp", "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}}")
os.rename(os.environ["FAKE_DIR"] + "/pids.tmp", os.environ["FAKE_DIR"] + "/pids")

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

# Takes the place of aitlrt-serve: starts the stand-in through VLLMServer, says "ready", then waits to be killed.
PARENT = """
import sys, time
from pathlib import Path
from aitlrt_server.upstream import VLLMServer
server = VLLMServer("m", python=sys.argv[1], port=int(sys.argv[2]), log_path=Path(sys.argv[3]))
server.start()
server.wait_healthy(60)
print("ready", flush=True)
time.sleep(600)
"""

# Takes the place of a trainer: starts aitlrt-serve --upstream URL through ServeProcess, prints its pid and port.
TRAINER = """
import sys, time
from pathlib import Path
from aitlrt.common.procs import free_port
from aitlrt.serving.process import ServeProcess
port = free_port()
serve = ServeProcess(["--upstream", sys.argv[1], "--run-dir", sys.argv[2]], port, Path(sys.argv[2]) / "serve.log")
serve.start()
serve.wait_ready(60)
print(serve.proc.pid, port, flush=True)
time.sleep(600)
"""


def group(pgid: int) -> list[int]:
    """The live processes of a process group."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def eventually(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, f"{what} after {timeout_s:.0f}s"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_VLLM.format(python=sys.executable))
    path.chmod(0o755)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    return path


@pytest.fixture
def cleanup() -> Iterator[list[int]]:
    """Process groups to SIGKILL after the test, whatever it asserted."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        for pid in group(pgid):
            os.kill(pid, signal.SIGKILL)


def fake_pids(tmp_path: Path) -> tuple[int, int]:
    eventually((tmp_path / "pids").exists, 30, "the stand-in never wrote its pids")
    api, engine = map(int, (tmp_path / "pids").read_text().split())
    return api, engine


@pytest.mark.parametrize("stubborn", [False, True], ids=["engine-stops-on-sigterm", "engine-ignores-sigterm"])
def test_a_sigkilled_parent_takes_the_whole_vllm_group_along(
    fake_vllm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleanup: list[int], stubborn: bool
):
    if stubborn:
        monkeypatch.setenv("FAKE_STUBBORN", "1")
    port = free_port()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(fake_vllm), str(port), str(tmp_path / "vllm.log")],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
    api, engine = fake_pids(tmp_path)
    pgid = os.getpgid(api)
    cleanup.append(pgid)
    assert port_open(port) and alive(engine) and os.getpgid(engine) == pgid

    parent.kill()  # SIGKILL: nothing runs in the parent any more
    parent.wait()
    took = eventually(lambda: not group(pgid), GUARD_GRACE_S + 10, "vLLM's process group outlived its parent")
    assert not alive(api) and not alive(engine) and not port_open(port)
    assert took < (GUARD_GRACE_S + 5 if stubborn else 5)
    assert "aitlrt-serve is gone: stopping vLLM" in (tmp_path / "vllm.log").read_text()


def test_a_sigkilled_trainer_takes_its_aitlrt_serve_along(scripted_upstream: str, tmp_path: Path, cleanup: list[int]):
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, scripted_upstream, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert trainer.stdout is not None
    pid, port = map(int, trainer.stdout.readline().split())
    cleanup.append(pid)  # the group's id
    assert alive(pid) and port_open(port)

    trainer.kill()  # SIGKILL: nothing runs in the trainer any more
    trainer.wait()
    eventually(lambda: not alive(pid), 10, "aitlrt-serve outlived its trainer")
    assert not port_open(port)
    assert httpx.get(f"{scripted_upstream}/health", timeout=5).status_code == 200  # --upstream: not ours to stop


def test_vllm_exit_status_reads_the_same_and_its_engine_is_stopped(fake_vllm: Path, tmp_path: Path, cleanup):
    """vLLM dying on its own (here SIGKILLed, as by the OOM killer): the status VLLMServer reports is vLLM's, and the
    engine it leaves behind is stopped."""
    server = VLLMServer("m", python=str(fake_vllm), port=free_port(), log_path=tmp_path / "vllm.log")
    server.start()
    assert server.proc is not None
    cleanup.append(server.proc.pid)
    server.wait_healthy(60)
    api, engine = fake_pids(tmp_path)
    os.kill(api, signal.SIGKILL)
    assert server.proc.wait(10) == -signal.SIGKILL
    eventually(lambda: not alive(engine), 5, "the orphaned engine still runs")
    server.stop()


def test_stop_ends_the_group_even_a_stubborn_engine(fake_vllm, tmp_path: Path, monkeypatch, cleanup):
    monkeypatch.setenv("FAKE_STUBBORN", "1")
    server = VLLMServer("m", python=str(fake_vllm), port=free_port(), log_path=tmp_path / "vllm.log")
    server.start()
    assert server.proc is not None
    pgid = server.proc.pid
    cleanup.append(pgid)
    server.wait_healthy(60)
    fake_pids(tmp_path)  # both started
    server.stop(grace_s=2)
    assert server.proc.returncode == -signal.SIGTERM  # vLLM's own status, as before the guard
    eventually(lambda: not group(pgid), 5, "stop() left processes running")


def test_a_sigkilled_upstream_proxy_leaves_vllm_to_the_next_one(scripted_upstream: str, start_proxy):
    first = start_proxy(scripted_upstream)
    assert first.proc is not None
    first.kill()  # SIGKILL
    assert httpx.get(f"{scripted_upstream}/health", timeout=5).status_code == 200  # not ours to stop
    again = start_proxy(scripted_upstream)
    assert chat(again.url, "reattached-1", "hi").status_code == 200


def test_real_vllm_dies_with_a_sigkilled_aitlrt_serve(model_dir: Path, tmp_path: Path, start_proxy, cleanup):
    """aitlrt-serve --model (a real vLLM on CPU), a second aitlrt-serve --upstream on that vLLM: SIGKILL the second,
    vLLM serves on; SIGKILL the first, vLLM's port closes and its processes, engine core included, are gone."""
    import psutil

    vllm_port = free_port()
    serve = ServeProcess(
        ["--model", str(model_dir), "--run-dir", str(tmp_path), "--vllm-port", str(vllm_port), "--enforce-eager"],
        port=free_port(),
        log_path=tmp_path / "serve.log",
    )
    serve.start()
    assert serve.proc is not None
    try:
        serve.wait_ready(timeout_s=300)
        (guard,) = psutil.Process(serve.proc.pid).children()
        cleanup.append(guard.pid)  # the group's id
        vllm_pids = [p.pid for p in guard.children(recursive=True)]
        assert any("EngineCore" in psutil.Process(pid).name() for pid in vllm_pids), vllm_pids

        attached = start_proxy(f"http://127.0.0.1:{vllm_port}")
        attached.kill()
        time.sleep(1)
        assert port_open(vllm_port) and all(alive(pid) for pid in vllm_pids)
        attached = start_proxy(f"http://127.0.0.1:{vllm_port}")  # re-attaches (start_proxy waits for a 200 /health)
        assert httpx.get(f"{attached.url}/health", timeout=10).json()["status"] == "ok"
        state = httpx.get(f"{attached.url}/weights", headers=admin(attached.url), timeout=10).json()
        assert state["upstream"] == f"http://127.0.0.1:{vllm_port}"

        serve.kill()  # SIGKILL
        eventually(lambda: not port_open(vllm_port), 30, "vLLM's port still open")
        eventually(lambda: not group(guard.pid), 30, "vLLM processes outlived aitlrt-serve")
        assert not any(alive(pid) for pid in vllm_pids)
    finally:
        serve.stop()


def inflight(proxy_url: str) -> float:
    """aitlrt-serve's count of model calls in flight (its Prometheus gauge)."""
    text = httpx.get(f"{proxy_url}/metrics", headers=admin(proxy_url), timeout=5).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("aitlrt_inflight ")))


def test_sigterm_lets_aitlrt_serve_stop_with_calls_in_flight(scripted_upstream: str, start_proxy):
    """A stopping proxy gives a call in flight SHUTDOWN_GRACE_S, not as long as the call would take (uvicorn's own
    graceful shutdown waits for every connection: a trainer's SIGTERM left aitlrt-serve and its vLLM running)."""
    from concurrent.futures import ThreadPoolExecutor

    from aitlrt_server.cli import SHUTDOWN_GRACE_S

    proxy = start_proxy(scripted_upstream)
    assert proxy.proc is not None
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(chat, proxy.url, "slow-1", "fault:slow:120")
        eventually(lambda: inflight(proxy.url) == 1, 30, "the call never reached the proxy")
        started = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        proxy.proc.wait(SHUTDOWN_GRACE_S + 20)
        took = time.monotonic() - started
        with pytest.raises(httpx.HTTPError):  # cut, not answered
            call.result().raise_for_status()
    assert SHUTDOWN_GRACE_S - 1 < took < SHUTDOWN_GRACE_S + 10, took


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_run_stopped_mid_rollout_takes_its_agents_along(
    scripted_upstream: str, start_proxy, make_repo, tmp_path: Path, cleanup: list[int], sig: int
):
    """``aitlrt eval`` (as training: the same runner and warm Aider workers) stopped while its agents wait on the
    model: SIGTERM (kill, scancel) stops the agents and ends the run at once, through its ``finally`` blocks, not
    after the rollouts' timeout; SIGKILL (the OOM killer) leaves no agent behind to call the model or edit on."""
    from aitlrt.rollout.agents.aider import aider_venv

    if not (aider_venv() / "bin" / "python").exists():
        pytest.skip("run jobs/setup.sh first")
    proxy = start_proxy(scripted_upstream)
    repo = make_repo({"calc.py": "def add(a, b):\n    return a - b\n"})
    row = {"instance_id": "slow-1", "problem_statement": "fault:slow:300", "repo_path": str(repo), "files": ["calc.py"]}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(row) + "\n")
    cmd = [sys.executable, "-m", "aitlrt.cli", "eval", "--tasks", str(tasks), "--proxy", proxy.url]
    cmd += ["--checkpoint", "served", "--agent", "aider-warm", "--n", "2", "--timeout", "600"]
    with open(tmp_path / "eval.log", "wb") as log:
        env = keyed_env(proxy.url)  # a server it did not start: its key from the environment
        run = subprocess.Popen(
            [*cmd, "--out-dir", str(tmp_path / "eval")], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    cleanup.append(run.pid)
    eventually(lambda: inflight(proxy.url) == 2, 120, "the agents never called the model")
    workers = processes(ppid=run.pid, marker="aider_worker.py")
    cleanup.extend(workers)  # each leads its own group
    assert len(workers) == 2

    started = time.monotonic()
    run.send_signal(sig)
    code = run.wait(60)
    eventually(lambda: not any(alive(pid) for pid in workers), 10, "an Aider worker outlived its run")
    took = time.monotonic() - started
    log_text = (tmp_path / "eval.log").read_text()
    if sig == signal.SIGTERM:
        assert code == 143, log_text[-3000:]
        assert "interrupted: stopped 2 agent process(es)" in log_text
    assert took < 15, took
    assert httpx.get(f"{proxy.url}/health", timeout=5).status_code == 200  # --proxy: not the run's to stop


def test_sigterm_stops_a_two_rank_training_run_and_its_agents(
    scripted_upstream: str, start_proxy, make_repo, tmp_path: Path, cleanup: list[int]
):
    """``kill`` (or a scheduler) stopping a two-rank training run (torchrun, CPU/gloo, as ``accelerate launch``
    runs it) while the agents of both ranks wait on the model: the launcher passes SIGTERM to each rank, each stops
    its own agents through its ``finally`` and the run ends within seconds, not after the rollouts' timeout, with
    no Aider worker left to call the model or edit on."""
    from aitlrt.rollout.agents.aider import aider_venv

    if not (aider_venv() / "bin" / "python").exists():
        pytest.skip("run jobs/setup.sh first")
    sampling = ["--temperature", "1.0", "--top-p", "1.0", "--top-k", "-1", "--max-tokens", "512"]  # trl's defaults
    proxy = start_proxy(scripted_upstream, *sampling)  # the trainer checks them before it rolls out
    repo = make_repo({"calc.py": "def add(a, b):\n    return a - b\n"})
    slow = {"problem_statement": "fault:slow:300", "repo_path": str(repo), "files": ["calc.py"]}
    rows = [{"instance_id": f"slow-{k}", **slow} for k in range(2)]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += [str(root / "aitlrt" / "train.py"), "--model_name_or_path", "bundled", "--tasks", str(tasks)]
    cmd += ["--serve", proxy.url, "--output_dir", str(tmp_path / "run"), "--max_steps", "2", "--save_strategy", "no"]
    cmd += ["--per_device_train_batch_size", "2", "--num_generations", "4", "--weight_probe", "false"]
    cmd += ["--report_to", "none", "--rollout_timeout_s", "600", "--rollout_concurrency", "2"]
    log_path = tmp_path / "train.log"
    with open(log_path, "wb") as log:
        env = keyed_env(proxy.url)  # the ranks get the admin key as a jobscript's trainer does
        run = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root, env=env)
    cleanup.append(run.pid)
    eventually(lambda: inflight(proxy.url) == 4 or run.poll() is not None, 300, "the agents never called the model")
    assert run.poll() is None, log_path.read_text()[-5000:]
    ranks = processes(ppid=run.pid, marker="train.py")
    workers = [pid for rank in ranks for pid in processes(ppid=rank, marker="aider_worker.py")]
    cleanup.extend(workers)  # each leads its own group
    assert len(ranks) == 2 and len(workers) == 4, (ranks, workers)

    started = time.monotonic()
    run.send_signal(signal.SIGTERM)
    code = run.wait(120)
    eventually(lambda: not any(alive(pid) for pid in workers), 10, "an Aider worker outlived its run")
    took = time.monotonic() - started
    log_text = log_path.read_text()
    assert code != 0, log_text[-3000:]
    assert log_text.count("interrupted: stopped 2 agent process(es)") == 2, log_text[-5000:]  # one per rank
    assert took < 15, took
    assert not any(alive(rank) for rank in ranks)

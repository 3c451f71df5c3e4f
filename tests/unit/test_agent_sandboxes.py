"""The sandboxes of agents' shells (``shell_sandbox``: each command of mini-swe-agent) and of whole CLI agents
(``agent_sandbox``: ``agent: command``), run for real with bubblewrap."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from aitlrt.tasks.sandbox import agent_sandbox, shell_sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (jobs/setup.sh)")


def run(prefix: tuple[str, ...], cwd: Path, script: str) -> str:
    return subprocess.run([*prefix, "bash", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=60).stdout


def test_a_shell_command_writes_its_workspace_only_and_reaches_nothing(tmp_path: Path):
    workspace, other = tmp_path / "ws" / "repo", tmp_path / "other"
    workspace.mkdir(parents=True)
    other.mkdir()
    (other / "secret").write_text("s")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        prefix, isolation = shell_sandbox(workspace, timeout_s=5)
        out = run(
            prefix,
            workspace,
            f"""
            echo edit > file && echo workspace=ok
            cat {other}/secret 2>/dev/null || echo other=hidden
            touch {Path.home()}/.aitlrt-escape 2>/dev/null || echo home=read-only
            (exec 3<>/dev/tcp/127.0.0.1/{server.getsockname()[1]}) 2>/dev/null || echo loopback=unreachable
            ulimit -v
        """,
        )
    assert isolation == "bwrap" and prefix[0].endswith("prlimit")
    lines = out.split()
    assert lines[:4] == ["workspace=ok", "other=hidden", "home=read-only", "loopback=unreachable"], out
    assert int(lines[4]) == 8 << 20  # KiB: the graded tests' 8 GiB
    assert (workspace / "file").read_text() == "edit\n" and not (Path.home() / ".aitlrt-escape").exists()


def test_a_whole_agent_reaches_the_host_network_and_writes_its_own_folders(tmp_path: Path):
    workspace, home, venv, other = (tmp_path / name for name in ("repo", "home", "venv", "other"))
    for folder in (workspace, home, venv, other):
        folder.mkdir()
    (venv / "tool").write_text("t")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        prefix, isolation = agent_sandbox(workspace, private=[home], binds=[venv])
        out = run(
            prefix,
            workspace,
            f"""
            (exec 3<>/dev/tcp/127.0.0.1/{server.getsockname()[1]}) && echo proxy=reached
            touch {home}/state && echo home=writable
            cat {venv}/tool >/dev/null && echo venv=readable
            touch {venv}/x 2>/dev/null || echo venv=read-only
            ls {other} 2>/dev/null || echo other=hidden
        """,
        )
    assert isolation.startswith("bwrap (network shared")
    assert out.split() == ["proxy=reached", "home=writable", "venv=readable", "venv=read-only", "other=hidden"], out


ENV_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from aitlrt_shell import SandboxedEnvironment
env = SandboxedEnvironment(**json.loads(sys.argv[2]))
print(json.dumps([env.execute({"command": c})["output"] for c in json.loads(sys.argv[3])]))
"""


def test_only_the_exact_test_alias_runs_the_feedback_program_outside_the_sandbox(tmp_path: Path):
    """mini-swe-agent's ``run-tests``: the trusted feedback argv runs as given (here a stand-in that prints where it
    runs); any other text, the alias with more on the line included, runs in the sandbox like every command."""
    from aitlrt.rollout.agents.mini_swe import ENV_DIR, miniswe_venv

    python = miniswe_venv() / "bin" / "python"
    if not python.exists():
        pytest.skip("run jobs/setup.sh first (mini-swe-agent's venv)")
    workspace, trusted = tmp_path / "repo", tmp_path / "trusted"
    workspace.mkdir()
    trusted.mkdir()
    (trusted / "feedback.sh").write_text(f"echo feedback in $PWD; echo ran > {trusted}/marker\n")
    prefix, _ = shell_sandbox(workspace, timeout_s=5)
    config = {"cwd": str(workspace), "sandbox": list(prefix), "test_command": ["bash", str(trusted / "feedback.sh")]}
    commands = ["run-tests", f"run-tests; cat {trusted}/feedback.sh || echo hidden", "  run-tests\n"]
    done = subprocess.run(
        [str(python), "-c", ENV_SCRIPT, str(ENV_DIR), json.dumps(config), json.dumps(commands)],
        capture_output=True, text=True, timeout=60, env={"MSWEA_SILENT_STARTUP": "1", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, injected, spaced = json.loads(done.stdout)
    assert first == spaced == f"feedback in {workspace}\n"
    assert "hidden" in injected and "echo feedback" not in injected, "the longer line ran sandboxed, trusted/ unseen"
    assert (trusted / "marker").read_text() == "ran\n"

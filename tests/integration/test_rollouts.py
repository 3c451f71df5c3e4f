"""Rollouts with real agents (Aider from its own venv, and our single-call agent) through a real aitlrt-serve:
against the scripted upstream for exact edits and faults, and against the real vLLM CPU server."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aitlrt.common.git import git
from aitlrt.common.procs import free_port, run_process_group
from aitlrt.common.workspace import Workspace
from aitlrt.rollout.agents.aider import AiderAgent, WarmAiderAgent, aider_venv
from aitlrt.rollout.agents.base import AgentExit, AgentTask, ModelEndpoint
from aitlrt.rollout.agents.single_call import SingleCallAgent
from aitlrt.rollout.runner import RolloutOutcome, RolloutRequest, RolloutRunner
from tests.conftest import keyed_env

BASE = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"

pytestmark = pytest.mark.skipif(not (aider_venv() / "bin" / "aider").exists(), reason="run jobs/setup.sh first")


@pytest.fixture
def repo(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "calc.py").write_text(BASE)
    git("init", "-q", cwd=src)
    git("add", "-A", cwd=src)
    git("commit", "-q", "-m", "base", cwd=src)
    return src, git("rev-parse", "HEAD", cwd=src).strip()


def expected_patch(tmp_path, src, base, files: dict[str, str]) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    check = tmp_path / "expected"
    git("clone", "-q", src, check, cwd=tmp_path)
    git("checkout", "-q", base, cwd=check)
    for name, content in files.items():
        (check / name).write_text(content)
    git("add", "-A", cwd=check)
    return git("diff", "--cached", "--binary", base, cwd=check)


def script(upstream: str, match: str, reply: str) -> None:
    httpx.post(f"{upstream}/script", json={"match": match, "reply": reply}).raise_for_status()


def agent_processes() -> int:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(str(aider_venv()) in line or "aitlrt.rollout.agents.single_call" in line for line in out.splitlines())


def rollouts(agent, proxy_url, tmp_path, requests, **kw) -> list[RolloutOutcome]:
    """Run ``requests`` with a runner of their own, closed afterwards (its idle workspaces removed)."""
    with RolloutRunner(agent, proxy_url, kw.pop("model", "scripted"), workspaces=tmp_path / "ws", **kw) as runner:
        return runner.run(requests)


WHOLE_REPLY = f"calc.py\n```python\n{FIXED}```\n\nNOTES.md\n```\nadd was wrong\n```\n"
DIFF_REPLY = (
    "calc.py\n```python\n<<<<<<< SEARCH\ndef add(a, b):\n    return a - b\n=======\n"
    "def add(a, b):\n    return a + b\n>>>>>>> REPLACE\n```\n\n"
    "NOTES.md\n```\n<<<<<<< SEARCH\n=======\nadd was wrong\n>>>>>>> REPLACE\n```\n"
)


@pytest.mark.parametrize(("edit_format", "reply"), [("whole", WHOLE_REPLY), ("diff", DIFF_REPLY)])
def test_aider_applies_a_known_edit_exactly(edit_format, reply, repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    marker = f"TASK-{edit_format}-edit"
    script(scripted_upstream, marker, reply)
    task = AgentTask("t1", f"{marker}: fix add() in calc.py and write NOTES.md", ("calc.py",))
    (out,) = rollouts(
        AiderAgent(edit_format=edit_format),
        proxy.url,
        tmp_path,
        [RolloutRequest(f"edit-{edit_format}", task, src, base)],
        timeout_s=120,
    )
    assert out.status == "ok", (out.reason, out.log_tail)
    assert out.patch == expected_patch(tmp_path, src, base, {"calc.py": FIXED, "NOTES.md": "add was wrong\n"})
    assert out.calls >= 1 and all(c["completion_token_ids"] for c in out.trace if c["status"] == 200)
    assert list((tmp_path / "ws").iterdir()) == []


RULES = "# *SEARCH/REPLACE block* Rules:"


@pytest.mark.parametrize("reminder", ["user", "none"])
def test_aider_reminder_setting_shapes_the_request(reminder, repo, scripted_upstream, start_proxy, tmp_path):
    """Aider repeats the diff format's rules in the last user message by default; ``none`` leaves them to the
    system prompt alone, and the edit still applies."""
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    marker = f"TASK-reminder-{reminder}"
    script(scripted_upstream, marker, DIFF_REPLY)
    task = AgentTask("t1", f"{marker}: fix add() in calc.py and write NOTES.md", ("calc.py",))
    agent = AiderAgent(edit_format="diff", reminder=reminder)
    (out,) = rollouts(agent, proxy.url, tmp_path, [RolloutRequest(f"rem-{reminder}", task, src, base)], timeout_s=120)
    assert out.status == "ok", (out.reason, out.log_tail)
    assert out.patch == expected_patch(tmp_path, src, base, {"calc.py": FIXED, "NOTES.md": "add was wrong\n"})
    messages = out.trace[0]["request"]["messages"]
    assert messages[0]["role"] == "system" and RULES in messages[0]["content"]
    assert messages[-1]["role"] == "user" and marker in messages[-1]["content"]
    assert (RULES in messages[-1]["content"]) == (reminder == "user")


def git_poison(marker) -> str:
    """A config section that would run a command (and forge the patch) when git next diffs in that repository."""
    return f'[diff]\n\texternal = "touch {marker}; echo diff --git a/forged b/forged #"\n'


def attack_reply(edit_format: str, path: str, content: str) -> str:
    """An answer that writes ``content`` to ``path`` and fixes calc.py."""
    if edit_format == "whole":
        return f"{path}\n```\n{content}```\n\ncalc.py\n```python\n{FIXED}```\n"
    return (
        f"{path}\n```\n<<<<<<< SEARCH\n=======\n{content}>>>>>>> REPLACE\n```\n\n"
        "calc.py\n```python\n<<<<<<< SEARCH\ndef add(a, b):\n    return a - b\n=======\n"
        "def add(a, b):\n    return a + b\n>>>>>>> REPLACE\n```\n"
    )


@pytest.mark.parametrize(
    ("agent_class", "edit_format", "attack"),
    [
        (AiderAgent, "whole", "git"),
        (AiderAgent, "diff", "git"),
        (WarmAiderAgent, "whole", "git"),
        (WarmAiderAgent, "diff", "outside"),
        (AiderAgent, "whole", "outside"),
    ],
)
def test_aider_refuses_edits_under_git_or_outside_the_repository(
    agent_class, edit_format, attack, repo, scripted_upstream, start_proxy, tmp_path
):
    """Under ``--yes-always`` Aider itself applies an edit to ``pkg/../.git/config`` (its config then runs a
    command at the next ``git diff``); the CLI and the warm workers run it with ``edit_guard``."""
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    marker, outside = tmp_path / "pwned", tmp_path / "outside.txt"
    path, content, why = {
        "git": ("pkg/../.git/config", git_poison(marker), "it is under .git"),
        "outside": (str(outside), "escaped\n", "it is outside the repository"),
    }[attack]
    tag = f"ATTACK-{agent_class.__name__}-{edit_format}-{attack}"
    script(scripted_upstream, tag, attack_reply(edit_format, path, content))
    task = AgentTask("attack", f"{tag}: fix add() in calc.py", ("calc.py",))
    agent = agent_class(edit_format=edit_format)
    try:
        (out,) = rollouts(agent, proxy.url, tmp_path, [RolloutRequest(f"attack-{attack}", task, src, base)])
    finally:
        if isinstance(agent, WarmAiderAgent):
            agent.close()
    assert out.status == "ok", (out.reason, out.log_tail)
    assert f"Refusing edits to {path}: {why}" in " ".join(out.log_tail.split())  # Aider wraps its lines
    assert out.patch == expected_patch(tmp_path, src, base, {"calc.py": FIXED}), "the fix alone, untouched .git"
    assert not marker.exists() and not outside.exists()


@dataclass
class TamperingAgent:
    """An agent that got past every path check: after one answered call it poisons its ``.git/config``."""

    marker: Path
    name: str = "tampering"

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        body = {"model": endpoint.model, "messages": [{"role": "user", "content": "hello"}]}
        headers = {"Authorization": f"Bearer {endpoint.api_key}"}
        httpx.post(f"{endpoint.base_url}/chat/completions", json=body, headers=headers, timeout=30).raise_for_status()
        with open(ws.repo / ".git" / "config", "a") as f:
            f.write(git_poison(self.marker))
        (ws.repo / "calc.py").write_text(FIXED)
        return AgentExit(0, False, "", 0.0)


def test_a_rollout_that_changed_its_git_directory_has_its_patch_refused(repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    marker = tmp_path / "pwned"
    task = AgentTask("tamper", "anything")
    (out,) = rollouts(TamperingAgent(marker), proxy.url, tmp_path, [RolloutRequest("tamper-1", task, src, base)])
    assert out.status == "no_patch" and out.patch == "" and out.calls == 1
    assert "patch refused: the agent changed .git/config" in out.reason
    assert not marker.exists()


def test_16_concurrent_rollouts_do_not_cross(repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    before = agent_processes()
    requests = []
    for i in range(16):
        script(scripted_upstream, f"MARK{i:02d}X", f"calc.py\n```python\n{FIXED}# rollout {i}\n```\n")
        task = AgentTask(f"task{i}", f"MARK{i:02d}X: fix add()", ("calc.py",))
        requests.append(RolloutRequest(f"conc-{i}", task, src, base))
    outcomes = rollouts(AiderAgent(), proxy.url, tmp_path, requests, concurrency=16, timeout_s=300)
    for i, out in enumerate(outcomes):
        assert out.status == "ok", (i, out.reason, out.log_tail[-1500:])
        assert out.rollout_id == f"conc-{i}" and f"+# rollout {i}\n" in out.patch
        assert all(f"MARK{i:02d}X" in str(c["request"]["messages"]) for c in out.trace)
        assert {c["rollout_id"] for c in out.trace} == {f"conc-{i}"}
    assert list((tmp_path / "ws").iterdir()) == []
    assert agent_processes() == before


def test_timeout_kills_the_agent_and_says_so(repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    before = agent_processes()
    task = AgentTask("slow", "fault:slow:60")
    (out,) = rollouts(SingleCallAgent(), proxy.url, tmp_path, [RolloutRequest("slow-1", task, src, base)], timeout_s=3)
    assert out.status == "timeout" and "killed after 3s" in out.reason
    assert out.timings["total_s"] < 15
    assert agent_processes() == before and list((tmp_path / "ws").iterdir()) == []


def test_call_limit_is_enforced_by_the_proxy(repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    task = AgentTask("limited", "fix add()", ("calc.py",))
    (out,) = rollouts(
        AiderAgent(), proxy.url, tmp_path, [RolloutRequest("limit-1", task, src, base)], max_calls=0, timeout_s=120
    )
    assert out.status == "call_limit", (out.reason, out.log_tail)
    assert "limit of 0 model calls" in out.reason and out.calls == 0
    assert out.timings["agent_s"] < 60, "Aider retried the refusal"


@dataclass
class CrashingAgent:
    """Dies from a signal half-way, as a segfaulting or OOM-killed agent would."""

    name: str = "crashing"

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        code = "import os, pathlib; pathlib.Path('half.txt').write_text('x'); os.kill(os.getpid(), 9)"
        return run_process_group(
            [sys.executable, "-c", code], cwd=ws.repo, env={}, log_path=ws.scratch / "log", timeout_s=timeout_s
        )


def test_crash_and_proxy_down_are_failed_rollouts_with_reasons(repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    task = AgentTask("t", "anything")
    (crashed,) = rollouts(CrashingAgent(), proxy.url, tmp_path, [RolloutRequest("crash-1", task, src, base)])
    assert crashed.status == "crashed" and "code -9" in crashed.reason
    assert "half.txt" in crashed.patch, "what the agent did before dying is still reported"

    down = f"http://127.0.0.1:{free_port()}"
    (out,) = rollouts(SingleCallAgent(), down, tmp_path, [RolloutRequest("down-1", task, src, base)], timeout_s=30)
    assert out.status == "agent_error" and "ConnectError" in out.reason
    assert list((tmp_path / "ws").iterdir()) == []


def test_no_call_answered_is_an_agent_error(repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    task = AgentTask("err", "fault:error400")
    (out,) = rollouts(SingleCallAgent(), proxy.url, tmp_path, [RolloutRequest("err-1", task, src, base)])
    assert out.status == "agent_error" and "scripted bad request" in out.reason


def test_real_aider_on_the_real_vllm_server(repo, served, tmp_path):
    src, base = repo
    task = AgentTask("real", "Fix the bug in add() in calc.py: it must return a + b.", ("calc.py",))
    model = served.model_dir.name
    (out,) = rollouts(
        AiderAgent(),
        served.url,
        tmp_path,
        [RolloutRequest("real-aider-1", task, src, base)],
        model=model,
        timeout_s=400,
    )
    assert out.status in ("ok", "no_patch"), (out.status, out.reason, out.log_tail[-2000:])
    policy = [c for c in out.trace if c["status"] == 200 and c["tag"] is None]
    assert policy and all(len(c["completion_token_ids"]) == len(c["logprobs"]) > 0 for c in policy)
    if out.patch:
        check = tmp_path / "check"
        git("clone", "-q", src, check, cwd=tmp_path)
        subprocess.run(["git", "apply", "--check", "-"], input=out.patch.encode(), cwd=check, check=True)
    assert list((tmp_path / "ws").iterdir()) == []


def test_warm_workers_edit_like_the_cli_are_reused_and_replaced_after_a_timeout(
    repo, scripted_upstream, start_proxy, tmp_path
):
    src, base = repo
    proxy = start_proxy(scripted_upstream)
    agent = WarmAiderAgent()
    try:
        requests = []
        for i in range(3):
            script(scripted_upstream, f"WARM{i}X", f"calc.py\n```python\n{FIXED}# warm {i}\n```\n")
            requests.append(
                RolloutRequest(f"warm-{i}", AgentTask(f"w{i}", f"WARM{i}X: fix add()", ("calc.py",)), src, base)
            )
        outcomes = rollouts(agent, proxy.url, tmp_path, requests, concurrency=1, timeout_s=120)
        for i, out in enumerate(outcomes):
            assert out.status == "ok", (out.reason, out.log_tail)
            assert out.patch == expected_patch(tmp_path / f"e{i}", src, base, {"calc.py": f"{FIXED}# warm {i}\n"})
        assert len(agent._all) == 1, "one worker served all three rollouts"
        first = agent._all[0]

        slow = RolloutRequest("warm-slow", AgentTask("slow", "fault:slow:60", ("calc.py",)), src, base)
        (out,) = rollouts(agent, proxy.url, tmp_path, [slow], concurrency=1, timeout_s=8)
        assert out.status == "timeout" and first.proc.poll() is not None and agent._all == []

        (again,) = rollouts(agent, proxy.url, tmp_path, [requests[0]], concurrency=1, timeout_s=120)
        assert again.status == "ok" and len(agent._all) == 1 and agent._all[0] is not first
    finally:
        agent.close()
    assert agent._all == [] and list((tmp_path / "ws").iterdir()) == []


def test_rollout_cli_runs_tasks_and_reports_bad_rows(repo, scripted_upstream, start_proxy, tmp_path):
    src, _ = repo
    proxy = start_proxy(scripted_upstream)
    script(scripted_upstream, "CLIFIX", f"calc.py\n```python\n{FIXED}```\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps(
            {
                "instance_id": "calc-1",
                "problem_statement": "CLIFIX: fix add()",
                "repo_path": str(src),
                "files": ["calc.py"],
            }
        )
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "aitlrt.cli",
        "rollout",
        "--tasks",
        str(tasks),
        "--n",
        "2",
        "--proxy",
        proxy.url,
        "--agent",
        "single-call",
        "--out",
        str(out),
        "--rewards",
        "non_empty_patch,patch_similarity",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=keyed_env(proxy.url))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "statuses: ok=2" in done.stdout
    assert "rollouts 2/2 done, 0 running | 2 with a patch, 0 failed outside the policy" in done.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"] and all("+    return a + b" in r["patch"] for r in rows)
    assert all(len(r["trace"]) == 1 for r in rows)
    # The row has no oracle patch: similarity 0; the patch is non-empty and applies.
    assert [r["rewards"] for r in rows] == [{"non_empty_patch": 1.0, "patch_similarity": 0.0}] * 2

    tasks.write_text(tasks.read_text() + json.dumps({"instance_id": "broken-7", "problem_statement": "x"}) + "\n")
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=keyed_env(proxy.url))
    assert bad.returncode == 0 and "statuses: ok=2" in bad.stdout, bad.stdout + bad.stderr
    assert "skipping bad row" in bad.stderr and "tasks.jsonl:2 (task broken-7): no repository source" in bad.stderr


def test_a_batch_run_from_library_code_logs_its_progress(repo, scripted_upstream, start_proxy, caplog):
    """``run_batch`` without ``on_progress`` (the held-out evaluations, the warm start, the benches) logs the
    progress line (``log_progress``); here at the end, as the batch takes under its 30 s."""
    from aitlrt.rollout.batch import PreparedTask, RolloutSettings, run_batch
    from aitlrt.tasks.task import task_from_row

    src, base = repo
    proxy = start_proxy(scripted_upstream)
    script(scripted_upstream, "LIBFIX", f"calc.py\n```python\n{FIXED}```\n")
    row = {"instance_id": "calc-1", "problem_statement": "LIBFIX: fix add()", "repo_path": str(src)}
    task = task_from_row({**row, "files": ["calc.py"]})
    with caplog.at_level("INFO", logger="aitlrt.rollout.batch"):
        batch = run_batch([PreparedTask(task, src, base)], proxy.url, RolloutSettings(n=2, agent="single-call"))
    assert [o.status for o in batch.outcomes] == ["ok", "ok"]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollouts ")]
    assert len(lines) == 1 and lines[0].startswith(
        "rollouts 2/2 done, 0 running | 2 with a patch, 0 failed outside the policy | 2 calls"
    )

"""mini-swe-agent 2.4.6, unmodified, run by the real rollout runner through a real aitlrt-serve: scripted answers drive
its real shell through the sandbox's escapes; the bundled model on a real vLLM CPU server gives real multi-turn
traces, whose rows per rollout are measured."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from aitlrt.common import keys
from aitlrt.common.git import git
from aitlrt.common.paths import aitlrt_home
from aitlrt.common.procs import free_port
from aitlrt.rollout.agents import AgentTask, make_agent
from aitlrt.rollout.agents.mini_swe import miniswe_venv
from aitlrt.rollout.runner import RolloutOutcome, RolloutRequest, RolloutRunner
from aitlrt.serving.process import ServeProcess
from aitlrt.training.rows import build_rows
from tests.conftest import alive

BASE = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"

pytestmark = pytest.mark.skipif(not (miniswe_venv() / "bin" / "mini").exists(), reason="run jobs/setup.sh first")


@pytest.fixture
def repo(make_repo: Callable[..., Path]) -> tuple[Path, str]:
    src = make_repo({"calc.py": BASE}, name="src")
    return src, git("rev-parse", "HEAD", cwd=src).strip()


def script(upstream: str, match: str, command: str) -> None:
    """Every later call whose messages contain ``match`` is answered with ``command`` in its text format."""
    reply = f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"
    httpx.post(f"{upstream}/script", json={"match": match, "reply": reply}).raise_for_status()


def sent(outcome: RolloutOutcome) -> str:
    """Everything the agent sent the model over the rollout (the observations of its commands included)."""
    return json.dumps([c["request"] for c in outcome.trace])


def probe(mark: str, victim: Path, outside: Path, proxy_port: int, sleeper: str) -> str:
    """One shell command that tries each escape and prints what came of it."""
    return "\n".join(
        [
            f"echo {mark}-PROBE-$((6*7))",
            f"cat {victim} >/dev/null 2>&1; echo read_other_workspace=$?",
            f"ls -A {aitlrt_home()} | wc -l | sed 's/^/aitlrt_home_entries=/'",
            f"touch {outside} 2>/dev/null; echo write_outside=$?",
            f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {proxy_port}), 3)\" 2>/dev/null; "
            "echo reach_proxy=$?",
            "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 3)\" 2>/dev/null; echo reach_net=$?",
            "env | grep -c -e OPENAI -e AITLRT | sed 's/^/token_vars=/'",
            f"(setsid {sleeper} >/dev/null 2>&1 &); nohup {sleeper} >/dev/null 2>&1 &",
            "echo probed",
        ]
    )


def sleepers(sleeper: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", sleeper], capture_output=True, text=True).stdout
    return [pid for pid in map(int, out.split()) if alive(pid)]


def test_the_shell_of_a_real_rollout_cannot_escape_and_its_edit_is_the_patch(
    repo, scripted_upstream, start_proxy, tmp_path
):
    src, base = repo
    mark = f"ESC{uuid.uuid4().hex[:8]}"
    proxy = start_proxy(scripted_upstream)
    proxy_port = int(proxy.url.rsplit(":", 1)[1])
    outside = Path.home() / f".{mark}-escaped"
    sleeper = f"sleep {1000 + int(mark[3:9], 16) % 9000}.5"
    task = AgentTask("esc", f"{mark}: fix add() in calc.py")
    agent = make_agent("mini-swe-agent", max_calls=5)
    with closing(agent), RolloutRunner(agent, proxy.url, "scripted", workspaces=tmp_path / "ws",
                       timeout_s=180, max_calls=5) as runner:  # fmt: skip
        victim = tmp_path / "ws" / "another-rollout" / "repo" / "secret.py"  # a workspace beside its own
        victim.parent.mkdir(parents=True)
        victim.write_text("SECRET = 1\n")
        script(scripted_upstream, mark, probe(mark, victim, outside, proxy_port, sleeper))
        script(scripted_upstream, f"{mark}-PROBE-42", f"printf '{FIXED}' > calc.py && echo {mark}-EDITED-$((2+3))")
        script(scripted_upstream, f"{mark}-EDITED-5", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
        (out,) = runner.run([RolloutRequest(f"esc-{mark}", task, src, base)])
    assert out.status == "ok" and out.calls == 3, (out.status, out.reason, out.log_tail[-3000:])
    assert "isolation: bwrap" in out.log_tail
    assert "+    return a + b" in out.patch and "calc.py" in out.patch
    observed = dict(re.findall(r"\\n([a-z_]+)=(\d+)", sent(out).split(f"{mark}-PROBE-42", 1)[1]))
    assert observed == {
        "read_other_workspace": "1",  # hidden: the workspaces' root is under /tmp, private in the sandbox
        "aitlrt_home_entries": "0",  # the cached repositories (every fix commit), task files: an empty folder
        "write_outside": "1",  # the host is read-only
        "reach_proxy": "1",  # no network at all, loopback included: the agent process alone reaches the proxy
        "reach_net": "1",
        "token_vars": "0",  # the rollout's token stays in the agent's process
    }, observed
    assert not outside.exists()
    assert sleepers(sleeper) == []  # the sandbox's pid namespace died with the command
    # The token the agent had opens only its own rollout: not another's trace, not the admin routes.
    token = keys.bearer(keys.rollout_token(keys.admin_key(proxy.url) or "", f"esc-{mark}"))
    assert httpx.get(f"{proxy.url}/rollouts/another", headers=token).status_code in (401, 403)
    assert httpx.put(f"{proxy.url}/rollouts/esc-{mark}", json={}, headers=token).status_code in (401, 403)


def test_a_hung_command_is_killed_and_a_hung_agent_is_a_timeout(repo, scripted_upstream, start_proxy, tmp_path):
    src, base = repo
    mark = f"HUNG{uuid.uuid4().hex[:8]}"
    proxy = start_proxy(scripted_upstream)
    script(scripted_upstream, mark, "sleep 600")
    agent = make_agent("mini-swe-agent", max_calls=3)
    agent.command_timeout_s = 2
    with (
        closing(agent),
        RolloutRunner(agent, proxy.url, "scripted", workspaces=tmp_path / "ws", timeout_s=60) as runner,
    ):
        (out,) = runner.run([RolloutRequest(f"hung-{mark}", AgentTask("hung", f"{mark}: wait"), src, base)])
    # Each `sleep 600` is killed after 2 s and told to the model; the step limit ends the rollout, no edit made.
    assert out.status == "no_patch" and out.calls == 3, (out.status, out.reason, out.log_tail[-3000:])
    assert "TimeoutExpired" in sent(out) or "timed out" in sent(out)
    # A command that outlasts the rollout: the agent is killed at the rollout's timeout, its sandboxed command with it.
    sleeper = f"sleep {600 + int(mark[4:10], 16) % 9000}.5"
    script(scripted_upstream, f"{mark}-LONG", sleeper)
    agent = make_agent("mini-swe-agent", max_calls=3)
    with (
        closing(agent),
        RolloutRunner(agent, proxy.url, "scripted", workspaces=tmp_path / "ws2", timeout_s=30) as runner,
    ):
        (out,) = runner.run([RolloutRequest(f"hung2-{mark}", AgentTask("long", f"{mark}-LONG"), src, base)])
    assert out.status == "timeout" and out.calls == 1, (out.status, out.reason, out.log_tail[-3000:])
    assert sleepers(sleeper) == []


@pytest.fixture(scope="module")
def served_256(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The bundled model behind aitlrt-serve with room for an action (256 tokens per answer, not the suite's 48),
    vLLM started for tool calls too (hermes: Qwen2.5's format; the bundled model's template ignores the tools)."""
    run_dir = tmp_path_factory.mktemp("served256")
    args = ["--model", str(model_dir), "--run-dir", str(run_dir), "--vllm-port", str(free_port()),
            "--vllm-log", str(run_dir / "vllm.log"), "--max-tokens", "256", "--temperature", "1.0",
            "--enforce-eager", "--max-model-len", "8192",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    with ServeProcess(args, port=free_port(), log_path=run_dir / "serve.log") as serve:
        yield serve.url


def extends(call: dict, tokenizer) -> bool:
    """Whether the call's prompt and sampled answer are a prefix of the next prompt of an append-only history (its
    answer kept, an observation after it) under the model's chat template: a turn boundary that keeps the row."""
    messages = call["request"]["messages"]
    following = [*messages, {"role": "assistant", "content": call["text"]}, {"role": "user", "content": "<output/>"}]
    ids = list(tokenizer.apply_chat_template(following, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"])  # fmt: skip
    held = [*call["prompt_token_ids"], *call["completion_token_ids"]]
    return ids[: len(held)] == held


@pytest.mark.timeout(1500)  # vLLM's start and ~600 generated tokens on a shared CPU
def test_real_rollouts_on_the_bundled_model_and_their_rows(
    repo, served_256, model_dir, tmp_path, record_property, tokenizer
):
    src, base = repo
    task = AgentTask("real", "Fix the bug in add() in calc.py: it must return a + b.")
    requests = [RolloutRequest(f"real-mini-{i}", task, src, base, seed=i) for i in range(2)]
    agent = make_agent("mini-swe-agent", max_calls=4)
    with closing(agent), RolloutRunner(agent, served_256, model_dir.name,
                       workspaces=tmp_path / "ws", timeout_s=400, max_calls=4, concurrency=1) as runner:  # fmt: skip
        outs = runner.run(requests)
    rows, calls, kept = [], [], []
    for out in outs:
        assert out.status in ("ok", "no_patch", "call_limit"), (out.status, out.reason, out.log_tail[-3000:])
        answered = [c for c in out.trace if c["status"] == 200]
        assert answered and all(len(c["completion_token_ids"]) == len(c["logprobs"]) > 0 for c in answered)
        built, stats = build_rows(out.trace)
        rows.append(len(built))
        calls.append(stats.used_calls)
        kept += [extends(c, tokenizer) for c in answered]
    print(f"mini-swe-agent on the bundled model: calls per rollout {calls}, rows per rollout {rows}; "
          f"answers an append-only history would keep in the row: {sum(kept)} of {len(kept)}")  # fmt: skip
    record_property("rows_per_rollout", rows)
    record_property("calls_per_rollout", calls)
    assert all(1 <= r <= c for r, c in zip(rows, calls, strict=True))


@pytest.mark.timeout(900)
def test_tool_calling_mode_sends_its_bash_tool_through_the_proxy(repo, served_256, model_dir, tmp_path):
    src, base = repo
    task = AgentTask("tools", "Fix the bug in add() in calc.py: it must return a + b.")
    agent = make_agent("mini-swe-agent-tools", max_calls=2)
    with closing(agent), RolloutRunner(agent, served_256, model_dir.name,
                       workspaces=tmp_path / "ws", timeout_s=300, max_calls=2) as runner:  # fmt: skip
        (out,) = runner.run([RolloutRequest("tools-mini-0", task, src, base, seed=0)])
    assert out.status in ("ok", "no_patch", "call_limit"), (out.status, out.reason, out.log_tail[-3000:])
    answered = [c for c in out.trace if c["status"] == 200]
    assert answered and all(len(c["completion_token_ids"]) == len(c["logprobs"]) > 0 for c in answered)
    assert all([t["function"]["name"] for t in c["request"]["tools"]] == ["bash"] for c in answered)

"""``agent: command``: a real CLI agent, mini-swe-agent's own ``mini``, given as a command template and run by the real
rollout runner through a real aitlrt-serve, in bubblewrap, on scripted answers."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

from aitlrt.common.git import git
from aitlrt.rollout.agents import AgentTask, ModelEndpoint, make_agent
from aitlrt.rollout.agents.command import render
from aitlrt.rollout.agents.mini_swe import miniswe_venv
from aitlrt.rollout.runner import RolloutRequest, RolloutRunner

FIXED = "def add(a, b):\n    return a + b\n"
MINI = (
    "MSWEA_CONFIGURED=true MSWEA_COST_TRACKING=ignore_errors {venv}/bin/mini --yolo --exit-immediately "
    "-c mini_textbased.yaml -c model.model_class=litellm_textbased -c model.model_kwargs.api_base={{base_url}} "
    "-c agent.step_limit=4 -c agent.cost_limit=0 -m openai/{{model}} -t {{instruction}}"
)


def test_placeholders_are_shell_quoted_and_unknown_ones_refused():
    task = AgentTask("t", "it's $(rm -rf /) `x`")
    line = render("agent --model {model} -t {instruction}", task, ModelEndpoint("http://u/v1", "m o"))
    assert line == "agent --model 'm o' -t 'it'\"'\"'s $(rm -rf /) `x`'"
    with pytest.raises(ValueError, match="placeholders are instruction, base_url, api_key, model"):
        render("agent {workspace}", task, ModelEndpoint("http://u/v1", "m"))
    with pytest.raises(ValueError, match="needs a command template"):
        make_agent("command")


@pytest.mark.skipif(not (miniswe_venv() / "bin" / "mini").exists(), reason="run jobs/setup.sh first")
def test_mini_cli_through_a_command_template(scripted_upstream, start_proxy, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git("init", "-q", cwd=src)
    git("add", "-A", cwd=src)
    git("commit", "-q", "-m", "base", cwd=src)
    base = git("rev-parse", "HEAD", cwd=src).strip()
    mark = f"CMD{uuid.uuid4().hex[:8]}"
    for match, command in [
        (mark, f"printf '{FIXED}' > calc.py && echo {mark}-EDITED-$((2+3))"),
        (f"{mark}-EDITED-5", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"),
    ]:
        reply = f"THOUGHT: go.\n\n```mswea_bash_command\n{command}\n```"
        httpx.post(f"{scripted_upstream}/script", json={"match": match, "reply": reply}).raise_for_status()
    proxy = start_proxy(scripted_upstream)
    agent = make_agent("command", command=MINI.format(venv=miniswe_venv()))
    assert agent.binds == (miniswe_venv(),)  # type: ignore[attr-defined]  # its venv, hidden otherwise
    with RolloutRunner(agent, proxy.url, "scripted", workspaces=tmp_path / "ws", timeout_s=180) as runner:
        (out,) = runner.run([RolloutRequest(f"cmd-{mark}", AgentTask("cmd", f"{mark}: fix add()"), src, base)])
    assert out.status == "ok" and out.calls == 2, (out.status, out.reason, out.log_tail[-3000:])
    assert "isolation: bwrap (network shared" in out.log_tail
    assert "+    return a + b" in out.patch
    first = out.trace[0]["request"]
    assert first["model"] == "scripted" and mark in json.dumps(first["messages"])
    assert not Path(tmp_path / "ws").exists() or list(Path(tmp_path / "ws").iterdir()) == []

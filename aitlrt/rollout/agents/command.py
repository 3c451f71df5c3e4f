"""Any CLI agent that speaks OpenAI, given as a command template (``agent: command``).

The template is a shell command line with placeholders ``{instruction}``, ``{base_url}``, ``{api_key}`` and
``{model}``, each replaced by its shell-quoted value; it runs under ``bash -c`` with the workspace as working
directory and ``OPENAI_BASE_URL``/``OPENAI_API_BASE``/``OPENAI_API_KEY`` set as well (prefer them to ``{api_key}``:
a command line is visible to every process on the machine). mini-swe-agent's own CLI, for example::

    mini --yolo --exit-immediately -c mini_textbased.yaml -c model.model_class=litellm_textbased
         -c model.model_kwargs.api_base={base_url} -m openai/{model} -t {instruction}

The whole process runs in bubblewrap (``aitlrt.tasks.sandbox.agent_sandbox``): the host read-only, the workspace
and a private HOME writable, ``AITLRT_HOME`` and the scratch folders hidden except the CLI's own virtualenv (``binds``,
read-only), its own pid namespace, so nothing it starts outlives it; it shares the host's network, which it needs
to reach the proxy. The rollout's timeout kills its process group. Unlike mini-swe-agent's rollouts (whose commands
get no network at all), a command agent's commands can reach the network: say so where it matters. The isolation
obtained ends the agent's log; a rollout without any is refused unless ``allow_unsandboxed``.
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aitlrt.common.procs import run_process_group, tail
from aitlrt.common.workspace import Workspace
from aitlrt.rollout.agents.aider import agent_env
from aitlrt.rollout.agents.base import AgentExit, AgentTask, ModelEndpoint
from aitlrt.tasks.sandbox import NO_ISOLATION, agent_sandbox

PLACEHOLDERS = ("instruction", "base_url", "api_key", "model")


def render(template: str, task: AgentTask, endpoint: ModelEndpoint) -> str:
    """``template`` with each placeholder replaced by its shell-quoted value (other braces are an error)."""
    values = {
        "instruction": task.instruction,
        "base_url": endpoint.base_url,
        "api_key": endpoint.api_key,
        "model": endpoint.model,
    }
    try:
        return template.format(**{k: shlex.quote(v) for k, v in values.items()})
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"bad command template {template!r}: placeholders are {', '.join(PLACEHOLDERS)}") from exc


def venv_of(template: str) -> tuple[Path, ...]:
    """The virtualenv (or folder) of the template's program when it is a path: bound read-only into the sandbox,
    which hides ``AITLRT_HOME`` where setup puts the agents' virtualenvs."""
    words = [w for w in shlex.split(template) if not re.fullmatch(r"\w+=.*", w)]  # not the VAR=value before it
    program = shutil.which(words[0]) if words else None
    if program is None:
        return ()
    path = Path(program).absolute()
    return (path.parent.parent if path.parent.name == "bin" else path.parent,)


@dataclass
class CommandAgent:
    template: str
    binds: Sequence[Path] = ()
    """Folders the agent reads that the sandbox hides otherwise; default: the program's virtualenv (``venv_of``)."""
    allow_unsandboxed: bool = False
    name: str = "command"

    def __post_init__(self) -> None:
        render(self.template, AgentTask("check", "check"), ModelEndpoint("http://check", "check"))
        self.binds = tuple(self.binds) or venv_of(self.template)

    def run(self, task: AgentTask, ws: Workspace, endpoint: ModelEndpoint, timeout_s: float) -> AgentExit:
        home = ws.scratch / "home"
        home.mkdir(exist_ok=True)
        prefix, isolation = agent_sandbox(ws.repo, private=[home], binds=self.binds)
        if isolation.startswith(NO_ISOLATION) and not self.allow_unsandboxed:
            raise RuntimeError(f"the command agent would run unisolated ({isolation})")
        env = {
            **agent_env(home),
            "OPENAI_BASE_URL": endpoint.base_url,
            "OPENAI_API_BASE": endpoint.base_url,
            "OPENAI_API_KEY": endpoint.api_key,
        }
        log = ws.scratch / "agent.log"
        command = [*prefix, "bash", "-c", render(self.template, task, endpoint)]
        exit = run_process_group(command, cwd=ws.repo, env=env, log_path=log, timeout_s=timeout_s)
        with open(log, "a") as out:
            out.write(f"\nisolation: {isolation}\n")
        return AgentExit(exit.returncode, exit.timed_out, tail(log), exit.seconds)

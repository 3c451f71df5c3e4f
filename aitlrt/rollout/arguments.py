"""The rollout knobs, defined once. ``RolloutArguments`` holds each knob's name, type, default and help: the training
config (``AgentGRPOConfig``) inherits it, and the flags of ``aitlrt rollout``, ``eval``, ``tasks probe`` and
``trajectories`` are generated from it by the parser that reads ``aitlrt train``'s (transformers'
``HfArgumentParser``), so a knob has the same flag, default and help everywhere. ``RolloutSettings`` is what one batch
of rollouts runs with: the knobs plus the per-batch ``n`` and ``seed``, with the same defaults."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from aitlrt.rollout.agents import AGENTS
from aitlrt.rollout.agents.aider import REMINDERS

if TYPE_CHECKING:  # mypy takes no Literal of a variable; argparse's choices and check_choices read the runtime one
    AgentName = str
    Reminder = str
else:
    AgentName = Literal[AGENTS]
    """The agents of ``aitlrt.rollout.agents.AGENTS``, named there once."""
    Reminder = Literal[REMINDERS]
    """Aider's ``reminder`` settings, ``aitlrt.rollout.agents.aider.REMINDERS``."""


def literal_choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The fields of dataclass ``cls`` typed ``Literal[...]``, with their choices."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in fields(cls) if typing.get_origin(hints[f.name]) is Literal}


def check_choices(obj: Any) -> None:
    """Refuse a ``Literal`` field's value outside its choices. argparse checks only the flags given: a YAML config's
    values become the flags' defaults (trl's ``TrlParser``), which argparse never checks, and Python callers pass
    anything."""
    for name, choices in literal_choices(type(obj)).items():
        if getattr(obj, name) not in choices:
            raise ValueError(f"unknown {name} {getattr(obj, name)!r}: one of {', '.join(map(str, choices))}")


@dataclass
class RolloutArguments:
    """> Parameters that control the agents' rollouts (the same flags in ``aitlrt train``, ``rollout``, ``eval``,
    ``tasks probe`` and ``trajectories``)"""

    agent: AgentName = field(
        default="aider-warm",
        metadata={
            "help": "the agent (aitlrt.rollout.agents.make_agent): aider-warm (Aider in warm worker processes), aider "
            "(Aider's CLI, one process per rollout), single-call (one model call, its answer's edits applied), "
            "mini-swe-agent (its text actions in warm workers, every shell command sandboxed), mini-swe-agent-tools "
            "(tool calls: the server needs tool_call_parser), command (the CLI agent of agent_command)"
        },
    )
    agent_command: str | None = field(
        default=None,
        metadata={
            "help": "agent command: the CLI agent's command template, run in the workspace in the sandbox "
            "({instruction}, {base_url}, {api_key}, {model}; OPENAI_BASE_URL and OPENAI_API_KEY also set; "
            "docs/rollouts.md)"
        },
    )
    edit_format: str = field(
        default="whole",
        metadata={"help": "Aider's edit format: whole (whole files: small models), diff (SEARCH/REPLACE), ..."},
    )
    aider_reminder: Reminder = field(
        default="user",
        metadata={
            "help": "Aider's reminder model setting: user (Aider's default: every request's last user message repeats "
            "the edit format's rules, which the system prompt already holds: ~650 tokens in diff format), sys (as a "
            "final system message) or none (the system prompt alone). Prompts are what the agent sends, so a trained "
            "policy should be deployed with the same setting"
        },
    )
    rollout_timeout_s: float = field(
        default=600.0,
        metadata={
            "aliases": ["--timeout"],
            "help": "wall-clock seconds per rollout: the agent's process group is killed after it (status timeout, "
            "the policy's failure)",
        },
    )
    rollout_max_calls: int | None = field(
        default=8,
        metadata={
            "aliases": ["--max-calls"],
            "help": "model calls per rollout, enforced by the proxy (call max+1 is refused: status call_limit); at "
            "least 1 + test_feedback_rounds; None: no limit",
        },
    )
    rollout_concurrency: int | None = field(
        default=None,
        metadata={
            "aliases": ["--concurrency"],
            "help": "agents at once; None: min(cores - min(2, cores / 4), memory GiB) of the job's own limits "
            "(aitlrt.common.resources), divided among the training ranks on the node",
        },
    )
    recycle_workspaces: bool = field(
        default=True,
        metadata={
            "help": "reuse a finished rollout's repository copy, reset and checked pristine, for the next one "
            "(docs/rollouts.md#workspaces); false (--no-recycle-workspaces): a fresh copy per rollout"
        },
    )
    context_window: int = field(default=8192, metadata={"help": "the context window told to the agent, tokens"})
    test_feedback_rounds: int = field(
        default=0,
        metadata={
            "help": "test feedback: after an applied edit Aider runs the task's tests in the grader's sandbox "
            "(aitlrt.tasks.feedback: the work tree's patch graded on the grader's own copy) and, when they fail, "
            "sends their output back for another try, at most this many times per rollout; each round is one more "
            "call, in the same conversation (the chat history is not summarised); mini-swe-agent runs them when it "
            "sends the command run-tests, which its task then offers; 0: no test runs"
        },
    )
    test_feedback_max_chars: int = field(
        default=3000,
        metadata={"help": "test feedback: characters of test output sent back per round (the tracebacks first)"},
    )
    test_feedback_timeout_s: float = field(
        default=120.0, metadata={"help": "test feedback: wall-clock seconds of one run of the tests"}
    )
    statement_test_output: int = field(
        default=0,
        metadata={
            "help": "characters of the task's failing tests' output at its start (the tests run once per task in the "
            "grader's sandbox, aitlrt.tasks.feedback.starting_failures; the tracebacks first) added to the problem "
            "statement, as SWE-smith puts the failing assertion in its statements; 0: the statement names the "
            "failing tests only"
        },
    )

    def rollout_settings(self, n: int = 1, seed: int | None = None) -> RolloutSettings:
        """These knobs for one batch: ``n`` rollouts per task, sampled with ``seed`` (``RolloutSettings.seed``;
        None: unseeded). Raises ``ValueError`` for a knob out of range."""
        return RolloutSettings(
            n=n,
            agent=self.agent,
            agent_command=self.agent_command,
            edit_format=self.edit_format,
            aider_reminder=self.aider_reminder,
            concurrency=self.rollout_concurrency,
            timeout_s=self.rollout_timeout_s,
            max_calls=self.rollout_max_calls,
            context_window=self.context_window,
            recycle_workspaces=self.recycle_workspaces,
            seed=seed,
            test_feedback_rounds=self.test_feedback_rounds,
            test_feedback_max_chars=self.test_feedback_max_chars,
            test_feedback_timeout_s=self.test_feedback_timeout_s,
            statement_test_output=self.statement_test_output,
        )


@dataclass(frozen=True)
class RolloutSettings:
    """How ``aitlrt.rollout.batch.run_batch`` runs the agents: ``RolloutArguments``' knobs with their defaults (a
    dataclass field's class attribute is its default), under shorter names that a warm start's cache key hashes
    (``aitlrt.warmstart.recipe``), plus ``n`` and ``seed``."""

    n: int = 1
    """Rollouts per task."""
    agent: AgentName = RolloutArguments.agent
    agent_command: str | None = RolloutArguments.agent_command
    edit_format: str = RolloutArguments.edit_format
    aider_reminder: Reminder = RolloutArguments.aider_reminder
    concurrency: int | None = RolloutArguments.rollout_concurrency
    """Agents at once; None: from the node's cores and memory (``agent_slots``)."""
    timeout_s: float = RolloutArguments.rollout_timeout_s
    max_calls: int | None = RolloutArguments.rollout_max_calls
    context_window: int = RolloutArguments.context_window
    recycle_workspaces: bool = RolloutArguments.recycle_workspaces
    seed: int | None = None
    """Seeded sampling (``rollout_seed``): the k-th rollout of a task samples the same tokens from the same weights in
    every batch with this seed, so that two checkpoints' rollouts pair up; None: unseeded."""
    test_feedback_rounds: int = RolloutArguments.test_feedback_rounds
    test_feedback_max_chars: int = RolloutArguments.test_feedback_max_chars
    test_feedback_timeout_s: float = RolloutArguments.test_feedback_timeout_s
    statement_test_output: int = RolloutArguments.statement_test_output

    def __post_init__(self) -> None:
        check_choices(self)
        if (self.agent == "command") != (self.agent_command is not None):
            raise ValueError(
                "agent command needs agent_command (the CLI's command template), and agent_command needs agent "
                f"command (got agent {self.agent!r}, agent_command {self.agent_command!r})"
            )
        if self.test_feedback_rounds < 0 or self.test_feedback_max_chars < 1 or self.test_feedback_timeout_s <= 0:
            raise ValueError(
                f"test_feedback_rounds must be >= 0 (got {self.test_feedback_rounds}), test_feedback_max_chars >= 1 "
                f"(got {self.test_feedback_max_chars}), test_feedback_timeout_s > 0 ({self.test_feedback_timeout_s})"
            )
        if self.statement_test_output < 0:
            raise ValueError(f"statement_test_output must be >= 0 characters (got {self.statement_test_output})")
        if self.max_calls is not None and self.max_calls < 1 + self.test_feedback_rounds:
            raise ValueError(
                f"max_calls (rollout_max_calls) {self.max_calls} leaves no call for every test feedback round: each "
                f"round is one more model call, so test_feedback_rounds {self.test_feedback_rounds} needs at least "
                f"{1 + self.test_feedback_rounds} (more for Aider's retries after an edit that did not apply)"
            )

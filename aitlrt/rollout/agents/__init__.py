"""Agents that work on a repository through an OpenAI-compatible endpoint (Aider, mini-swe-agent, any CLI agent by a
command template, and a tiny one of ours)."""

from aitlrt.rollout.agents.base import Agent, AgentExit, AgentTask, ModelEndpoint

AGENTS = ("aider-warm", "aider", "single-call", "mini-swe-agent", "mini-swe-agent-tools", "command")


def make_agent(
    name: str,
    edit_format: str = "whole",
    aider_reminder: str = "user",
    *,
    command: str | None = None,
    max_calls: int | None = None,
) -> Agent:
    """The agent called ``name``: ``aider-warm`` (warm Aider workers), ``aider`` (the CLI), ``single-call`` (which
    has no edit format or reminder), ``mini-swe-agent`` (text actions) or ``mini-swe-agent-tools`` (tool calls),
    whose step limit is ``max_calls``, or ``command`` (the CLI agent of the template ``command``)."""
    if name == "aider":
        from aitlrt.rollout.agents.aider import AiderAgent

        return AiderAgent(edit_format=edit_format, reminder=aider_reminder)
    if name == "aider-warm":
        from aitlrt.rollout.agents.aider import WarmAiderAgent

        return WarmAiderAgent(edit_format=edit_format, reminder=aider_reminder)
    if name == "single-call":
        from aitlrt.rollout.agents.single_call import SingleCallAgent

        return SingleCallAgent()
    if name in ("mini-swe-agent", "mini-swe-agent-tools"):
        from aitlrt.rollout.agents.mini_swe import MiniSweAgent

        return MiniSweAgent(tools=name.endswith("-tools"), step_limit=max_calls or 0, name=name)
    if name == "command":
        from aitlrt.rollout.agents.command import CommandAgent

        if not command:
            raise ValueError("agent command needs a command template (agent_command)")
        return CommandAgent(command)
    raise ValueError(f"unknown agent {name!r} (one of {', '.join(AGENTS)})")


__all__ = ["AGENTS", "Agent", "AgentExit", "AgentTask", "ModelEndpoint", "make_agent"]

"""Agents that work on a repository through an OpenAI-compatible endpoint (Aider, and a tiny one of ours)."""

from aitlrt.rollout.agents.base import Agent, AgentExit, AgentTask, ModelEndpoint

AGENTS = ("aider-warm", "aider", "single-call")


def make_agent(name: str, edit_format: str = "whole", aider_reminder: str = "user") -> Agent:
    """The agent called ``name``: ``aider-warm`` (warm Aider workers), ``aider`` (the CLI) or ``single-call``
    (which has no edit format or reminder)."""
    if name == "aider":
        from aitlrt.rollout.agents.aider import AiderAgent

        return AiderAgent(edit_format=edit_format, reminder=aider_reminder)
    if name == "aider-warm":
        from aitlrt.rollout.agents.aider import WarmAiderAgent

        return WarmAiderAgent(edit_format=edit_format, reminder=aider_reminder)
    if name == "single-call":
        from aitlrt.rollout.agents.single_call import SingleCallAgent

        return SingleCallAgent()
    raise ValueError(f"unknown agent {name!r} (one of {', '.join(AGENTS)})")


__all__ = ["AGENTS", "Agent", "AgentExit", "AgentTask", "ModelEndpoint", "make_agent"]

"""Agents that work on a repository through an OpenAI-compatible endpoint (Aider, and a tiny one of ours)."""

from aitlrt.agents.base import Agent, AgentExit, AgentTask, ModelEndpoint

__all__ = ["Agent", "AgentExit", "AgentTask", "ModelEndpoint"]

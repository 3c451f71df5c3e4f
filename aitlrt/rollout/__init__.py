"""Rollouts: agents (``agents/``) run on private repository copies through ``aitlrt-serve``; the runner turns each
into an outcome (status, patch, trace)."""

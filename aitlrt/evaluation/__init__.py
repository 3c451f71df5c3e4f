"""Rollouts scored outside training: the built-in rewards on a batch (``scoring``), and one checkpoint evaluated or
two compared on the same tasks, agent and sampling (``checkpoints``)."""

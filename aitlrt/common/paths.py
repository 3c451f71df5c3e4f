"""Where AITLRT keeps its caches: one project directory, configurable with ``AITLRT_HOME``."""

from __future__ import annotations

import os
from pathlib import Path


def aitlrt_home() -> Path:
    """Root of every cache (models, repos, venvs); ``$AITLRT_HOME`` or ``~/.cache/aitlrt``."""
    return Path(os.environ.get("AITLRT_HOME") or Path.home() / ".cache" / "aitlrt")


def models_dir() -> Path:
    return aitlrt_home() / "models"


def scratch_dir() -> Path:
    """Per-rollout files (workspaces, Aider worker homes): ``$AITLRT_SCRATCH`` or ``AITLRT_HOME``. On a cluster, point
    it at node-local disk: thousands of short-lived copies do not belong on a shared filesystem."""
    return Path(os.environ.get("AITLRT_SCRATCH") or aitlrt_home())

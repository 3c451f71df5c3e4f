"""Where AITLRT keeps its caches: one project directory, configurable with ``AITLRT_HOME``."""

from __future__ import annotations

import os
from pathlib import Path


def aitlrt_home() -> Path:
    """Root of every cache (models, repos, venvs); ``$AITLRT_HOME`` or ``~/.cache/aitlrt``."""
    return Path(os.environ.get("AITLRT_HOME") or Path.home() / ".cache" / "aitlrt")


def models_dir() -> Path:
    return aitlrt_home() / "models"

"""Where AITLRT keeps its caches: one project directory, configurable with ``AITLRT_HOME``."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock beside ``path``, held while it is being built (processes share the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield

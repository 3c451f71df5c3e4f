"""Settings of one ``aitlrt-serve`` process."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ServeSettings:
    upstream: str
    """Base URL of the vLLM OpenAI server, e.g. ``http://127.0.0.1:8001``."""
    api_key: str
    """The admin key: every route; agents get rollout tokens derived from it (``aitlrt.common.keys``)."""
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0, "top_p": 1.0, "top_k": -1})
    """The run's sampling parameters, forced on every call."""
    run_dir: Path | None = None
    """Where the append-only call journal lives; None keeps records in memory only."""
    upstream_api_key: str | None = None
    """Sent upstream as ``Authorization: Bearer KEY`` (a hosted OpenAI-compatible API)."""
    token_ids: bool = True
    """Ask the upstream for vLLM's token ids and logprobs; False for any other OpenAI-compatible API (a teacher):
    calls are then recorded with their messages and text only."""
    continuity: bool = True
    """Token continuity: a chat call whose messages extend its rollout's previous call's continues that call's exact
    tokens (``aitlrt_server.continuity``)."""
    continuity_tokenizer: str | None = None
    """The served model's tokenizer for continuity (a folder or Hub id); None: the model folder vLLM reports."""
    chat_template: str | None = None
    """vLLM's ``--chat-template``, if it was started with one (a file or the template)."""
    max_body_bytes: int = 16 * 2**20
    """A model call's body, at most."""
    max_admin_body_bytes: int = 2**20
    """An admin route's body, at most (a probe of 4,096 token ids is ~30 KB)."""
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 600.0

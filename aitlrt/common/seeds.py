"""Sampling seeds derived from names: the same parts always give the same seed, whatever else runs."""

from __future__ import annotations

import hashlib


def derived_seed(*parts: object) -> int:
    """A 31-bit seed hashed from ``parts`` (joined with ``:``): stable across processes, unlike ``hash``."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1

"""Weight-version bookkeeping: a gate that holds new generation while the policy's weights change."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aitlrt_server.errors import ProxyError


class WeightGate:
    """Counts in-flight generations and can close to let them drain before a weight update.

    Every call holds the gate for its whole duration (streams included) and is stamped with the
    version current when it entered, so no call straddles an update.
    """

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = 0
        self._update = asyncio.Lock()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def inflight(self) -> int:
        return self._inflight

    @asynccontextmanager
    async def generation(self, wait_s: float) -> AsyncIterator[int]:
        """Enter for one call (waiting while paused); yields the weight version the call runs under."""
        deadline = asyncio.get_running_loop().time() + wait_s
        # A loop, not one wait: a call woken by a resume runs later than the resume, and a pause may come between.
        while not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise ProxyError(503, f"weights are being updated; still paused after {wait_s:.0f}s") from None
        self._inflight += 1
        self._idle.clear()
        try:
            yield self.version
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def pause(self, drain_s: float) -> None:
        """Close the gate and wait until in-flight calls finish (reopens and raises 503 on timeout)."""
        self._open.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), drain_s)
        except TimeoutError:
            self._open.set()
            raise ProxyError(503, f"{self._inflight} calls still in flight after {drain_s:.0f}s; not paused") from None

    def resume(self, version: int | None = None) -> int:
        """Reopen the gate, at ``version`` when given; returns the version now current."""
        if version is not None:
            self.version = version
        self._open.set()
        return self.version

    @asynccontextmanager
    async def update(self, drain_s: float) -> AsyncIterator[None]:
        """Pause, run the body (which changes the weights), bump the version on success, resume."""
        async with self._update:
            await self.pause(drain_s)
            try:
                yield
            except BaseException:
                self.resume()
                raise
            self.resume(self.version + 1)

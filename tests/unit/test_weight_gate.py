"""The weight gate: a call woken by a resume re-checks the gate, so a pause that came in between holds it."""

from __future__ import annotations

import asyncio

import pytest

from aitlrt_server.errors import ProxyError
from aitlrt_server.weights import WeightGate


def test_a_call_woken_by_resume_waits_again_for_a_pause_that_came_in_between():
    async def scenario() -> list[tuple[int, bool]]:
        gate = WeightGate()
        await gate.pause(1.0)
        entered: list[tuple[int, bool]] = []

        async def call() -> None:
            async with gate.generation(5.0) as version:
                entered.append((version, gate.paused))

        waiting = asyncio.create_task(call())
        await asyncio.sleep(0.01)  # the call waits on the closed gate
        gate.resume(1)
        await gate.pause(1.0)  # the next sync's pause, before the woken call runs: nothing is in flight
        await asyncio.sleep(0.05)
        assert entered == [], "a call ran during the second pause (with the weights half-replaced)"
        gate.resume(2)
        await waiting
        return entered

    assert asyncio.run(scenario()) == [(2, False)]


def test_a_pause_that_outlasts_the_wait_is_a_503():
    async def scenario() -> None:
        gate = WeightGate()
        await gate.pause(1.0)
        async with gate.generation(0.05):
            pass

    with pytest.raises(ProxyError) as err:
        asyncio.run(scenario())
    assert err.value.status == 503

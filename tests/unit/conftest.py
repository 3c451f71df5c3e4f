"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
import trl.trainer.utils

from tests.helpers.multirank_run import tiny_trainer


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A tiny CPU trainer (no server: nothing here generates), in training mode, one accumulation step; one per
    test module, which may set its loss options."""
    out = tmp_path_factory.mktemp("trainer")
    t = tiny_trainer(
        "http://127.0.0.1:9",
        str(out / "repo"),
        str(out / "run"),
        per_device_train_batch_size=4,
        max_completion_length=64,
    )
    t.model.train()
    t.current_gradient_accumulation_steps = 1
    return t


@pytest.fixture
def lm_head_positions(monkeypatch) -> list[int]:
    """The positions each call of trl's chunked LM head (CPU: no Triton) projects, appended as the test runs."""
    projected: list[int] = []
    chunked = trl.trainer.utils._ChunkedLogProbFunction

    class Spy:
        @staticmethod
        def apply(hidden, *args):
            projected.append(hidden.shape[0])
            return chunked.apply(hidden, *args)

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", Spy)
    return projected

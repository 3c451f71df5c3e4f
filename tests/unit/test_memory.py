"""The peak memory of a stretch of work on CPU (``aitlrt.common.memory``): it rises with a real allocation and a
reset starts it again from the process's resident memory."""

from __future__ import annotations

import torch

from aitlrt.common.memory import peak_memory_gib, reset_peak_memory
from tests.helpers.processes import resident_gib

CPU = torch.device("cpu")


def test_the_peak_holds_a_freed_allocation_until_a_reset():
    reset_peak_memory(CPU)
    before = peak_memory_gib(CPU)
    block = torch.ones(2**27)  # 0.5 GiB, touched
    block.add_(1)
    del block
    held = peak_memory_gib(CPU)
    assert held >= before + 0.45
    reset_peak_memory(CPU)
    assert resident_gib() - 0.01 <= peak_memory_gib(CPU) < held - 0.4

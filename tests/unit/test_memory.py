"""The peak memory of a stretch of work on CPU (``aitlrt.common.memory``): it rises with a real allocation and a
reset starts it again from the process's resident memory; with glibc's mmap threshold fixed, freed tensors leave the
process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aitlrt.common.memory import peak_memory_gib, reset_peak_memory
from tests.helpers.processes import resident_gib

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


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


def held_after_free(mode: str) -> float:
    """``held_after_freeing_gib`` in a fresh process, glibc's malloc as it comes or with the threshold fixed."""
    code = (
        "import sys\nimport torch\nfrom aitlrt.common.memory import unmap_freed_tensors\n"
        "from tests.helpers.processes import held_after_freeing_gib\n"
        "assert sys.argv[1] == 'default' or unmap_freed_tensors(torch.device('cpu'))\nprint(held_after_freeing_gib())"
    )
    done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, cwd=ROOT, check=True)
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_tensors_leave_the_process_once_the_mmap_threshold_is_fixed():
    assert held_after_free("default") > 0.3  # glibc's default keeps the freed blocks in its heap
    assert held_after_free("fixed") < 0.05

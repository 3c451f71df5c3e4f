"""Agent concurrency follows what the job may use: CPU affinity and memory limits, split among a node's ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aitlrt.common.resources import agent_slots, cpu_bf16_is_native


def test_agent_slots_are_bounded_by_cores_and_memory():
    assert agent_slots(cores=32, memory_gib=250) == 30  # cores: two left to the trainer and the server
    assert agent_slots(cores=64, memory_gib=16) == 16  # memory: 1 GiB per agent
    assert agent_slots(cores=2, memory_gib=24) == 2  # a small machine keeps its cores
    assert agent_slots(cores=1, memory_gib=0.5) == 1  # never zero


def test_concurrency_reads_the_job_affinity_and_divides_among_local_ranks():
    code = (
        "import os; os.sched_setaffinity(0, {0});"
        "from aitlrt.common.resources import usable_cores, rollout_concurrency;"
        "from aitlrt.training.config import AgentGRPOConfig;"
        "c = AgentGRPOConfig(output_dir='/tmp/x', proxy_url='http://x', report_to=[]);"
        "print(usable_cores(), rollout_concurrency(), c.rollout_concurrency)"
    )
    env = {**os.environ, "LOCAL_WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "1", "1"]

    code = (
        "from aitlrt.common.resources import agent_slots, rollout_concurrency; "
        "print(agent_slots(), rollout_concurrency())"
    )
    env["LOCAL_WORLD_SIZE"] = "2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    slots, per_rank = map(int, out.stdout.split())
    assert per_rank == max(1, slots // 2)


def test_cpu_bf16_follows_the_cpu_unless_set_and_warns_when_emulated(monkeypatch, caplog):
    from aitlrt.common import resources
    from aitlrt.training.config import AgentGRPOConfig
    from aitlrt.warmstart.sft import WarmStartSFTConfig

    for native in (True, False):
        monkeypatch.setattr(resources, "cpu_bf16_is_native", lambda native=native: native)
        caplog.clear()
        assert resources.cpu_mixed_precision(None, "x") is native
        assert resources.cpu_mixed_precision(False, "x") is False
        assert resources.cpu_mixed_precision(True, "x") is True  # the user's choice stands...
        assert ("~3x slower than fp32" in caplog.text) is not native  # ...with a warning where bf16 is emulated
        grpo = AgentGRPOConfig(output_dir="/tmp/x", proxy_url="http://x", report_to=[])
        sft = WarmStartSFTConfig(output_dir="/tmp/x", report_to=[])
        assert grpo.bf16 is native and sft.bf16 is native  # trl's default (unset) follows the CPU


def test_vllm_cpu_serves_fp32_where_bf16_is_emulated_unless_told(monkeypatch):
    from aitlrt_server import upstream

    monkeypatch.setattr(upstream, "cpu_build", lambda: True)
    for native, expected in ((False, ["--dtype", "float32"]), (True, [])):
        monkeypatch.setattr(upstream, "cpu_bf16_is_native", lambda native=native: native)
        cmd = upstream.VLLMServer("m", port=1).command()
        assert cmd[cmd.index("--no-enable-chunked-prefill") + 1 :] == expected
        told = upstream.VLLMServer("m", port=1, extra_args=["--dtype=bfloat16"]).command()
        assert told[-1] == "--dtype=bfloat16" and "float32" not in told


def test_vllm_cpu_computes_on_every_cpu_of_a_small_machine_unless_told(monkeypatch):
    from aitlrt_server import upstream

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 5})
    assert upstream.cpu_thread_binding({}) == {"VLLM_CPU_OMP_THREADS_BIND": "2,5"}  # vLLM's auto would keep one
    assert upstream.cpu_thread_binding({"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == {}  # the user's choice stands
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert upstream.cpu_thread_binding({}) == {}  # a larger machine: vLLM's own binding


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads Linux's /proc/cpuinfo")
def test_cpu_bf16_native_agrees_with_the_kernels_cpu_flags():
    """torch's private probes (which a later torch may rename) against the flags Linux reports for this CPU."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
    assert cpu_bf16_is_native() == bool(flags & {"amx_tile", "avx512_bf16"})

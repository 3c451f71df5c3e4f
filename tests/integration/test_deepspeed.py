"""The trainer under DeepSpeed, launched as a cluster user launches it (``accelerate launch --config_file
configs/accelerate/zero2.yaml`` / ``zero3.yaml``), on two CPU ranks (DeepSpeed's CPU accelerator, gloo; fp32 instead
of the configs' bf16): the update, with micro-batches and gradient accumulation, and what the reload sync sends give
the weights plain DDP gives, for full fine-tuning and LoRA (merged under ZeRO-3's gathers), and so does the
weight probe's forward; a step that dynamic sampling skips changes no weight and logs no gradient."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aitlrt.common.procs import free_port
from tests.helpers.multirank_run import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "helpers" / "multirank_run.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (jobs/setup.sh installs it)"
)


def launch(config: str | None, *args: str, ranks: int = 2) -> None:
    """The helper on ``ranks`` ranks: under ``configs/accelerate/CONFIG.yaml`` (accelerate's ``--mixed_precision
    no``: the precision is the trainer's), or plain torchrun (DDP) for None; one plain rank is a plain process."""
    if config is None and ranks == 1:
        runner = []
    elif config is None:
        runner = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    else:
        runner = [
            *("-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs" / "accelerate" / config)),
            *("--num_processes", str(ranks), "--mixed_precision", "no", "--main_process_port", str(free_port())),
        ]
    done = subprocess.run(
        [sys.executable, *runner, str(HELPER), *args], capture_output=True, text=True, timeout=400, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def assert_same_update(run: dict, reference: dict, name: str, bf16: bool = False) -> None:
    """``run`` sent the weights, logged the grad norms and probed the logprobs ``reference`` did: to fp32's last
    bits, or (``bf16``) to bf16's precision."""
    assert run["sent"].keys() == reference["sent"].keys(), name
    tolerance = {"rtol": 1e-2, "atol": 2e-3} if bf16 else {"rtol": 0, "atol": 1e-5}
    for key, tensor in reference["sent"].items():
        sent, expected = run["sent"][key].float(), tensor.float()
        gap = (sent - expected).abs().max().item()
        torch.testing.assert_close(sent, expected, **tolerance, msg=f"{name}: {key}: {gap:.2e}")
    assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-2 if bf16 else 1e-4), name
    assert run["probe"] == pytest.approx(reference["probe"], abs=1e-2 if bf16 else 1e-5), name


@pytest.mark.parametrize("lora", ["full", "lora"])
def test_zero_updates_and_sync_match_ddp(make_repo, tmp_path, lora):
    repo = str(make_repo({"README": "tiny\n"}))
    runs = {"ddp": None, "zero2": "zero2.yaml", "zero3": "zero3.yaml"}
    if lora == "lora":
        del runs["zero2"]
    saved = {}
    for name, config in runs.items():
        launch(config, "--update", repo, str(tmp_path / name), "2", lora)
        saved[name] = torch.load(tmp_path / name / "update0.pt")
    ddp = saved.pop("ddp")
    assert not ddp["deepspeed"]
    initial = tiny_llama(2048, 256).state_dict()
    moved = max((ddp["sent"][k] - v).abs().max().item() for k, v in initial.items() if k in ddp["sent"])
    assert moved > 5e-3, "the two updates changed the weights (LoRA: ~0.012, full: ~0.16), far beyond the tolerance"
    assert len(ddp["grad_norms"]) == 2 and all(n > 0 for n in ddp["grad_norms"])
    for name, run in saved.items():
        assert run["deepspeed"] and run["zero3"] == (name == "zero3")
        assert_same_update(run, ddp, name)


def test_a_skipped_update_under_zero2_changes_nothing_and_logs_no_gradient(make_repo, tmp_path):
    launch("zero2.yaml", "--dynamic", str(make_repo({"README": "tiny\n"})), str(tmp_path))
    for rank in (0, 1):
        saved = torch.load(tmp_path / f"dynamic{rank}.pt")
        assert [log["sampling/skipped_update"] for log in saved["logs"]] == [0.0, 1.0]
        assert saved["changed"] == [True, False]
        trained, skipped = saved["grad_norms"]
        assert trained > 0 and skipped == 0.0  # DeepSpeed's engine would report the trained step's norm again


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (DeepSpeed's CUDA accelerator, NCCL)")
@pytest.mark.parametrize("lora", ["full", "lora"])
def test_zero_on_one_gpu_matches_a_plain_gpu_run(make_repo, tmp_path, lora):
    """The configs as a one-GPU user launches them. In fp32, ZeRO-2/3 on CUDA send the weights a plain process on the
    same GPU sends. In trl's default precision (``bf16`` on such a GPU) DeepSpeed holds the weights in bf16 (fp32
    master copies in the optimizer) where a plain run autocasts fp32 weights: the sent weights agree to bf16's
    precision."""
    repo = str(make_repo({"README": "tiny\n"}))
    runs = {"plain-fp32": (None, "fp32"), "zero3-fp32": ("zero3.yaml", "fp32")}
    if lora == "full":
        runs |= {
            "zero2-fp32": ("zero2.yaml", "fp32"),
            "plain-bf16": (None, "default"),
            "zero3-bf16": ("zero3.yaml", "default"),
        }
    saved = {}
    for name, (config, precision) in runs.items():
        launch(config, "--update", repo, str(tmp_path / name), "2", lora, precision, ranks=1)
        saved[name] = torch.load(tmp_path / name / "update0.pt")
    initial = tiny_llama(2048, 256).state_dict()
    plain = saved["plain-fp32"]
    moved = max((plain["sent"][k] - v).abs().max().item() for k, v in initial.items() if k in plain["sent"])
    assert moved > 5e-3, "the two updates changed the weights (LoRA: ~0.01, full: ~0.1), far beyond the tolerance"
    for name, run in saved.items():
        if name.startswith("plain"):
            assert not run["deepspeed"], name
            continue
        bf16 = name.endswith("bf16")
        assert run["deepspeed"] and run["zero3"] == name.startswith("zero3"), name
        dtypes = {tensor.dtype for tensor in run["sent"].values()}
        assert dtypes == {torch.bfloat16 if bf16 else torch.float32}, f"{name}: {dtypes}"
        assert_same_update(run, saved["plain-bf16" if bf16 else "plain-fp32"], name, bf16=bf16)

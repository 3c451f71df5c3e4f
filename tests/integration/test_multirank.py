"""Two ranks (torchrun, CPU/gloo) with rollouts of very different call counts: the run finishes (every rank runs
the same number of forward/backward passes) and each group's advantages are computed over the whole group, as
one rank computes them, although the group's rollouts sit on both ranks; under a tiny ``max_tokens_per_forward``
two ranks of very unequal rows run as many passes each and give one rank's loss and gradients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aitlrt.common.procs import free_port
from aitlrt.training.advantages import group_advantages
from tests.conftest import keyed_env

ROOT = Path(__file__).resolve().parents[2]


def torchrun(ranks: int, *args: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(ranks),
        "--master_port",
        str(free_port()),
        str(ROOT / "tests" / "helpers" / "multirank_run.py"),
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_micro_batches_on_unequal_ranks_give_one_ranks_loss_and_gradients(make_repo, tmp_path, loss_type):
    repo = make_repo({"README": "tiny\n"})
    for ranks in (1, 2):
        torchrun(ranks, "--micro-batches", str(repo), str(tmp_path), loss_type, "48")
    one, *two = (torch.load(tmp_path / name) for name in ("w1r0.pt", "w2r0.pt", "w2r1.pt"))
    assert two[0]["own"] < two[1]["own"]  # rank 0's 2 short rows: fewer micro-batches than rank 1's 9 rows
    # padding passes: rank 0 runs as many as rank 1; the importance ratio comes from these (no separate forward)
    assert two[0]["forwards"] == two[1]["forwards"] == two[1]["own"]
    assert two[0]["loss"] == two[1]["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert one["loss"] != 0.0
    for x, y in zip(one["grads"], two[0]["grads"], strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-7)


def test_dynamic_sampling_decides_for_every_rank(make_repo, tmp_path):
    """One informative group on one rank only: both ranks run the second round and train it; a step without any
    informative group is skipped on both ranks and changes no weight."""
    torchrun(2, "--dynamic", str(make_repo({"README": "tiny\n"})), str(tmp_path))
    ranks = [torch.load(tmp_path / f"dynamic{r}.pt") for r in (0, 1)]
    assert ranks[0]["logs"] == ranks[1]["logs"]
    step1, step2 = ranks[0]["logs"]
    assert step1 == {
        "sampling/rounds": 2.0,
        "sampling/groups": 4.0,
        "sampling/informative_groups": 1.0,
        "sampling/skipped_update": 0.0,
    }
    assert step2["sampling/rounds"] == 2.0 and step2["sampling/skipped_update"] == 1.0
    assert all(r["changed"] == [True, False] for r in ranks), "step 1 trains (rank 1's group), step 2 is skipped"
    assert all(r["grad_norms"][0] > 0 and r["grad_norms"][1] == 0.0 for r in ranks)


def test_two_ranks_with_unequal_rows_finish_with_whole_group_advantages(
    scripted_upstream, start_proxy, make_repo, tmp_path
):
    proxy = start_proxy(scripted_upstream)
    repo = make_repo({"README": "tiny\n"})
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "tests" / "helpers" / "multirank_run.py"),
        proxy.url,
        str(repo),
        str(out),
    ]
    env = keyed_env(proxy.url)  # the ranks get the admin key as a jobscript's trainer does
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert sorted(p.name for p in out.glob("rank*.done")) == ["rank0.done", "rank1.done"]
    for step in (0, 1):
        saved = [json.loads(line) for line in (out / "rollouts" / f"step_{step:04d}.jsonl").open()]
        assert len(saved) == 4  # 2 ranks x 2 rollouts: one group of num_generations=4 across both ranks
        assert len({s["instance_id"] for s in saved}) == 1
        calls = [s["calls"] for s in saved]
        rewards = torch.tensor([s["rewards"]["calls_reward"] for s in saved])
        assert rewards.tolist() == pytest.approx([c / 6 for c in calls])
        expected, _ = group_advantages(rewards, 4)
        assert [s["advantage"] for s in saved] == pytest.approx(expected.tolist(), abs=1e-5)
        assert sorted(calls[:2]) == [1, 2] and sorted(calls[2:]) == [6, 7]  # rank 0: 3 rows, rank 1: 13 rows
        assert [s["rows"] for s in saved] == calls
        assert expected.abs().min() > 0.5  # the group's advantages really span both ranks

"""The weight probe on two ranks (torchrun, CPU/gloo): only the main process asks the server, and every rank returns
the same gap, or raises the same error when the server cannot answer (no rank is left waiting).

Run by pytest; each rank runs this file's ``main`` under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aitlrt.common.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
IDS = [5, 17, 3, 99, 42, 7, 1000, 12]


def test_every_rank_gets_the_main_process_outcome(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    done = subprocess.run(
        [*cmd, str(Path(__file__)), str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["asked"] == 1 and ranks[1]["asked"] == 0  # the main process alone asks the server
    assert ranks[0]["gap"] == ranks[1]["gap"] and ranks[0]["gap"][0] == 0.5
    assert ranks[0]["error"] == ranks[1]["error"]
    assert "could not score the probe on the server at http://127.0.0.1:9: refused" in ranks[0]["error"]


def main(out: str) -> None:
    from aitlrt.training import probe
    from aitlrt.training.probe import WeightProbe, WeightProbeError
    from tests.helpers.multirank_run import tiny_trainer

    trainer = tiny_trainer("http://127.0.0.1:9", ".", out)
    rank = trainer.accelerator.process_index
    mine = probe.policy_logprobs(trainer, IDS)
    asked = []

    def served(url, ids):
        asked.append(ids)
        return 0, [lp + 0.5 for lp in mine]

    probe.server_logprobs = served
    gap = WeightProbe("http://127.0.0.1:9", IDS, tolerance=1.0).check(trainer, 0)

    def refused(url, ids):
        raise OSError("refused")

    probe.server_logprobs = refused
    try:
        WeightProbe("http://127.0.0.1:9", IDS, tolerance=1.0).check(trainer, 0)
        error = ""
    except WeightProbeError as exc:
        error = str(exc)
    result = {"asked": len(asked), "gap": [round(gap.mean, 6), round(gap.max, 6)], "error": error}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1])

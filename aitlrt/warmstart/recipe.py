"""The warm start of a training run (``aitlrt/train.py --warm_start``): trajectories of the real agent on the training
tasks answered by the oracle teacher (``aitlrt.warmstart.trajectories``), then supervised fine-tuning on them
(``aitlrt.warmstart.sft``). With Aider's test feedback on (``RolloutSettings.test_feedback_rounds``), the oracle's
trajectories are single-turn and multi-turn (decoy first, then the fix once the tests' output came back). The result
is cached under ``$AITLRT_HOME/warmstart/<key>`` (trajectories, SFT metrics, the model), keyed by everything that
shapes it: the model, the tasks and their oracle patches, the agent's settings (the test feedback's only when on)
and the SFT flags; a second run with the same inputs reuses it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import aitlrt
from aitlrt.common.model import resolve_model
from aitlrt.common.paths import aitlrt_home, file_lock
from aitlrt.common.procs import die_with_parent
from aitlrt.rollout.batch import RolloutSettings
from aitlrt.tasks.task import Task
from aitlrt.warmstart.oracle_shell import SHELL_VERSION
from aitlrt.warmstart.trajectories import DEFAULT_REWARDS, collect, reward_funcs, teacher_from

log = logging.getLogger(__name__)

ORACLE = "oracle"
RECIPE_VERSION = 2
"""Bump when the warm start's code changes what it produces: cached warm starts of other versions are not reused.
2: the grader takes a library's own import hook for the base's (toolz's oracle fixes outside ``tlz/`` resolve)."""


def cache_key(source: str, tasks: Sequence[Task], model: str, settings: RolloutSettings, flags: Sequence[str]) -> str:
    """What the warm start depends on, hashed."""
    data = Path(source).read_bytes() if source != ORACLE else b""
    feedback = settings.test_feedback_rounds > 0
    inputs = {
        "version": RECIPE_VERSION,
        "source": source,
        "data": hashlib.sha256(data).hexdigest(),
        "model": model,
        "tasks": [(t.instance_id, t.setup_patch, t.patch) for t in tasks] if source == ORACLE else [],
        "settings": {
            k: v
            for k, v in asdict(settings).items()
            if k not in ("concurrency", "timeout_s")
            and not (k in ("seed", "agent_command") and v is None)  # unseeded, no command agent: keys as before
            and (feedback or not k.startswith("test_feedback_"))  # no test feedback: keys as before
            and not (k == "statement_test_output" and not v)  # the statement alone: keys as before
        },
        "flags": list(flags),
    }
    if source == ORACLE and feedback:
        inputs["multi_turn"] = True  # the oracle's trajectories include multi-turn ones (decoy first)
    if source == ORACLE and settings.agent == "mini-swe-agent":
        inputs["shell_oracle"] = SHELL_VERSION  # Aider's warm starts keep their keys
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


_DISTRIBUTED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def sft_from_flags(data: Path, model: str, output_dir: Path, flags: Sequence[str]) -> None:
    """``aitlrt sft --data DATA --model_name_or_path MODEL --output_dir OUT FLAGS...`` in a child process, on its own
    (not a rank of the caller's distributed run): the ~10 GB it holds on CPU for the recipe's ~3k-token rows go back
    to the machine before vLLM and the trainer start (kept in this process, they got a bench OOM-killed). The child
    gets SIGTERM when this process dies, however it dies: a killed run leaves no fine-tuning behind on the cores."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DISTRIBUTED and not k.startswith(("ACCELERATE_", "TORCHELASTIC_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(aitlrt.__file__).parents[1]), env.get("PYTHONPATH")]))
    argv = ["--data", str(data), "--model_name_or_path", model, "--output_dir", str(output_dir), *flags]
    cmd = [sys.executable, "-m", "aitlrt.cli", "sft", *argv]
    done = subprocess.run(cmd, env=env, check=False, preexec_fn=die_with_parent(signal.SIGTERM))  # killed with us
    if done.returncode:
        raise RuntimeError(f"warm start: `aitlrt sft {shlex.join(argv)}` failed with exit code {done.returncode}")


def model_flags(revision: str | None, trust_remote_code: bool) -> list[str]:
    """``aitlrt sft``'s flags that load the policy as the run loads it: its ``revision`` (none for ``main``) and
    ``trust_remote_code``."""
    flags = ["--model_revision", revision] if revision not in (None, "main") else []
    return [*flags, "--trust_remote_code"] if trust_remote_code else flags


def warm_start(
    source: str,
    tasks: Sequence[Task],
    model: str,
    settings: RolloutSettings,
    flags: Sequence[str] = (),
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """The warm-start model folder for ``tasks``: fine-tuned from ``model`` (at ``revision``, with
    ``trust_remote_code``, as the run loads it) on the oracle teacher's trajectories (``source`` ``oracle``) or on
    the trajectories file ``source``, with ``aitlrt sft`` ``flags``; cached."""
    model = resolve_model(model)
    flags = [*model_flags(revision, trust_remote_code), *flags]  # in the cache key too; none for the defaults
    if source != ORACLE and not Path(source).is_file():
        raise ValueError(f"warm_start must be 'oracle', 'none' or a trajectories file; {source!r} is neither")
    folder = aitlrt_home() / "warmstart" / cache_key(source, tasks, model, settings, flags)
    with file_lock(folder):  # another process building the same warm start: wait for it, then reuse it
        return _build(folder, source, tasks, model, settings, flags)


def _build(
    folder: Path, source: str, tasks: Sequence[Task], model: str, settings: RolloutSettings, flags: Sequence[str]
) -> Path:
    """``warm_start``'s model folder in ``folder``: the cached one when ``done.json`` says it is finished, else
    built afresh."""
    done = folder / "done.json"
    if done.is_file():
        log.info("warm start: cached %s (%s)", folder / "model", json.loads(done.read_text()).get("summary", ""))
        return folder / "model"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    started = time.monotonic()
    data = Path(source)
    summary = ""
    if source == ORACLE:
        data = folder / "trajectories.jsonl"
        log.info("warm start: the oracle teacher answers the agent on %d training tasks", len(tasks))
        report = collect(
            tasks,
            teacher_from(ORACLE, tokenizer=model),
            settings,
            reward_funcs(list(DEFAULT_REWARDS)),
            list(DEFAULT_REWARDS.values()),
            teacher_from(ORACLE).default_min_reward,
            data,
            serve_dir=folder / "serve",
        )
        kept = sum(report.kept)
        multi = sum(k and m for k, m in zip(report.kept, report.multi_turn, strict=True))
        summary = (
            f"{kept} of {len(report.kept)} oracle rollouts kept ({multi} multi-turn), {report.calls_written} calls"
        )
        log.info("warm start: %s in %.0f s", summary, report.seconds)
        if not report.calls_written:
            raise RuntimeError(f"warm start: no oracle trajectory reproduced its task's fix (see {folder / 'serve'})")
    log.info("warm start: fine-tuning %s on %s", model, data)
    sft_from_flags(data, model, folder / "model", flags)
    seconds = time.monotonic() - started
    done.write_text(json.dumps({"summary": summary, "seconds": seconds, "data": str(data)}))
    log.info("warm start: %s ready in %.0f s", folder / "model", seconds)
    return folder / "model"

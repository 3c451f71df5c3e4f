"""Does training make the agent better on tasks it did not train on? ``python bench/learning.py`` (no arguments: the
embedded recipe, ``configs/cpu_demo.yaml``; ``--config configs/cpu_demo_miniswe.yaml``: the same recipe with
mini-swe-agent, whose TARGET line ``miniswe_heldout_resolve_above_warm`` names its agent).

The tasks of the recipe are split into training and held-out tasks (``aitlrt.tasks.split``: no mutated function in
both, and at least one file held out whole). The recipe's warm start (oracle teacher + ``aitlrt sft`` on its
``warm_start_share`` of the training tasks and its ``warm_start_from`` sources' tasks, cached, shared by the seeds:
its data and fine-tuning are deterministic) is made once; then for each seed a GRPO
run (``aitlrt/train.py`` on the training tasks only, from the warm start, vLLM seeded) and one evaluation server
that scores, on the held-out tasks and with the run's agent and sampling, the warm start and the warm start + GRPO
(weights reloaded into the same server; paired by seed), and in the first seed the base model too (no paired gain
uses it: scored once, its row counts for every seed in the means). Per checkpoint: the edit rate (the agent's edit
left a non-empty patch), the mean patch similarity to the oracle, the resolve rate (FAIL_TO_PASS and PASS_TO_PASS
pass) and the mean weighted reward of the run's reward functions; GRPO's paired gain is also given per held-out file,
marked as trained on (other functions of it) or never seen.

Everything stays under the folder printed at the start (task splits, warm start, per seed the GRPO checkpoint,
its metrics and the held-out rollouts), so the checkpoints can be evaluated elsewhere with ``aitlrt eval``. Rerun
into the same folder (``AITLRT_BENCH_OUT=runs/bench_learning/STAMP``), a seed's finished GRPO run and held-out
evaluation are kept, not run again (a seed takes ~1.6 h with mini-swe-agent on 2 cores: the 3 seeds can span
sessions); ``bench_minutes`` counts the kept phases' time when they ran.
``zero_loss_updates`` counts the GRPO optimizer updates that ran (not skipped by dynamic sampling) with a zero
gradient norm: updates that could not change a weight.

Choosing a recipe change is done on the training tasks only, never on the held-out ones:
``python bench/learning.py --validate "--learning_rate 2e-5 --max_steps 8" --validate "..."`` splits the *training*
tasks again the same way (a validation file never trained on), makes a warm start on the rest, runs one GRPO per
``--validate`` (each string: ``aitlrt/train.py`` arguments over the recipe's), and scores the warm start and every
run on the validation tasks with ``VALIDATION_ROLLOUTS`` rollouts per task. It prints a table and no TARGET line.
``--validate_from pypi:NAME==VERSION ...`` adds those packages' generated tasks to the validation tasks (packages
neither the warm start nor GRPO trains on: code of another kind, as the held-out ``keys.py`` is to the recipe's
training files), and the gains are printed per package as well. ``--seeds 0,1`` runs each variant's GRPO with each
of these seeds (default 0: one run per variant) and prints each variant's mean gain over its seeds: one seed's
reading of 15 one-group updates can swing by ~0.15 (docs/decisions/0021-validation-split.md).
A variant given ``--save_strategy steps --save_steps N`` is scored at each of its saved steps too (gain vs updates).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from aitlrt.common.procs import die_with_parent  # noqa: E402

CONFIG = ROOT / "configs" / "cpu_demo.yaml"
"""The recipe (``--config``): the embedded one, the README's main job's."""
AGENT_TARGETS = {"aider-warm": "aider", "mini-swe-agent": "miniswe", "mini-swe-agent-tools": "miniswe_tools"}
"""The prefix of the TARGET line that names the run's agent (``agent_target``); an agent not listed: its name, ``-``
as ``_``."""
SEEDS = tuple(int(s) for s in os.environ.get("AITLRT_BENCH_SEEDS", "0,1,2").split(","))
"""Seeds 0, 1, 2; ``AITLRT_BENCH_SEEDS=1`` (a comma-separated list) for a partial run."""
HELDOUT_ROLLOUTS = 8
"""Rollouts per held-out task and checkpoint: pass@8 is read from them. 9 tasks x 4 read one checkpoint anywhere
from 0.102 to 0.210 in reward (three evaluation seeds: docs/notebook/2026-11-27.md#2026-11-27-afternoon): at 4 one
seed's gain carried +/-0.09."""
VALIDATION_ROLLOUTS = 4
"""Rollouts per validation task and checkpoint in ``--validate`` mode."""
LABELS = ("base", "warm start", "warm start + GRPO")
COLUMNS = (
    ("resolve", "resolve_rate"),
    ("2se", "resolve_2se"),
    ("pass@1", "pass@1"),
    ("pass@k", "pass@k"),
    ("edit", "edit_rate"),
    ("P2P-kept", "p2p_kept_edits"),
    ("localis.", "localisation"),
    ("ch.simil", "changed_lines_similarity"),
    ("overlap", "changed_lines_overlap"),
    ("reward", "reward"),
    ("train.rw", "training_reward"),
)
"""The table's columns, resolve rate first (``aitlrt.evaluation.scoring.summarise``; ``2se``: two task-clustered
standard errors of the resolve rate; ``pass@k``: k = the rollouts per task; ``P2P-kept``: the share of edits that
keep every PASS_TO_PASS test; ``localis.``: the share of rollouts whose patch changes a line the oracle changes;
``ch.simil``: similarity of the changed lines alone to the oracle's; ``reward``: the held-out weighted reward;
``train.rw``: the reward the recipe's ``reward_weights`` pay, what GRPO reinforces; with ``--validate``, a variant's
runs show what its own weights pay)."""


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def agent_target(agent: str) -> str:
    """The name of the TARGET line of ``agent``'s arm: its held-out resolve rate after GRPO above the warm start's
    (``miniswe_heldout_resolve_above_warm`` for ``mini-swe-agent``, ``aider_...`` for Aider)."""
    return f"{AGENT_TARGETS.get(agent, agent.replace('-', '_'))}_heldout_resolve_above_warm"


def rl_config(folder: Path, recipe: Path) -> Path:
    """The recipe's config (``--config``) for GRPO from a warm start made already (``warm_and_rl``): its warm-start
    keys dropped, and its ``heldout_from`` (the bench scores its own held-out or validation tasks: the run's own
    evaluation before and after would cost ~4 min each), written into ``folder``."""
    import yaml

    config = yaml.safe_load(recipe.read_text())
    for key in [k for k in config if k.startswith(("warm_start", "heldout_from"))]:
        del config[key]
    path = folder / "grpo_config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def grpo(
    seed: int, tasks: Path, warm: Path, out: Path, recipe: Path, serve_args: str, extra: Sequence[str] = ()
) -> tuple[int, int, int]:
    """``aitlrt/train.py`` on the training tasks from the warm start; (updates, skipped, zero-gradient updates). A run
    whose folder holds its trained model already (``trained``: a rerun into the same ``AITLRT_BENCH_OUT``) is kept,
    not run again; a run's seconds go to ``{out}.seconds``."""
    cmd = [
        sys.executable,
        str(ROOT / "aitlrt" / "train.py"),
        "--config",
        str(rl_config(out.parent, recipe)),
        "--tasks",
        str(tasks),
        "--heldout_share",
        "0",
        "--model_name_or_path",
        str(warm),
        "--seed",
        str(seed),
        "--output_dir",
        str(out),
        "--save_strategy",
        "no",
        "--serve_args",
        f"{serve_args} --seed {seed}",
        *extra,
    ]
    if trained(out):
        print(f"[bench] seed {seed}: GRPO kept from {out}", flush=True)
    else:
        print(f"[bench] seed {seed}: GRPO -> {out} (log {out}.log)", flush=True)
        t0 = time.monotonic()
        with open(f"{out}.log", "w") as log:
            done = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=die_with_parent(signal.SIGTERM)
            )  # a killed bench stops its GRPO run too (train.py stops its agents and servers on SIGTERM)
        if done.returncode:
            raise SystemExit(f"[bench] the GRPO run of seed {seed} failed ({done.returncode}): see {out}.log")
        Path(f"{out}.seconds").write_text(f"{time.monotonic() - t0:.1f}\n")
    from aitlrt.report import metric_names as names
    from aitlrt.report.metrics_file import read_metrics

    steps = [s for s in read_metrics(out / "metrics.jsonl") if names.SKIPPED_UPDATE in s]
    skipped = sum(s[names.SKIPPED_UPDATE] > 0 for s in steps)
    zero = sum(s[names.SKIPPED_UPDATE] == 0 and not s.get(names.GRAD_NORM) for s in steps)
    return len(steps) - skipped, skipped, zero


def trained(out: Path) -> bool:
    """Whether the GRPO run in ``out`` finished: its model (or, ``--use_peft``, its adapter) is saved."""
    return (out / "config.json").exists() or (out / "adapter_config.json").exists()


def kept_seconds(path: Path) -> float:
    """The seconds a kept phase took when it ran (its ``.seconds`` file; 0 for a run made before they were kept)."""
    return float(path.read_text()) if path.exists() else 0.0


def kept_evaluation(path: Path, checkpoints: Sequence[str], tasks: Sequence[str]) -> tuple[dict[str, Any], float]:
    """The results, by checkpoint, and seconds of a seed's held-out evaluation saved by an earlier run into the same
    ``AITLRT_BENCH_OUT`` (``path``) that scored some of ``checkpoints`` on the same ``tasks`` (instance ids, in
    order), if this code still loads them (a trivial policy added since is evaluated alone); else nothing."""
    if not path.exists():
        return {}, 0.0
    try:
        kept = pickle.loads(path.read_bytes())
    except Exception as exc:  # saved by other code: evaluated again
        print(f"[bench] {path} does not load ({exc!r}): evaluating again", flush=True)
        return {}, 0.0
    if kept["tasks"] != list(tasks) or not set(kept["checkpoints"]) <= set(checkpoints):
        print(f"[bench] {path} scored other checkpoints or tasks: evaluating again", flush=True)
        return {}, 0.0
    return dict(zip(kept["checkpoints"], kept["results"], strict=True)), kept["seconds"]


def saving(
    cache: Path, checkpoints: Sequence[str], tasks: Sequence[str], kept: dict[str, Any], missing: Sequence[str],
    earlier: float,
) -> Callable[[Any], None]:  # fmt: skip
    """``evaluate(missing, ...)``'s ``on_result``: each result into ``kept`` (by checkpoint), and what is scored so
    far (with the seconds of ``earlier`` runs and this one) saved to ``cache`` at once, so that an interrupted
    evaluation keeps its finished checkpoints for the rerun (``kept_evaluation``)."""
    start = time.monotonic()

    def keep(result: Any) -> None:
        kept[next(c for c in missing if c not in kept)] = result
        order = [c for c in checkpoints if c in kept]
        saved = {"checkpoints": order, "tasks": list(tasks), "results": [kept[c] for c in order],
                 "seconds": earlier + time.monotonic() - start}  # fmt: skip
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_bytes(pickle.dumps(saved))

    return keep


def main() -> None:
    import argparse

    from trl import ModelConfig, TrlParser

    from aitlrt.common.logs import setup_logging
    from aitlrt.common.model import resolve_model
    from aitlrt.evaluation.checkpoints import TRIVIAL_POLICIES, evaluate, write_results
    from aitlrt.evaluation.heldout import prepare_rows
    from aitlrt.evaluation.scoring import measure_funcs, reward_funcs, summarise
    from aitlrt.tasks.split import split_heldout
    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments, heldout_weights, training_weights
    from aitlrt.training.dataset import load_task_rows

    cli = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    cli.add_argument("--validate", action="append", default=[], metavar="ARGS", help="train.py arguments to compare")
    cli.add_argument("--config", type=Path, default=CONFIG, help="the recipe (default: the embedded one, %(default)s)")
    cli.add_argument("--seeds", default="0", help="with --validate: GRPO seeds per variant, comma-separated")
    cli.add_argument("--validate_from", nargs="+", default=[], metavar="SOURCE",
                     help="with --validate: also validate on these sources' generated tasks (packages nothing trains "
                     "on: code of another kind than the recipe's)")  # fmt: skip
    args = cli.parse_args()
    if args.validate_from and not args.validate:
        cli.error("--validate_from needs --validate (it adds validation tasks; the held-out bench has its own)")
    validating, validation_seeds = args.validate, [int(s) for s in args.seeds.split(",")]
    setup_logging()
    started = time.monotonic()
    parser = TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig))  # type: ignore[arg-type]
    recipe = args.config.resolve()
    script, config, model_args = parser.parse_args_and_config(["--config", str(recipe), "--output_dir", "/tmp/x"])
    if model_args.model_revision not in (None, "main") or config.trust_remote_code:
        cli.error("the bench loads its recipe's model at its main revision, without remote code (model_revision, "
                  "trust_remote_code: aitlrt/train.py honours them)")  # fmt: skip
    out = Path(
        os.environ.get("AITLRT_BENCH_OUT")
        or ROOT / "runs" / ("bench_validate" if validating else "bench_learning") / time.strftime("%Y%m%d-%H%M%S")
    )
    print(f"[bench] everything goes to {out}", flush=True)
    shown = recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe
    print(f"RUN config={shown} agent={config.agent}", flush=True)  # the row of bench/results.py keeps them
    rows = load_task_rows(script)
    train, heldout = split_heldout(rows, script.heldout_share, script.heldout_files, script.heldout_seed)
    if validating:  # the held-out tasks are set aside unseen; the training tasks are split again
        train, heldout = split_heldout(train, script.heldout_share, (), script.heldout_seed)
        heldout += other_kind_rows(args.validate_from, script)
    else:  # a package nothing trains or warms up on (``heldout_from``)
        heldout += other_kind_rows(script.heldout_from, script, script.heldout_from_tasks)
    write_rows(out / "tasks" / "train.jsonl", train)
    write_rows(out / "tasks" / "heldout.jsonl", heldout)
    print(f"[bench] {len(train)} training tasks, {len(heldout)} held-out tasks", flush=True)
    base = resolve_model(model_args.model_name_or_path or "bundled")
    names = list(script.rewards)
    weights = dict(zip(names, heldout_weights(script, config), strict=True))
    training = dict(zip(names, training_weights(script, config), strict=True))
    funcs = {**reward_funcs(names), **measure_funcs()}
    prepared = prepare_rows(heldout)
    if validating:
        validate(validating, validation_seeds, out, train, base, prepared, funcs, weights, training, recipe, script,
                 config)  # fmt: skip
        return
    warm, rl_tasks = warm_and_rl(train, script.warm_start_share, out, base, script, config)
    results: dict[int, dict[str, Any]] = {}
    updates: dict[int, tuple[int, int, int]] = {}
    kept_s = 0.0  # what the phases kept from an earlier run into the same folder took then: in bench_minutes
    for seed in SEEDS:
        run = out / f"seed{seed}"
        run.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        kept_s += kept_seconds(run / "grpo.seconds") if trained(run / "grpo") else 0.0
        updates[seed] = grpo(seed, rl_tasks, warm, run / "grpo", recipe, script.serve_args)
        print(f"[bench] seed {seed}: GRPO done in {time.monotonic() - t0:.0f} s", flush=True)
        first = seed == SEEDS[0]  # the base model and the trivial policies (deterministic) are scored once
        models = [base, str(warm), str(run / "grpo")] if first else [str(warm), str(run / "grpo")]
        checkpoints = models + (list(TRIVIAL_POLICIES) if first else [])
        cache = run / "heldout" / "results.pkl"
        tasks = [t.task.instance_id for t in prepared]
        kept, seconds = kept_evaluation(cache, checkpoints, tasks)
        kept_s += seconds
        missing = [c for c in checkpoints if c not in kept]
        if kept:
            print(f"[bench] seed {seed}: held-out evaluation of {len(kept)} checkpoints kept from {cache}", flush=True)
        if missing:
            evaluate(
                missing,
                prepared,
                config.rollout_settings(HELDOUT_ROLLOUTS, seed=seed),  # the checkpoints' rollouts pair up
                funcs,
                serve_dir=run / "eval-serve",
                max_tokens=config.max_completion_length or 256,
                temperature=config.temperature,
                top_p=config.top_p,
                serve_args=[*shlex.split(script.serve_args), "--seed", str(seed)],
                on_result=saving(cache, checkpoints, tasks, kept, missing, seconds),
            )
        evaluated = [kept[c] for c in checkpoints]
        labels = LABELS[-len(models) :] + (TRIVIAL_POLICIES if first else ())
        for label, result in zip(labels, evaluated, strict=True):
            result.label = label
            result.summary = summarise(result.batch, result.rewards, weights, training)
        if missing:
            write_results(evaluated, run / "heldout", weights=weights)
        results[seed] = {r.label: r for r in evaluated}
        if not first:
            results[seed]["base"] = results[SEEDS[0]]["base"]
        print(f"[bench] seed {seed}: held-out evaluation in {run / 'heldout'}", flush=True)
    minutes = (time.monotonic() - started + kept_s) / 60
    report(results, updates, out, minutes, weights, task_files(rl_tasks), config.agent)


def other_kind_rows(sources: Sequence[str], script: Any, per_source: int | None = None) -> list[dict]:
    """The generated tasks of packages that neither the warm start nor GRPO sees, of another kind than the recipe's
    files: ``--validate_from``'s (``grpo_from_tasks`` per source) or the recipe's ``heldout_from`` (``per_source``).
    A validation package may not be a held-out one: the held-out reading never drives a choice."""
    from aitlrt.training.dataset import source_rows

    trained = set(script.grpo_from) | set(script.warm_start_from)
    if per_source is None:
        trained |= set(script.heldout_from)
    if clash := sorted(set(sources) & trained):
        raise SystemExit(f"[bench] {' '.join(clash)}: the recipe trains on it or holds it out (grpo_from, "
                         "warm_start_from, heldout_from); validate on a source it does not name")  # fmt: skip
    return source_rows(list(sources), per_source or script.grpo_from_tasks, script.generate_max_file_lines)


def cells(summary: dict[str, float]) -> str:
    """``summary``'s ``COLUMNS``, 9 characters each (NaN where a value is missing)."""
    values = {**summary, "resolve_2se": 2 * summary.get("resolve_se", math.nan)}
    return "".join(f"{values.get(key, math.nan):>9.3f}" for _, key in COLUMNS)


def pass_by_kind(result: Any, k: int) -> dict[str, tuple[float, float, int]]:
    """Per task kind (the generator's ``strategy``; ``other`` for rows without one): (pass@1, pass@k, tasks). GRPO
    only reinforces what the policy samples: a kind whose pass@k is 0 gives it no signal."""
    from aitlrt.evaluation.scoring import pass_at_k

    solved: dict[str, list[float]] = {}
    for task, value in zip(result.batch.tasks, result.rewards["tests_pass"], strict=True):
        if not math.isnan(value):
            solved.setdefault(task.instance_id, []).append(value)
    kinds: dict[str, list[tuple[float, float]]] = {}
    for task in {t.instance_id: t for t in result.batch.tasks}.values():
        values = solved.get(task.instance_id, [])
        n, c = len(values), int(sum(values))
        if n:
            kind = str(task.row.get("strategy") or "other")
            kinds.setdefault(kind, []).append((pass_at_k(n, c, 1), pass_at_k(n, c, k)))
    return {
        kind: (statistics.fmean(p for p, _ in v), statistics.fmean(q for _, q in v), len(v))
        for kind, v in sorted(kinds.items())
    }


def paired_gain(before: Any, after: Any, weights: dict[str, float]) -> dict[str, float]:
    """``after`` over ``before``, paired by seed (task and sample), standard errors clustered by task: the weighted
    reward's ``gain`` and ``gain_se``, the resolve rate's ``resolve_gain`` and ``resolve_gain_se``, and
    ``same_patch``."""
    from aitlrt.evaluation.checkpoints import paired_gain as paired
    from aitlrt.evaluation.scoring import paired_difference

    pair = paired(before, after, weights)
    if pair is None:
        raise SystemExit("[bench] the evaluations did not pair up (seeds or tasks differ)")
    tasks = [t.instance_id for t in before.batch.tasks]
    resolve, resolve_se = paired_difference(before.rewards["tests_pass"], after.rewards["tests_pass"], clusters=tasks)
    return {"gain": pair.gain, "gain_se": pair.se, "same_patch": pair.same_patch, "resolve_gain": resolve,
            "resolve_gain_se": resolve_se}  # fmt: skip


def task_files(tasks: Path) -> set[str]:
    """The files the tasks of a task file mutate (a task's first ``files`` entry)."""
    return {json.loads(line)["files"][0] for line in tasks.read_text().splitlines() if line.strip()}


def gains_by_file(
    before: Any, after: Any, weights: dict[str, float], by: Literal["file", "repo"] = "file"
) -> dict[str, tuple[float, float, float, int]]:
    """The paired gains of ``after`` over ``before`` on each held-out file's tasks (``by="repo"``: each package's):
    (resolve gain, weighted reward gain, its task-clustered se, rollouts). Where GRPO's gain lands: on files it
    trained on (other functions), on files it never saw, on a package nothing trained on."""
    from aitlrt.evaluation.scoring import paired_difference, weighted_rewards

    old, new = weighted_rewards(before.rewards, weights), weighted_rewards(after.rewards, weights)
    solved_old, solved_new = before.rewards["tests_pass"], after.rewards["tests_pass"]
    rows: dict[str, list[int]] = {}
    for i, task in enumerate(before.batch.tasks):
        key = task.repo if by == "repo" else task.files[0] if task.files else "?"
        rows.setdefault(key, []).append(i)
    out = {}
    for key, idx in sorted(rows.items()):
        tasks = [before.batch.tasks[i].instance_id for i in idx]
        gain, se = paired_difference([old[i] for i in idx], [new[i] for i in idx], clusters=tasks)
        solved, _ = paired_difference([solved_old[i] for i in idx], [solved_new[i] for i in idx], clusters=tasks)
        out[key] = (solved, gain, se, len(idx))
    return out


def warm_and_rl(train: list[dict], share: float, out: Path, base: str, script: Any, config: Any) -> tuple[Path, Path]:
    """The warm start (cached) on ``share`` of the training tasks (``split_warm_start``) and the file of the tasks
    GRPO trains on."""
    from aitlrt.tasks.split import split_warm_start
    from aitlrt.tasks.task import task_from_row
    from aitlrt.training.dataset import source_rows
    from aitlrt.warmstart.recipe import warm_start

    warm_rows, rl_rows = split_warm_start(train, share, script.heldout_seed)
    rl_tasks = out / "tasks" / ("train.jsonl" if share == 1 else f"rl-{share:g}.jsonl")
    write_rows(rl_tasks, rl_rows)
    extra = source_rows(script.warm_start_from, script.warm_start_from_tasks, script.generate_max_file_lines)
    t0 = time.monotonic()
    flags = shlex.split(script.warm_start_args)
    tasks = [task_from_row(r) for r in warm_rows + extra]
    warm = warm_start(script.warm_start, tasks, base, config.rollout_settings(), flags)
    print(f"[bench] warm start on {len(warm_rows)} training tasks + {len(extra)} of --warm_start_from, GRPO on "
          f"{len(rl_rows)}: {warm} ({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
    return warm, rl_tasks


def intermediate_checkpoints(run: Path) -> list[tuple[int, Path]]:
    """The ``checkpoint-N`` folders a run saved before its last step (a variant with ``--save_strategy steps
    --save_steps N``), by step: scored beside the final weights, they show how the gain grows with the updates."""
    from aitlrt.report import metric_names as names
    from aitlrt.report.metrics_file import read_metrics

    last = sum(names.SKIPPED_UPDATE in entry for entry in read_metrics(run / "metrics.jsonl"))
    saved = ((p.name.removeprefix("checkpoint-"), p) for p in run.glob("checkpoint-*"))
    return sorted((int(step), p) for step, p in saved if step.isdigit() and int(step) < last)


def variant_training(variant: str, recipe: Path, training: dict[str, float]) -> dict[str, float]:
    """The training-reward weights ``variant`` (``aitlrt/train.py`` arguments over ``recipe``'s) trains with, by
    reward name: its run's ``train.rw`` is what it was paid. ``training`` (the recipe's) where it names rewards the
    evaluation does not score (those of ``training``)."""
    from trl import ModelConfig, TrlParser

    from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments, training_weights

    parser = TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig))  # type: ignore[arg-type]
    script, config, _ = parser.parse_args_and_config(
        ["--config", str(recipe), "--output_dir", "/tmp/x", *shlex.split(variant)]
    )
    if not set(script.rewards) <= set(training):
        print(f"[bench] {variant!r} trains on rewards the evaluation does not score ({', '.join(script.rewards)}): "
              "its train.rw uses the recipe's weights", flush=True)  # fmt: skip
        return training
    return dict(zip(script.rewards, training_weights(script, config), strict=True))


def validate(
    variants: Sequence[str],
    seeds: Sequence[int],
    out: Path,
    train: list[dict],
    base: str,
    prepared: Sequence[Any],
    funcs: dict[str, Any],
    weights: dict[str, float],
    training: dict[str, float],
    recipe: Path,
    script: Any,
    config: Any,
) -> None:
    """One GRPO run per variant and seed on the split's training part, each from the warm start of its
    ``--warm_start_share``; all scored beside their warm starts, and each variant's mean gain over its seeds. A run
    already in ``out`` (``AITLRT_BENCH_OUT``) is not run again."""
    import argparse
    import hashlib

    from aitlrt.evaluation.checkpoints import TRIVIAL_POLICIES, evaluate, write_results
    from aitlrt.evaluation.scoring import summarise

    share_flag = argparse.ArgumentParser(add_help=False)
    share_flag.add_argument("--warm_start_share", type=float, default=script.warm_start_share)
    checkpoints: dict[str, str] = {}  # label -> weights
    trained_with: dict[str, dict[str, float]] = {}  # label -> its variant's training-reward weights
    warm_of: dict[str, str] = {}  # variant -> its warm start's label
    seeds_of: dict[str, list[str]] = {}  # variant -> the labels of its seeds' runs
    for variant in variants:
        known, rest = share_flag.parse_known_args(shlex.split(variant))
        warm, rl_tasks = warm_and_rl(train, known.warm_start_share, out, base, script, config)
        own = variant_training(variant, recipe, training)
        warm_label = f"warm start (share {known.warm_start_share:g})"
        checkpoints.setdefault(warm_label, str(warm))
        for seed in seeds:
            run = out / f"variant-{hashlib.sha1(variant.encode()).hexdigest()[:8]}{f'-seed{seed}' if seed else ''}"
            label = (variant or "(the recipe)") + (f" [seed {seed}]" if len(seeds) > 1 else "")
            t0 = time.monotonic()
            done = grpo(seed, rl_tasks, warm, run, recipe, script.serve_args, rest)
            print(f"[bench] {label!r}: {done[0]} updates, {done[1]} skipped, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
            for step, saved in intermediate_checkpoints(run):
                checkpoints[f"{label} @ step {step}"] = str(saved)
                warm_of[f"{label} @ step {step}"] = warm_label
                trained_with[f"{label} @ step {step}"] = own
            checkpoints[label] = str(run)
            warm_of[label] = warm_label
            trained_with[label] = own
            seeds_of.setdefault(variant or "(the recipe)", []).append(label)
    evaluated = evaluate(
        [*checkpoints.values(), *TRIVIAL_POLICIES],
        prepared,
        config.rollout_settings(VALIDATION_ROLLOUTS, seed=0),
        funcs,
        serve_dir=out / "eval-serve",
        max_tokens=config.max_completion_length or 256,
        temperature=config.temperature,
        top_p=config.top_p,
        serve_args=[*shlex.split(script.serve_args), "--seed", "0"],
    )
    summaries, by_label = {}, dict(zip([*checkpoints, *TRIVIAL_POLICIES], evaluated, strict=True))
    for label, result in by_label.items():
        result.label = label
        result.summary = summaries[label] = summarise(
            result.batch, result.rewards, weights, trained_with.get(label, training)
        )
    folder = out / time.strftime("validation-%Y%m%d-%H%M%S")  # a rerun in the same AITLRT_BENCH_OUT keeps earlier ones
    write_results(evaluated, folder, weights=weights)
    header = f"\n{'checkpoint':<52}" + "".join(f"{name:>9}" for name, _ in COLUMNS)
    print(header + f"{'res.gain':>9}{'+/-2se':>9}{'rew.gain':>9}{'+/-2se':>9}{'same':>9}")
    pairs = {}
    for label, summary in summaries.items():
        gain = ""
        if label in warm_of:
            pair = pairs[label] = paired_gain(by_label[warm_of[label]], by_label[label], weights)
            gain = (f"{pair['resolve_gain']:>+9.3f}{2 * pair['resolve_gain_se']:>9.3f}{pair['gain']:>+9.3f}"
                    f"{2 * pair['gain_se']:>9.3f}{pair['same_patch']:>9.2f}")  # fmt: skip
        short = label if len(label) <= 51 else f"{label[:24]}...{label[-24:]}"  # keeps "@ step N", "[seed N]"
        print(f"{short:<52}" + cells(summary) + gain)
    by_repo = {label: gains_by_file(by_label[w], by_label[label], weights, by="repo") for label, w in warm_of.items()}
    for label, repos in by_repo.items():
        print(f"{label}: resolve / reward gain (se, rollouts) by package: " + ", ".join(
            f"{repo} {solved:+.3f} / {gain:+.3f} ({se:.3f}, {n})"
            for repo, (solved, gain, se, n) in repos.items()))  # fmt: skip
    if len(seeds) > 1:
        for variant, labels in seeds_of.items():
            solved = [pairs[label]["resolve_gain"] for label in labels]
            gains = [pairs[label]["gain"] for label in labels]
            noise = 2 * math.sqrt(sum(pairs[label]["gain_se"] ** 2 for label in labels)) / len(labels)
            print(
                f"{variant!r} over seeds {seeds}: mean resolve gain {statistics.fmean(solved):+.3f} (seeds "
                + " / ".join(f"{g:+.3f}" for g in solved)
                + f"); mean reward gain {statistics.fmean(gains):+.3f} "
                f"(+/-{noise:.3f} 2se of the evaluation; seeds {min(gains):+.3f} to {max(gains):+.3f})"
            )
            for repo in by_repo[labels[0]]:
                repo_gains = [by_repo[label][repo][1] for label in labels]
                print(f"    {repo}: mean reward gain {statistics.fmean(repo_gains):+.3f}, seeds "
                      + " / ".join(f"{g:+.3f}" for g in repo_gains))  # fmt: skip
    print(f"validation: {len(prepared)} tasks x {VALIDATION_ROLLOUTS} rollouts, paired by seed with the warm start's "
          "(same: the share that left the same patch); a gain inside +/-2se (two standard errors of the paired "
          f"difference) is not told apart from none; rollouts and report in {folder}")  # fmt: skip


def report(
    results: dict[int, dict[str, Any]],
    updates: dict[int, tuple[int, int, int]],
    out: Path,
    minutes: float,
    weights: dict[str, float],
    trained: set[str],
    agent: str = "aider-warm",
) -> None:
    """The held-out table (resolve rate first; the trivial policies beside), the paired gains and the targets, the
    last one named after the run's ``agent`` (``agent_target``: the mean paired resolve gain over the seeds, > 0)."""
    from aitlrt.evaluation.checkpoints import TRIVIAL_POLICIES
    from aitlrt.report import metric_names as names

    first = SEEDS[0]
    print("\n" + f"{'seed':<6}{'checkpoint':<20}" + "".join(f"{name:>9}" for name, _ in COLUMNS)
          + f"{'updates':>9}{'skipped':>9}")  # fmt: skip
    for seed, by_label in results.items():
        for label in LABELS if seed == first else LABELS[1:]:
            extra = f"{updates[seed][0]:>9}{updates[seed][1]:>9}" if label == LABELS[2] else ""
            print(f"{seed:<6}{label:<20}" + cells(by_label[label].summary) + extra)
    for label in LABELS:
        means = {key: statistics.fmean(results[s][label].summary.get(key, math.nan) for s in results)
                 for _, key in COLUMNS if key != "resolve_2se"}  # fmt: skip
        ses = [results[s][label].summary.get("resolve_se", math.nan) for s in results]
        means["resolve_se"] = math.sqrt(sum(se**2 for se in ses)) / len(ses)  # of the mean over seeds
        print(f"{'mean':<6}{label:<20}" + cells(means))
    for label in TRIVIAL_POLICIES:  # deterministic: one rollout per task, scored in the first seed
        print(f"{'-':<6}{label:<20}" + cells(results[first][label].summary))
    pairs = {s: paired_gain(results[s][LABELS[1]], results[s][LABELS[2]], weights) for s in results}
    print("\nGRPO over the warm start, paired by seed (task and sample), standard errors clustered by task:")
    for seed, p in pairs.items():
        print(f"  seed {seed}: resolve {p['resolve_gain']:+.3f} (se {p['resolve_gain_se']:.3f}), weighted reward "
              f"{p['gain']:+.3f} (se {p['gain_se']:.3f}), same patch {p['same_patch']:.0%}")  # fmt: skip
    by_file = {s: gains_by_file(results[s][LABELS[1]], results[s][LABELS[2]], weights) for s in results}
    for file in sorted({f for gains in by_file.values() for f in gains}):
        seen = "GRPO trained on other functions of it" if file in trained else "never trained on"
        cells_ = ", ".join(f"{by_file[s][file][0]:+.3f} / {by_file[s][file][1]:+.3f}" for s in by_file)
        print(f"  {file} ({by_file[first][file][3]} rollouts per seed; {seen}): resolve / reward gain {cells_}")
    print(f"pass@1 / pass@{HELDOUT_ROLLOUTS} per task kind (seed {first}):")
    kinds = {label: pass_by_kind(results[first][label], HELDOUT_ROLLOUTS) for label in LABELS}
    for kind in kinds[LABELS[1]]:
        cells_ = ", ".join(f"{label} {kinds[label][kind][0]:.2f} / {kinds[label][kind][1]:.2f}" for label in LABELS)
        print(f"  {kind} ({kinds[LABELS[1]][kind][2]} tasks): {cells_}")
    resolve_gains = [p["resolve_gain"] for p in pairs.values()]
    noise = 2 * math.sqrt(sum(p["resolve_gain_se"] ** 2 for p in pairs.values())) / len(pairs)
    print(f"a mean resolve gain within +/-{noise:.3f} (two standard errors) is not told apart from none")
    print(f"checkpoints and task splits: {out}")
    mean_gain = statistics.fmean(resolve_gains)
    gain_ok = all(g > 0 for g in resolve_gains) and mean_gain >= 0.05
    resolve = statistics.fmean(results[s][LABELS[2]].summary[names.SUMMARY_RESOLVE_RATE] for s in results)
    trivial = max(
        results[first][label].summary[names.SUMMARY_REWARD] for label in TRIVIAL_POLICIES if label != "trivial:oracle"
    )
    trained_rewards = [results[s][LABELS[2]].summary[names.SUMMARY_REWARD] for s in results]
    beats = all(r > trivial for r in trained_rewards)
    zero = sum(u[2] for u in updates.values())
    print(f"TARGET heldout_resolve_gain_rl {mean_gain:+.3f} >0_all_seeds_and_>=+0.05 {'PASS' if gain_ok else 'MISS'}")
    print(f"TARGET heldout_resolve_rate {resolve:.3f} >=0.10 {'PASS' if resolve >= 0.10 else 'MISS'}")
    print(f"TARGET beats_trivial {min(trained_rewards) - trivial:+.3f} >0_all_seeds {'PASS' if beats else 'MISS'}")
    print(f"TARGET zero_loss_updates {zero} 0 {'PASS' if zero == 0 else 'MISS'}")
    print(f"TARGET bench_minutes {minutes:.1f} <=90 {'PASS' if minutes <= 90 else 'MISS'}")
    print(f"TARGET {agent_target(agent)} {mean_gain:+.3f} >0 {'PASS' if mean_gain > 0 else 'MISS'}")


if __name__ == "__main__":
    from results import recorded  # bench/results.py: this run's row in bench/results.jsonl

    recorded("learning", main)

"""``configs/cpu_demo_miniswe.yaml``, the CPU demo's second config: parsed by ``aitlrt/train.py``'s own parser, it
names mini-swe-agent with limits its validation accepts and an oracle warm start in its shell format, differs from
``configs/cpu_demo.yaml`` only where it says why, and its learning-bench arm names its agent in a TARGET line and in
its results row."""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from trl import ModelConfig, TrlParser

from aitlrt.rollout.agents import make_agent
from aitlrt.rollout.agents.mini_swe import MiniSweAgent
from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments, heldout_weights
from aitlrt.warmstart.oracle_shell import SHELL
from aitlrt.warmstart.recipe import cache_key
from aitlrt.warmstart.trajectories import oracle_format

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT / "configs" / "cpu_demo_miniswe.yaml"
AIDER = ROOT / "configs" / "cpu_demo.yaml"
DIFFERENT = {  # the keys whose values differ from cpu_demo.yaml's, each commented in the config with why
    "agent",
    "rollout_max_calls",
    "gradient_checkpointing",
    "test_feedback_rounds",
    "max_completion_length",
    "serve_args",
    "context_window",
    "output_dir",
}
DROPPED = {"edit_format", "aider_reminder"}  # Aider's knobs: mini-swe-agent reads neither
ORACLE_CALLS = 5
"""The oracle's calls on a task of its own (``aitlrt.warmstart.oracle_shell``): locate, inspect, patch, run-tests,
submit."""


def parsed(path: Path, tmp_path: Path) -> tuple[AgentScriptArguments, AgentGRPOConfig, ModelConfig]:
    """``path`` as ``aitlrt/train.py`` and ``bench/learning.py`` parse it."""
    parser = TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig))  # type: ignore[arg-type]
    script, config, model_args = parser.parse_args_and_config(["--config", str(path), "--output_dir", str(tmp_path)])
    assert isinstance(script, AgentScriptArguments) and isinstance(config, AgentGRPOConfig)
    assert isinstance(model_args, ModelConfig)
    return script, config, model_args


def served_length(serve_args: str) -> int:
    args = shlex.split(serve_args)
    return int(args[args.index("--max-model-len") + 1])


def bench_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_parses_and_names_mini_swe_agent_with_limits_its_validation_accepts(tmp_path):
    script, config, model_args = parsed(MINI, tmp_path)
    assert config.agent == "mini-swe-agent" and model_args.model_name_or_path == "bundled"
    settings = config.rollout_settings()  # the checks every rollout batch makes (max_calls vs test feedback, ...)
    assert settings.agent == "mini-swe-agent" and settings.max_calls == config.rollout_max_calls
    agent = make_agent(settings.agent, max_calls=settings.max_calls)
    assert isinstance(agent, MiniSweAgent) and agent.warm and not agent.tools
    assert agent.step_limit == config.rollout_max_calls  # mini's own step limit is the proxy's call limit

    # The oracle's path fits the limits: every call it makes, one test run, within the server's context.
    assert config.test_feedback_rounds >= 1 and config.rollout_max_calls >= ORACLE_CALLS
    assert config.rollout_max_calls >= 1 + config.test_feedback_rounds
    assert config.max_completion_length >= 256  # the oracle's longest answer on the recipe's tasks: 247 tokens
    length = served_length(script.serve_args)
    assert config.context_window == length and config.max_row_tokens <= length
    assert config.rollout_max_calls * config.max_completion_length < length  # the answers alone leave the task room
    assert config.rollout_timeout_s > 60 and config.rollout_concurrency == 4

    # Its own warm start: the oracle answers in mini's shell actions, under another cache key than Aider's.
    assert script.warm_start == "oracle" and oracle_format(settings) == SHELL
    _, aider, _ = parsed(AIDER, tmp_path)
    flags = shlex.split(script.warm_start_args)
    aider_key = cache_key("oracle", [], "m", aider.rollout_settings(), flags)
    assert cache_key("oracle", [], "m", settings, flags) != aider_key
    assert len(heldout_weights(script, config)) == len(script.rewards) == len(config.reward_weights)


def test_everything_else_is_the_embedded_recipe_and_each_difference_is_commented():
    mini, aider = yaml.safe_load(MINI.read_text()), yaml.safe_load(AIDER.read_text())
    assert set(aider) - set(mini) == DROPPED and set(mini) - set(aider) == {"test_feedback_rounds"}  # Aider's: 0
    assert {key for key in mini if mini[key] != aider.get(key)} == DIFFERENT
    lines = MINI.read_text().splitlines()
    for key in DIFFERENT - {"output_dir"}:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        block = lines[start : start + 3]  # the key's line and the comment lines under it
        assert any("#" in line for line in block), f"{key}: differs from cpu_demo.yaml without a comment saying why"
    rewards = dict(zip(mini["rewards"], mini["reward_weights"], strict=True))
    assert rewards["anchored_change"] == 0.0  # SEARCH/REPLACE blocks: a shell agent never writes one
    assert rewards["non_empty_patch"] == rewards["edit_tests_pass_fraction"] == 0.0, "a FILE.rej is paid nothing"


def test_the_bench_arm_names_its_agent_and_its_grpo_config_keeps_it(tmp_path):
    learning = bench_module("learning")
    assert learning.agent_target("mini-swe-agent") == "miniswe_heldout_resolve_above_warm"
    assert learning.agent_target("aider-warm") == "aider_heldout_resolve_above_warm"
    grpo = yaml.safe_load(learning.rl_config(tmp_path, MINI).read_text())
    assert grpo["agent"] == "mini-swe-agent" and not [k for k in grpo if k.startswith(("warm_start", "heldout_from"))]


def test_a_seeds_finished_grpo_run_is_kept_on_a_rerun(tmp_path, monkeypatch, capsys):
    """A rerun into the same ``AITLRT_BENCH_OUT`` keeps a seed's trained model and reads its updates back (the mini
    arm's seed does not fit one session: GRPO ~36 min, its evaluation ~1 h); a folder without one runs GRPO."""
    learning = bench_module("learning")
    run = tmp_path / "seed0" / "grpo"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    steps = [{"sampling/skipped_update": 0.0, "grad_norm": 0.3}, {"sampling/skipped_update": 1.0}]
    steps.append({"sampling/skipped_update": 0.0, "grad_norm": 0.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps({**m, "step": i + 1}) + "\n" for i, m in enumerate(steps)))
    monkeypatch.setattr(learning.subprocess, "run", lambda *a, **k: pytest.fail(f"GRPO ran again: {a}"))
    assert learning.grpo(0, tmp_path / "t.jsonl", tmp_path / "warm", run, MINI, "") == (2, 1, 1)
    assert "GRPO kept from" in capsys.readouterr().out
    ran: list[list[str]] = []

    def fake(cmd, **_kw):
        ran.append(cmd)
        return learning.subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(learning.subprocess, "run", fake)
    (run / "config.json").unlink()
    learning.grpo(0, tmp_path / "t.jsonl", tmp_path / "warm", run, MINI, "")
    assert len(ran) == 1 and "--output_dir" in ran[0]


def test_a_seeds_held_out_evaluation_is_kept_on_a_rerun_for_the_checkpoints_it_scored(tmp_path, capsys):
    """The evaluation's results (real ``CheckpointResult``s, pickled) come back by checkpoint with the seconds they
    took, also where the rerun scores more checkpoints (a trivial policy added since: evaluated alone); a checkpoint
    it no longer scores, other tasks or a file this code cannot load: evaluated again."""
    from aitlrt.evaluation.checkpoints import CheckpointResult
    from aitlrt.rollout.batch import Batch
    from aitlrt.rollout.runner import RolloutOutcome
    from aitlrt.tasks.task import task_from_row

    learning = bench_module("learning")
    task = task_from_row({"instance_id": "t1", "problem_statement": "fix f", "repo_path": str(tmp_path)})
    outcome = RolloutOutcome("r0", "t1", "ok", "", "diff", 1, 0, 2, "", trace=[])
    results = [
        CheckpointResult(label, Batch([task], [outcome], [7]), {"tests_pass": [1.0]}, {}) for label in ("w", "g")
    ]
    path = tmp_path / "results.pkl"
    assert learning.kept_evaluation(path, ["w", "g"], ["t1"]) == ({}, 0.0)
    saved = {"checkpoints": ["w", "g"], "tasks": ["t1"], "results": results, "seconds": 812.5}
    path.write_bytes(learning.pickle.dumps(saved))
    kept, seconds = learning.kept_evaluation(path, ["w", "g"], ["t1"])
    assert seconds == 812.5 and list(kept) == ["w", "g"] and kept["g"].label == "g"
    assert kept["w"].batch.outcomes[0].patch == "diff" and kept["w"].batch.tasks[0].instance_id == "t1"
    kept, _ = learning.kept_evaluation(path, ["w", "g", "trivial:reject-file"], ["t1"])
    assert list(kept) == ["w", "g"], "the checkpoint added since is left to evaluate"
    assert learning.kept_evaluation(path, ["w", "g2"], ["t1"]) == ({}, 0.0)
    assert learning.kept_evaluation(path, ["w", "g"], ["t1", "t2"]) == ({}, 0.0)
    path.write_bytes(b"not a pickle")
    assert learning.kept_evaluation(path, ["w", "g"], ["t1"]) == ({}, 0.0)
    assert "evaluating again" in capsys.readouterr().out

    # an evaluation saves each checkpoint as it is scored: one interrupted after "w" keeps "w" for the rerun
    path.unlink()
    kept: dict = {}
    keep = learning.saving(path, ["w", "g"], ["t1"], kept, ["w", "g"], 10.0)
    keep(results[0])
    partial, seconds = learning.kept_evaluation(path, ["w", "g"], ["t1"])
    assert list(partial) == ["w"] and seconds >= 10.0 and list(kept) == ["w"]
    keep(results[1])
    assert list(learning.kept_evaluation(path, ["w", "g"], ["t1"])[0]) == ["w", "g"]


def test_a_results_row_keeps_the_config_and_agent_the_bench_named(tmp_path, capsys):
    results = bench_module("results")
    path = tmp_path / "results.jsonl"

    def bench() -> None:
        print("RUN config=configs/cpu_demo_miniswe.yaml agent=mini-swe-agent")
        print("| checkpoint | resolve |\n| warm start | 0.000 |")
        print("TARGET miniswe_heldout_resolve_above_warm +0.000 >0 MISS")

    results.recorded("learning", bench, path)
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["run"] == {"config": "configs/cpu_demo_miniswe.yaml", "agent": "mini-swe-agent"}
    assert row["summary"] == ["| checkpoint | resolve |", "| warm start | 0.000 |"]  # the RUN line is not the table
    assert row["targets"][0]["name"] == "miniswe_heldout_resolve_above_warm"
    assert "run (config `configs/cpu_demo_miniswe.yaml`, agent `mini-swe-agent`)" in results.render([row])
    capsys.readouterr()


@pytest.fixture(autouse=True)
def _keep_sys_path():
    """``bench/learning.py`` puts the repository's root first on ``sys.path`` when loaded: put it back."""
    before = list(sys.path)
    yield
    sys.path[:] = before


def test_a_validation_variant_shows_what_its_own_reward_weights_pay():
    learning = bench_module("learning")
    recipe = yaml.safe_load(AIDER.read_text())
    training = dict(zip(recipe["rewards"], recipe["reward_weights"], strict=True))
    assert learning.variant_training("", AIDER, training) == training
    weights = [1.0] + [0.0] * (len(training) - 1)
    variant = learning.variant_training("--reward_weights " + " ".join(map(str, weights)), AIDER, training)
    assert variant == dict(zip(training, weights, strict=True))
    fewer = learning.variant_training(
        "--rewards tests_pass localised --reward_weights 1 1 --heldout_reward_weights 1 0", AIDER, training
    )
    assert fewer == training, "a reward the evaluation does not score: the recipe's weights"

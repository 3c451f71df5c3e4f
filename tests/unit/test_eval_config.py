"""``aitlrt eval --config``: a training config's agent, sampling, rewards and training reward become the defaults,
flags given on the command line win (even when they repeat eval's own default), a config that cannot be read is one
clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from aitlrt.cli import parse

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "cpu_demo.yaml")


def test_a_training_config_sets_evals_defaults():
    args = parse(["eval", "--tasks", "t.jsonl", "--config", RECIPE])
    assert (args.agent, args.edit_format, args.aider_reminder) == ("aider-warm", "diff", "none")
    knobs = (args.rollout_max_calls, args.context_window, args.rollout_timeout_s, args.rollout_concurrency)
    assert knobs == (1, 6144, 300, 4)
    assert (args.max_completion_length, args.temperature, args.top_p, args.top_k) == (256, 0.7, 0.95, 0)
    assert args.serve_args == "--enforce-eager --max-model-len 6144"
    assert args.rewards == (
        "tests_pass=1,patch_similarity=0,non_empty_patch=0,tests_pass_fraction=0,unbroken_patch_similarity=0,"
        "edit_tests_pass_fraction=0,anchored_change=0,finished_answers=0,changed_lines_similarity=0,code_edit=0,"
        "code_edit_tests_pass_fraction=0,unbroken_changed_lines_similarity=0,changed_lines_overlap=0.5,"
        "unbroken_changed_lines_overlap=0"
    )
    training = dict(item.split("=") for item in args.training_rewards.split(","))
    assert list(training) == [item.split("=")[0] for item in args.rewards.split(",")]
    assert (training["tests_pass"], training["finished_answers"]) == ("1", "0.1"), "the config's reward_weights"
    assert args.recycle_workspaces and args.seed == 0


def test_flags_given_win_over_the_config():
    args = parse(["eval", "--tasks", "t.jsonl", "--temperature", "1.0", "--config", RECIPE, "--max-calls", "3"])
    assert (args.temperature, args.rollout_max_calls, args.top_p) == (1.0, 3, 0.95)  # 1.0 is also eval's own default
    plain = parse(["eval", "--tasks", "t.jsonl"])
    assert (plain.temperature, plain.top_p, plain.edit_format, plain.config) == (1.0, 1.0, "whole", None)


def test_an_unreadable_config_is_one_clear_error(tmp_path):
    with pytest.raises(SystemExit, match=r"aitlrt eval: --config .*missing\.yaml"):
        parse(["eval", "--tasks", "t.jsonl", "--config", str(tmp_path / "missing.yaml")])

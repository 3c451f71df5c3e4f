"""One definition per knob: the rollout knobs have one name, default and help in training and in every CLI verb that
rolls out; a bad choice is refused from a flag and from a YAML file alike; the docs' configuration tables are the
fields' own help; and the trl options that cannot be honoured are refused with the reason (D8, D14)."""

from __future__ import annotations

import typing
from dataclasses import fields

import pytest
from trl import GRPOConfig, ModelConfig, TrlParser

from aitlrt.cli import parse
from aitlrt.rollout.agents import AGENTS
from aitlrt.rollout.agents.aider import REMINDERS
from aitlrt.rollout.arguments import AgentName, Reminder, RolloutArguments, RolloutSettings
from aitlrt.training import config_docs
from aitlrt.training.config import AgentGRPOConfig, AgentScriptArguments

KNOBS = [f.name for f in fields(RolloutArguments)]
VERBS = {
    "rollout": ["rollout", "--tasks", "t.jsonl"],
    "eval": ["eval", "--tasks", "t.jsonl"],
    "tasks probe": ["tasks", "probe", "--tasks", "t.jsonl"],
    "trajectories": ["trajectories", "--tasks", "t.jsonl", "--teacher", "oracle", "--out", "t.jsonl"],
}


def grpo_config(tmp_path, **kw) -> AgentGRPOConfig:
    return AgentGRPOConfig(output_dir=str(tmp_path), **kw)


def trl_parse(argv: list[str]):
    return TrlParser((AgentScriptArguments, AgentGRPOConfig, ModelConfig)).parse_args_and_config(argv)  # type: ignore[arg-type]


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_that_rolls_out_has_every_knob_with_the_training_default(verb):
    args = parse(VERBS[verb])
    assert {k: getattr(args, k) for k in KNOBS} == {f.name: f.default for f in fields(RolloutArguments)}
    config = AgentGRPOConfig(output_dir="/tmp/unused")  # fills rollout_concurrency with the rank's share
    assert all(getattr(args, k) == getattr(config, k) for k in KNOBS if k != "rollout_concurrency")


def test_a_knob_has_the_same_flag_in_train_and_in_the_verbs_and_its_short_alias(tmp_path):
    argv = ["--rollout_max_calls", "3", "--aider-reminder", "none", "--no_recycle_workspaces", "--timeout", "60"]
    args = parse([*VERBS["rollout"], *argv, "--concurrency", "2"])
    _, config, _ = trl_parse(["--output_dir", str(tmp_path), *argv, "--concurrency", "2"])
    for source in (args, config):
        assert (source.rollout_max_calls, source.aider_reminder, source.recycle_workspaces) == (3, "none", False)
        assert (source.rollout_timeout_s, source.rollout_concurrency) == (60.0, 2)
    assert parse([*VERBS["rollout"], "--max-calls", "2"]).rollout_max_calls == 2  # the CLI's old spelling


def test_the_batch_settings_default_to_the_knobs_defaults():
    assert RolloutArguments().rollout_settings() == RolloutSettings()
    assert RolloutSettings().max_calls == 8  # one default: the training config's (the CLI had none)


def test_the_choices_are_the_agents_and_reminders_that_exist():
    assert typing.get_args(AgentName) == AGENTS
    assert typing.get_args(Reminder) == REMINDERS


def test_a_bad_choice_is_refused_from_a_flag_and_from_a_yaml_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse([*VERBS["rollout"], "--agent", "aidr"])
    assert "invalid choice: 'aidr'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trl_parse(["--output_dir", str(tmp_path), "--weight_sync", "rsync"])
    recipe = tmp_path / "bad.yaml"
    for line, says in [
        ("weight_sync: rsync", "unknown weight_sync 'rsync': one of reload, nccl, none"),
        ("max_staleness: 2", "unknown max_staleness 2: one of 0, 1"),
        ("agent: aidr", "unknown agent 'aidr'"),
        ("vllm_importance_sampling_mode: token", "token_truncate"),
    ]:
        recipe.write_text(f"output_dir: {tmp_path}\n{line}\n")
        with pytest.raises(ValueError, match=says):
            trl_parse(["--config", str(recipe)])


def test_pipelined_steps_without_importance_sampling_are_refused(tmp_path):
    with pytest.raises(ValueError, match="trained as on-policy"):
        grpo_config(tmp_path, max_staleness=1, vllm_importance_sampling_correction=False)
    grpo_config(tmp_path, max_staleness=1)  # corrected against the recorded sampler logprobs
    grpo_config(tmp_path, max_staleness=0, vllm_importance_sampling_correction=False)  # synchronous: on-policy
    # no sync: the server keeps its first weights, so every row is off-policy whatever max_staleness says
    grpo_config(tmp_path, max_staleness=1, vllm_importance_sampling_correction=False, weight_sync="none")


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, '{"enable_thinking": false}'])
def test_chat_template_kwargs_are_refused_as_the_proxy_renders_the_prompts(tmp_path, kwargs):
    with pytest.raises(ValueError, match=r"chat_template_kwargs=.*vLLM's chat template behind aitlrt-serve"):
        grpo_config(tmp_path, chat_template_kwargs=kwargs)
    assert grpo_config(tmp_path, chat_template_kwargs={}).chat_template_kwargs == {}


def test_the_docs_tables_are_the_fields_help():
    assert config_docs.DOCS.read_text() == config_docs.documented(config_docs.DOCS.read_text()), (
        "docs/training.md's configuration tables differ from the fields: run python -m aitlrt.training.config_docs"
    )


def test_every_own_field_is_in_one_table_with_its_help():
    tabled = [f for _, cls in config_docs.GROUPS for f in config_docs.own_fields(cls)]
    trl = {f.name for f in fields(GRPOConfig)}
    own = {f.name for f in fields(AgentScriptArguments)} | {f.name for f in fields(AgentGRPOConfig)} - trl
    assert {f.name for f in tabled} >= own
    assert len(tabled) == len({f.name for f in tabled})
    assert all(f.metadata.get("help") for f in tabled)

"""trl options are honoured on the rows of the recorded calls, or refused by ``AgentGRPOConfig`` with the reason:
the batch ``_batch`` builds (crafted rows, a tiny random model, no server), and one short run against the
scripted upstream for what only a run shows (the KL term, the reference model's sync, trl's completion log and its
printed sample, reward functions' metrics). ``HANDLED`` says, for every field of trl's ``GRPOConfig``, where it is
honoured or that it is refused."""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
from dataclasses import fields

import pandas as pd
import pytest
import torch
from peft import LoraConfig
from trl import GRPOConfig, ModelConfig
from trl.trainer.utils import nanstd

from aitlrt.common.git import git
from aitlrt.common.procs import free_port
from aitlrt.serving.process import ServeProcess
from aitlrt.training import step_metrics
from aitlrt.training.advantages import normalized_sum_advantages
from aitlrt.training.config import (
    GENERATION_ENGINE_OPTIONS,
    AgentGRPOConfig,
    managed_serve_args,
    model_init_kwargs,
    refuse_unsupported_model_args,
    served_model_flags,
)
from aitlrt.training.rows import Row, truncated_rollouts
from aitlrt.training.trainer import AgentGRPOTrainer
from tests.helpers.multirank_run import calls_reward, tiny_trainer

UNUSED = "http://127.0.0.1:9"
ADVANTAGES = [1.0, -0.5, 0.25, -0.75]
OFFSETS = [0.9, -0.8, 0.1, 1.2, -0.3, 0.6, -0.1, 0.05, 0.02, -1.1, 0.7]  # sampler - trainer, per trained token


def rows_with(sampler: list[list[float]] | None = None) -> tuple[list[Row], list[int]]:
    """Rollout 0 as two rows (the second with context tokens), rollouts 1 and 2 as one row each, rollout 3 none."""
    shapes = [([11, 12], [21, 22, 23], [1, 1, 1]), ([11, 12, 21, 22, 23, 31], [41, 42], [1, 1])]
    shapes += [([51], [61, 62, 63, 64], [1, 1, 0, 1]), ([71, 72], [81, 82, 83], [1, 1, 1])]
    rows = [Row(p, c, m, (sampler or [[-7.6] * len(c)] * 4)[i]) for i, (p, c, m) in enumerate(shapes)]
    return rows, [0, 0, 1, 2]


def config(tmp_path, **kw) -> AgentGRPOConfig:
    return AgentGRPOConfig(
        output_dir=str(tmp_path), proxy_url=UNUSED, num_generations=4, per_device_train_batch_size=4, **kw
    )


def policy_logps(trainer, batch) -> torch.Tensor:
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
            batch["completion_ids"].size(1),
        )[0]


def offset_sampler(trainer) -> tuple[list[Row], list[int]]:
    """The rows with sampler logprobs = the trainer's + ``OFFSETS`` on the trained tokens."""
    rows, owners = rows_with()
    old = policy_logps(trainer, trainer.builder.build(rows, owners, ADVANTAGES)[0])
    offsets = iter(OFFSETS)
    sampler = [
        [old[i, j].item() + next(offsets) if m else 0.0 for j, m in enumerate(r.mask)] for i, r in enumerate(rows)
    ]
    return rows_with(sampler)


# ---- refused ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"use_vllm": True}, "aitlrt-serve"),
        ({"min_p": 0.05}, "--min-p"),
        ({"repetition_penalty": 1.1}, "--repetition-penalty"),
        ({"generation_kwargs": {"seed": 1}}, "aitlrt-serve"),
        ({"vllm_importance_sampling_mode": "token"}, "token_truncate"),
        ({"multi_objective_aggregation": "sum"}, "normalize_then_sum"),
        ({"loss_type": "vespo", "vllm_importance_sampling_mode": "sequence_mask"}, "token_truncate or token_mask"),
        ({"beta": 0.04, "loss_type": "grpo"}, "token-normalised loss_type"),
        ({"beta": 0.04, "loss_type": "dr_grpo"}, "token-normalised loss_type"),
        ({"cache_implementation": "static"}, "trl's own generation"),
        ({"use_transformers_continuous_batching": True}, "trl's own generation"),
        ({"vllm_gpu_memory_utilization": 0.5}, "--gpu-memory-utilization"),
        ({"vllm_max_model_length": 4096}, "--max-model-len"),
        ({"vllm_tensor_parallel_size": 2}, "--tensor-parallel-size"),
        ({"vllm_server_port": 8001}, "--serve"),
        ({"vllm_mode": "server"}, "trl's own generation"),
        ({"max_tool_calling_iterations": 3}, "rollout_max_calls"),
        ({"task_difficulty_file": "difficulty.json", "shuffle_dataset": False}, "draws the tasks at random"),
    ],
)
def test_options_that_cannot_be_honoured_are_refused_with_the_reason(tmp_path, settings, says):
    with pytest.raises(ValueError, match=says):
        config(tmp_path, **settings)


HANDLED = {
    **dict.fromkeys(GENERATION_ENGINE_OPTIONS, "refused when set (_refuse_unsupported)"),
    **dict.fromkeys(
        ["use_vllm", "min_p", "repetition_penalty", "generation_kwargs", "chat_template_kwargs"], "refused"
    ),
    "learning_rate": "the Trainer's",
    "model_init_kwargs": "train.py: the policy, tokenizer and reference (test_the_model_is_loaded_as_trls_script_does)",
    "trust_remote_code": "train.py: model, tokenizer, reference and vLLM's --trust-remote-code",
    "router_aux_loss_coef": "trl's _compute_loss (the forward's aux loss passes through)",
    "disable_dropout": "trl's __init__",
    "cast_lm_head_to_fp32": "trl's fused LM head, whose positions alone lm_head.scored_positions_only trims",
    "remove_unused_columns": "forced False: the task columns reach the rollouts",
    "num_generations": "the group size",
    "num_generations_eval": "the group size in eval mode",
    "max_completion_length": "forced by the proxy per call",
    "ds3_gather_for_generation": "no trainer-side generation: nothing is gathered for it",
    "shuffle_dataset": "trl's RepeatSampler; refused False with the curriculum",
    "pad_to_multiple_of": "test_pad_to_multiple_of_pads_the_rows_as_trl_does",
    "generation_batch_size": "trl's sampler and the collector",
    "steps_per_generation": "trl's schedule (max_staleness checks it)",
    "temperature": "forced by the proxy (the managed server gets it)",
    "top_p": "forced by the proxy (the managed server gets it)",
    "top_k": "forced by the proxy (the managed server gets it)",
    "vllm_group_port": "weight_sync=nccl's group port",
    "beta": "test_a_step_with_beta_logs_a_kl_that_grows_after_an_update",
    "num_iterations": "test_old_logprobs_are_computed_where_trl_computes_them",
    **dict.fromkeys(["epsilon", "delta", "epsilon_high"], "trl's _compute_loss"),
    **dict.fromkeys(["sapo_temperature_neg", "sapo_temperature_pos"], "trl's _compute_loss"),
    **dict.fromkeys(["vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"], "trl's _compute_loss"),
    "importance_sampling_level": "per rollout (test_rollout_sequences)",
    "reward_weights": "Scoring",
    "multi_objective_aggregation": "test_normalize_then_sum_is_trls",
    "scale_rewards": "Scoring",
    "loss_type": "test_importance_sampling_is_trls_for_every_mode_and_loss",
    "mask_truncated_completions": "test_mask_truncated_completions_masks_every_row_of_a_rollout_with_a_cut_call",
    "sync_ref_model": "test_sync_ref_model_syncs_the_reference_every_ref_model_sync_steps",
    "ref_model_mixup_alpha": "test_sync_ref_model_syncs_the_reference_every_ref_model_sync_steps",
    "ref_model_sync_steps": "test_sync_ref_model_syncs_the_reference_every_ref_model_sync_steps",
    "top_entropy_quantile": "trl's _compute_loss, one forward per chunk (test_rollout_sequences)",
    **dict.fromkeys(
        ["entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta"],
        "trl's _compute_loss",
    ),
    "entropy_target": "trl's _compute_loss",
    "vllm_importance_sampling_correction": "test_importance_sampling_is_trls_for_every_mode_and_loss",
    "vllm_importance_sampling_mode": "test_importance_sampling_is_trls_for_every_mode_and_loss",
    "vllm_importance_sampling_clip_max": "test_importance_sampling_is_trls_for_every_mode_and_loss",
    "vllm_importance_sampling_clip_min": "test_importance_sampling_is_trls_for_every_mode_and_loss",
    "vllm_importance_sampling_cap": "trl's deprecated alias of vllm_importance_sampling_clip_max",
    "off_policy_mask_threshold": "per rollout (test_rollout_sequences); refused off-policy",
    "use_bias_correction_kl": "test_use_bias_correction_kl_weighs_the_kl_by_trls_ratio",
    "log_completions": "test_log_completions_fills_trls_table_one_entry_per_rollout",
    "log_multimodal": "no images: nothing to log",
    "num_completions_to_print": "test_num_completions_to_print_prints_that_many_rollouts_per_log",
    "log_unique_prompts": "trl's log, on prompts that are the task's (test_log_completions_fills_trls_table...)",
    "log_completions_hub_repo": "trl's CommitScheduler uploads OUTPUT/completions/*.parquet, which trl's log writes",
}
"""Where each option of trl's GRPOConfig (not TrainingArguments') is honoured, or that it is refused."""


def test_every_grpo_option_is_honoured_or_refused():
    """A trl upgrade that adds an option fails here until it is honoured (and said where) or refused."""
    declared = set(GRPOConfig.__annotations__)  # its own fields and the TrainingArguments ones it redefines
    assert set(HANDLED) == declared & {f.name for f in fields(GRPOConfig)}


def test_quantised_loading_is_refused_with_the_reason():
    for flag in ("load_in_4bit", "load_in_8bit"):
        with pytest.raises(ValueError, match="full weights"):
            refuse_unsupported_model_args(ModelConfig(**{flag: True}))
    refuse_unsupported_model_args(ModelConfig())


@pytest.mark.parametrize(
    ("settings", "says"), [({"agent": "aidr"}, "unknown agent"), ({"aider_reminder": "end"}, "none")]
)
def test_agent_settings_are_checked_when_the_config_is_made(tmp_path, settings, says):
    with pytest.raises(ValueError, match=says):
        config(tmp_path, **settings)


def test_importance_sampling_defaults_to_todays_truncated_token_weights(tmp_path):
    args = config(tmp_path)
    assert args.vllm_importance_sampling_correction is True
    assert (args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_max) == ("token_truncate", 3.0)
    assert args.vllm_importance_sampling_clip_min is None
    assert not hasattr(args, "importance_sampling_cap")
    config(tmp_path, loss_type="vespo", beta=0.04)  # token-normalised: allowed


# ---- old logprobs and importance sampling ----------------------------------------------------------------------
def test_old_logprobs_are_computed_where_trl_computes_them(trainer, monkeypatch):
    monkeypatch.setattr(trainer.args, "vllm_importance_sampling_correction", False)
    rows, owners = rows_with()
    batch, gap = trainer.builder.build(rows, owners, ADVANTAGES)
    assert "old_per_token_logps" not in batch and gap is None  # aligned: trl's PPO ratio is 1 by construction
    assert batch["advantages"][:, 0].tolist() == [1.0, 1.0, -0.5, 0.25]  # no importance weight
    monkeypatch.setattr(trainer, "num_iterations", 2)  # the second pass over the batch needs the first's logprobs
    batch, gap = trainer.builder.build(rows, owners, ADVANTAGES)
    torch.testing.assert_close(batch["old_per_token_logps"], policy_logps(trainer, batch))
    assert gap is not None


def trl_ratio(old, sampler, mask, mode, low, high, owners) -> torch.Tensor:
    """trl 1.16's ``vllm_importance_sampling_ratio`` (grpo_trainer.py), the sequence being the rollout."""
    diff = torch.nan_to_num((old - sampler) * mask, nan=0.0)
    if mode.startswith("sequence"):
        per_rollout = {o: sum(diff[i].sum() for i, p in enumerate(owners) if p == o) for o in set(owners)}
        diff = torch.stack([per_rollout.get(o, torch.tensor(0.0)) for o in owners]).unsqueeze(1)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    return ratio.masked_fill((ratio < (low or -math.inf)) | (ratio > (high or math.inf)), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_sampling_is_trls_for_every_mode_and_loss(trainer, monkeypatch, mode):
    """Through ``compute_loss``: a token mode takes the ratio from the loss forward itself (``fused_ratio``), a
    sequence mode from ``BatchBuilder.build``'s separate forward; both give trl's loss with trl's ratio."""
    monkeypatch.setattr(trainer.args, "vllm_importance_sampling_mode", mode)
    monkeypatch.setattr(trainer.args, "vllm_importance_sampling_clip_min", 0.4)
    monkeypatch.setattr(trainer.args, "vllm_importance_sampling_clip_max", 2.0)
    rows, owners = offset_sampler(trainer)
    for loss_type in ["dapo", "grpo", "sapo", "cispo", "bnpo", "dr_grpo", "luspo"]:
        monkeypatch.setattr(trainer, "loss_type", loss_type)
        trainer._metrics["train"].clear()
        ours, gap = trainer.builder.build(rows, owners, ADVANTAGES)
        assert ("old_per_token_logps" in ours) == mode.startswith("sequence") == (gap is not None)
        mask = ours["completion_mask"] * ours["tool_mask"]
        old = policy_logps(trainer, ours)
        expected = trl_ratio(old, ours["sampling_per_token_logps"], mask, mode, 0.4, 2.0, owners)
        with monkeypatch.context() as m:  # trl's own path: unweighted advantages, the ratio applied by trl's loss
            m.setattr(trainer.args, "vllm_importance_sampling_correction", False)
            m.setattr(trainer, "num_iterations", 2)
            plain, _ = trainer.builder.build(rows, owners, ADVANTAGES)
            m.setattr(trainer, "use_vllm", True)
            reference = trainer._compute_loss(trainer.model, {**plain, "importance_sampling_ratio": expected})
        assert trainer.compute_loss(trainer.model, ours).item() == pytest.approx(reference.item(), rel=1e-5)
        gap_max = trainer._metrics["train"]["logprob_gap/max"][-1] if gap is None else gap.max().item()
        assert gap_max == pytest.approx(1.2, abs=1e-5)
    ratios = expected.flatten() if mode.startswith("sequence") else expected[mask.bool()]
    assert (ratios == 0).any() if mode.endswith("mask") else ((ratios == 0.4) | (ratios == 2.0)).any()
    assert ratios.gt(0).any()
    logged = trainer._metrics["train"]["sampling/importance_sampling_ratio/mean"][-1]
    assert logged == pytest.approx(ratios.mean().item(), rel=1e-5)


def test_the_fused_ratio_saves_a_forward_and_changes_no_loss_or_gradient(trainer, monkeypatch):
    """On-policy, a token-mode ratio from the loss forward (one forward per pass) gives the loss, gradients and
    logged ratio and gap of a separate no-grad forward before the update (two)."""
    monkeypatch.setattr(trainer, "loss_type", "dapo")
    rows, owners = offset_sampler(trainer)
    model = trainer.model
    forwards = 0

    def count(*_: object) -> None:
        nonlocal forwards
        forwards += 1

    handle = model.register_forward_pre_hook(count)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(trainer.builder, "fused_ratio", fused)
        trainer._metrics["train"].clear()
        forwards = 0
        model.zero_grad()
        batch, gap = trainer.builder.build(rows, owners, ADVANTAGES)
        if gap is not None:  # the separate forward's gap, logged by _log_step at generation
            step_metrics.log_gap(trainer._metrics["train"], gap, batch["completion_mask"] * batch["tool_mask"])
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if "importance" in k or "gap" in k}
        results.append((forwards, loss.item(), [p.grad.clone() for p in model.parameters()], metrics))
    handle.remove()
    (f_fused, l_fused, g_fused, m_fused), (f_sep, l_sep, g_sep, m_sep) = results
    assert f_sep == 2 * f_fused and f_fused >= 1  # one forward per pass instead of two
    assert l_fused == pytest.approx(l_sep, rel=1e-6) and l_fused != 0.0
    for x, y in zip(g_fused, g_sep, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-8)
    assert m_fused.keys() == m_sep.keys() and len(m_fused) == 5
    for key, value in m_sep.items():
        assert m_fused[key] == pytest.approx(value, rel=1e-5), key


def test_vespo_gets_trls_importance_sampling_ratio_and_plain_advantages(trainer, monkeypatch):
    monkeypatch.setattr(trainer, "loss_type", "vespo")
    monkeypatch.setattr(type(trainer.builder), "min_shared", 0.0)  # every row in one pass: its inputs hold them all
    rows, owners = offset_sampler(trainer)
    batch, _ = trainer.builder.build(rows, owners, ADVANTAGES)
    assert batch["advantages"][:, 0].tolist() == [1.0, 1.0, -0.5, 0.25]
    mask = batch["completion_mask"] * batch["tool_mask"]
    expected = trl_ratio(
        policy_logps(trainer, batch), batch["sampling_per_token_logps"], mask, "token_truncate", None, 3.0, owners
    )
    seen: dict = {}
    original = trainer._compute_loss

    def spy(model, inputs):
        seen["inputs"] = inputs  # the ratio is added to it inside the loss forward
        return original(model, inputs)

    monkeypatch.setattr(trainer, "_compute_loss", spy)
    trainer.compute_loss(trainer.model, batch)
    torch.testing.assert_close(seen["inputs"]["importance_sampling_ratio"], expected)
    torch.testing.assert_close(seen["inputs"]["advantages"], batch["advantages"])
    assert "vespo/phi_seq_mean" in trainer._metrics["train"]


# ---- padding, truncated calls --------------------------------------------------------------------------------
def test_pad_to_multiple_of_pads_the_rows_as_trl_does(trainer, monkeypatch):
    rows, owners = offset_sampler(trainer)
    plain, _ = trainer.builder.build(rows, owners, ADVANTAGES)
    monkeypatch.setattr(trainer, "pad_to_multiple_of", 8)
    padded, _ = trainer.builder.build(rows, owners, ADVANTAGES)
    assert padded["prompt_ids"].size(1) == padded["completion_ids"].size(1) == 8
    assert (plain["prompt_ids"].size(1), plain["completion_ids"].size(1)) == (6, 4)
    loss = trainer._compute_loss(trainer.model, plain).item()
    assert trainer._compute_loss(trainer.model, padded).item() == pytest.approx(loss, rel=1e-5)


def trace(*finishes: str, tag: str | None = None) -> list[dict]:
    return [{"call_index": i, "finish_reason": f, "tag": tag} for i, f in enumerate(finishes)]


def test_mask_truncated_completions_masks_every_row_of_a_rollout_with_a_cut_call(trainer):
    traces = [trace("stop", "length"), trace("stop"), trace("length", tag="weak"), trace()]
    assert not trainer.mask_truncated_completions  # off by default
    assert truncated_rollouts(traces) == {0}  # a cut tagged call is not trained
    assert truncated_rollouts(traces, include_tagged=True) == {0, 2}
    rows, owners = rows_with()
    batch, _ = trainer.builder.build(rows, owners, ADVANTAGES, {0})
    assert batch["tool_mask"].sum(dim=1).tolist() == [0, 0, 3, 3]
    assert batch["num_items_in_batch"].item() == 6


# ---- the dataset's order ------------------------------------------------------------------------------------
def test_shuffle_dataset_false_keeps_the_datasets_order_as_trls_sampler(trainer, monkeypatch):
    monkeypatch.setattr(trainer, "shuffle_dataset", False)
    assert list(trainer._get_train_sampler()) == [0, 0, 0, 0, 1, 1, 1, 1]  # each task's group, in order


# ---- beta: the reference model -----------------------------------------------------------------------------
def test_reference_logprobs_come_from_the_ref_model(tmp_path):
    t = tiny_trainer(UNUSED, str(tmp_path / "repo"), str(tmp_path / "run"), per_device_train_batch_size=4, beta=0.1)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch, _ = t.builder.build(*rows_with(), ADVANTAGES)
    reference = t._get_per_token_logps_and_entropies(
        t.ref_model,
        torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
        torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
        batch["completion_ids"].size(1),
    )[0]
    torch.testing.assert_close(batch["ref_per_token_logps"], reference)
    assert not torch.allclose(batch["ref_per_token_logps"], policy_logps(t, batch))


def test_reference_logprobs_under_peft_are_the_base_models(tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    t = tiny_trainer(
        UNUSED, str(tmp_path / "repo"), str(tmp_path / "run"), per_device_train_batch_size=4, beta=0.1, peft_config=lora
    )
    with torch.no_grad():
        for name, p in t.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    batch, _ = t.builder.build(*rows_with(), ADVANTAGES)
    with t.model.disable_adapter():
        base = policy_logps(t, batch)
    torch.testing.assert_close(batch["ref_per_token_logps"], base)
    assert not torch.allclose(base, policy_logps(t, batch))


def test_the_model_is_loaded_as_trls_script_does(tmp_path):
    """model_args' dtype and attention under model_init_kwargs, for the policy and trl's reference model alike;
    trust_remote_code and a revision reach the managed vLLM too."""
    model_args = ModelConfig(dtype="bfloat16", attn_implementation="sdpa")

    def from_path(model, args, **kw):
        model.save_pretrained(tmp_path / "policy")
        args.model_init_kwargs = model_init_kwargs(args, model_args)
        return AgentGRPOTrainer(model=str(tmp_path / "policy"), args=args, **kw)

    t = tiny_trainer(
        UNUSED,
        str(tmp_path / "repo"),
        str(tmp_path / "run"),
        per_device_train_batch_size=4,
        beta=0.1,
        model_init_kwargs={"attn_implementation": "eager"},
        trainer=from_path,
    )
    for model in (t.model, t.ref_model):
        assert model.dtype == torch.bfloat16
        assert model.config._attn_implementation == "eager"
    assert t.args.model_init_kwargs["revision"] == "main"
    assert served_model_flags(t.args.model_init_kwargs) == []  # the default recipe's server: as before
    load = model_init_kwargs(config(tmp_path, trust_remote_code=True), ModelConfig(model_revision="v2"))
    assert load["trust_remote_code"] and load["dtype"] == "float32" and load["device_map"] is None
    flags = ["--trust-remote-code", "--revision", "v2", "--tokenizer-revision", "v2"]
    assert served_model_flags(load) == flags
    assert served_model_flags(load, ["--revision=v3", "--trust-remote-code"]) == ["--tokenizer-revision", "v2"]


def test_the_managed_servers_flags_are_added_unless_serve_args_name_them(tmp_path):
    """``train.py``'s managed server gets a request timeout, the tool-call parser and the model's revision unless
    ``serve_args`` names them, in either spelling (``--flag value``, ``--flag=value``)."""
    run = config(tmp_path, tool_call_parser="hermes", rollout_timeout_s=300)
    load = {"revision": "v2"}
    added = managed_serve_args(["--enforce-eager"], run, load)
    assert added == ["--enforce-eager", "--request-timeout", "150.0", "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes", "--revision", "v2", "--tokenizer-revision", "v2"]  # fmt: skip
    for spelling in (
        ["--request-timeout", "9", "--tool-call-parser", "x"],
        ["--request-timeout=9", "--tool-call-parser=x"],
    ):
        args = managed_serve_args(spelling, run, load)
        assert args == [*spelling, "--revision", "v2", "--tokenizer-revision", "v2"], spelling


def test_use_bias_correction_kl_weighs_the_kl_by_trls_ratio(tmp_path):
    """trl multiplies the per-token KL by its ratio exp(policy - old) (on by default): here too, on the rows."""
    t = tiny_trainer(
        UNUSED, str(tmp_path / "repo"), str(tmp_path / "run"), per_device_train_batch_size=4, beta=0.1, loss_type="dapo"
    )
    t.model.train()
    t.current_gradient_accumulation_steps = 1
    t.num_iterations = 2  # the old logprobs are kept: the ratio differs from 1 once the policy moves
    batch, _ = t.builder.build(*rows_with(), ADVANTAGES)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    new = policy_logps(t, batch)
    ref, old = batch["ref_per_token_logps"], batch["old_per_token_logps"]
    mask = batch["completion_mask"] * batch["tool_mask"]
    per_token_kl = torch.exp(ref - new) - (ref - new) - 1
    logged = {}
    for corrected in (True, False):
        t.args.use_bias_correction_kl = corrected
        t._metrics["train"].clear()
        t.compute_loss(t.model, batch)
        logged[corrected] = t._metrics["train"]["kl"][-1]
    assert logged[True] == pytest.approx(((per_token_kl * torch.exp(new - old) * mask).sum() / mask.sum()).item())
    assert logged[False] == pytest.approx(((per_token_kl * mask).sum() / mask.sum()).item())
    assert logged[True] != pytest.approx(logged[False])


# ---- normalize_then_sum --------------------------------------------------------------------------------------
def trl_normalize_then_sum(rewards_per_func: torch.Tensor, weights: torch.Tensor, group: int) -> torch.Tensor:
    """trl 1.16's ``normalize_then_sum`` branch of ``_generate_and_score_completions``, transcribed."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, group, rewards_per_func.size(1))
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.size(1))
    rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = nanstd(rewards).expand_as(rewards)
    return torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4), nan=0.0)


def test_normalize_then_sum_is_trls():
    torch.manual_seed(0)
    rewards = torch.rand(12, 3)
    rewards[4] = torch.nan  # unscorable
    rewards[7, 1] = torch.nan  # one function had no say
    weights = torch.tensor([1.0, 0.5, 0.1])
    ours, zero_std = normalized_sum_advantages(rewards, weights, torch.isnan(rewards).all(dim=1), 4)
    torch.testing.assert_close(ours, trl_normalize_then_sum(rewards, weights, 4))
    assert ours[4] == 0 and not zero_std.any()


# ---- one run: KL, ref sync, trl's completion log, reward functions' log_metric / log_extra, normalize_then_sum
def single_call_reward(prompts, completions, completion_ids=None, log_metric=None, log_extra=None, **kwargs):
    log_metric("custom/calls_total", float(sum(kwargs["rollout_calls"])))
    log_extra("calls_seen", list(kwargs["rollout_calls"]))
    return [float(c == 1) for c in kwargs["rollout_calls"]]


@pytest.fixture(scope="module")
def run(scripted_upstream, tmp_path_factory):
    base = tmp_path_factory.mktemp("run")
    repo = base / "repo"
    repo.mkdir()
    (repo / "README").write_text("tiny\n")
    git("init", "-q", cwd=repo)
    git("add", "-A", cwd=repo)
    git("commit", "-qm", "base", cwd=repo)
    proxy = ServeProcess(
        ["--upstream", scripted_upstream, "--run-dir", str(base / "serve")], free_port(), base / "p.log"
    )
    proxy.start()
    printed = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "400"  # rich's table: one line per rollout
    try:
        proxy.wait_ready(timeout_s=60)
        trainer = tiny_trainer(
            proxy.url,
            str(repo),
            str(base / "out"),
            reward_funcs=[calls_reward, single_call_reward],
            per_device_train_batch_size=4,
            beta=0.1,
            log_completions=True,
            num_completions_to_print=2,
            sync_ref_model=True,
            ref_model_sync_steps=2,  # after the second (last) step: both steps' KL are against the initial policy
            ref_model_mixup_alpha=1.0,
            multi_objective_aggregation="normalize_then_sum",
            reward_weights=[1.0, 0.5],
        )
        with contextlib.redirect_stdout(printed):
            trainer.train()
    finally:
        proxy.stop()
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    return trainer, base / "out", printed.getvalue()


def test_a_step_with_beta_logs_a_kl_that_grows_after_an_update(run):
    trainer, _, _ = run
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert len(kl) == 2
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 1e-6


def test_log_completions_fills_trls_table_one_entry_per_rollout(run):
    _, out, _ = run
    table = pd.read_parquet(out / "completions" / "completions_00002.parquet")
    assert len(table) == 4
    assert all(p.startswith("task-") for p in table["prompt"])
    assert all("answer.txt" in c for c in table["completion"])
    assert {"calls_reward", "single_call_reward", "advantage", "calls_seen"} <= set(table.columns)
    assert table["calls_seen"].tolist() == [round(r * 6) for r in table["calls_reward"]]
    assert table["prompt"].nunique() == 1  # a group's rollouts share their task's prompt: log_unique_prompts keeps 1


def test_num_completions_to_print_prints_that_many_rollouts_per_log(run):
    _, _, printed = run
    tables = [t for t in re.split(r"Step \d+", printed) if "task-" in t]
    assert len(tables) >= 2
    assert all(t.count("task-") == 2 for t in tables), printed


def test_sync_ref_model_syncs_the_reference_every_ref_model_sync_steps(run):
    trainer, _, _ = run  # its second step's KL was against the initial policy (test above), then ref <- policy
    for policy, reference in zip(trainer.model.parameters(), trainer.ref_model.parameters(), strict=True):
        torch.testing.assert_close(reference, policy)


def test_reward_functions_log_metric_is_flushed_as_trl_does(run):
    trainer, _, _ = run
    totals = [entry["custom/calls_total"] for entry in trainer.state.log_history if "custom/calls_total" in entry]
    assert len(totals) == 2 and all(t >= 4 for t in totals)


def test_normalize_then_sum_gives_the_rollouts_advantages(run):
    import json

    _, out, _ = run
    for step in (0, 1):
        saved = [json.loads(line) for line in (out / "rollouts" / f"step_{step:04d}.jsonl").open()]
        rewards = torch.tensor([[s["rewards"]["calls_reward"], s["rewards"]["single_call_reward"]] for s in saved])
        expected = trl_normalize_then_sum(rewards, torch.tensor([1.0, 0.5]), 4)
        assert [s["advantage"] for s in saved] == pytest.approx(expected.tolist(), abs=1e-5)

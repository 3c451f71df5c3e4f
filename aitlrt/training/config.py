"""Configuration of an agent-in-the-loop GRPO run: ``AgentGRPOConfig`` (trl's ``GRPOConfig`` plus the rollouts',
the server link's, the step's and the curriculum's parameters) and ``AgentScriptArguments`` (tasks, held-out
evaluation, warm start, serving, rewards), each composed of the mixins of ``aitlrt.training.arguments`` and
``aitlrt.rollout.arguments``, and the checks across them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, cast

import torch
from trl import GRPOConfig, ModelConfig

from aitlrt.common.model import load_kwargs
from aitlrt.common.resources import cpu_mixed_precision, rollout_concurrency
from aitlrt.rollout.arguments import RolloutArguments, check_choices
from aitlrt.training.arguments import (
    CurriculumArguments,
    HeldoutArguments,
    ServerArguments,
    StepArguments,
    TaskArguments,
    WarmStartArguments,
)

ROW_NORMALISED_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")
"""trl's loss types normalised per row (mean over the micro-batch's rows); the others count tokens."""

GENERATION_ENGINE_OPTIONS = {
    "cache_implementation": "leave it unset (vLLM manages its own KV cache)",
    "use_transformers_continuous_batching": "leave it off",
    "transformers_continuous_batching_config": "leave it unset",
    "use_transformers_paged": "leave it off",
    "vllm_mode": "leave it at its default",
    "vllm_model_impl": "give the server --model-impl (with serve: managed, through serve_args)",
    "vllm_enable_sleep_mode": "leave it off",
    "vllm_structured_outputs_regex": "leave it unset",
    "vllm_server_base_url": "give the server's URL as --serve (its vLLM's, for weight_sync=nccl, as vllm_url)",
    "vllm_server_host": "give the server's URL as --serve",
    "vllm_server_port": "give the server's URL as --serve",
    "vllm_server_timeout": "leave it unset (the managed server's start waits for its /health)",
    "vllm_gpu_memory_utilization": "give the server --gpu-memory-utilization (serve_args)",
    "vllm_max_model_length": "give the server --max-model-len (serve_args)",
    "vllm_tensor_parallel_size": "give the server --tensor-parallel-size (serve_args)",
    "max_tool_calling_iterations": "an agent's model calls are capped by rollout_max_calls",
}
"""trl's options of its own generation engines (its vLLM, transformers' generate, its tool-calling loop), which
AITLRT never runs: the agents generate through aitlrt-serve's vLLM. Refused when set away from trl's default, with
what to do instead: a user who sets one expects it to act somewhere."""


def refuse_unsupported_model_args(model_args: ModelConfig) -> None:
    """Refuse trl's ``ModelConfig`` settings that ``train.py`` cannot honour: 4/8-bit loading (QLoRA) would train a
    bitsandbytes-quantised base, whose weights neither the reload nor the NCCL weight sync can hand to vLLM."""
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ValueError(
            "load_in_4bit/load_in_8bit: the policy is synced to vLLM as full weights (weight_sync reload or nccl), "
            "which a bitsandbytes-quantised model does not have; train in bf16/fp32 (use_peft for a LoRA adapter)"
        )


def model_init_kwargs(config: GRPOConfig, model_args: ModelConfig) -> dict[str, Any]:
    """The ``from_pretrained`` keyword arguments of the policy, its tokenizer and trl's reference model, as trl's
    ``grpo.py`` script makes them: ``model_args``' revision, attention implementation and dtype (None: "auto", the
    checkpoint's), ``config.trust_remote_code``, then ``config.model_init_kwargs`` over them. ``device_map`` defaults
    to None (trl's is "auto" on GPU): the Trainer places the model, as "auto" would size its placement by the memory
    the managed vLLM, started first on the same GPU, left free."""
    given = cast(dict[str, Any] | None, config.model_init_kwargs)  # a JSON string is parsed by __post_init__
    return load_kwargs(model_args, config.trust_remote_code, given, device_map=None)


def served_model_flags(kwargs: dict[str, Any], given: Sequence[str] = ()) -> list[str]:
    """vLLM's flags for the model that ``kwargs`` (``model_init_kwargs``) load, so that the server samples from the
    model the trainer trains: the same revision (model and tokenizer) and, with ``trust_remote_code``,
    ``--trust-remote-code``; each flag unless the ``given`` flags (``serve_args``) name it."""
    revision = kwargs.get("revision")
    flags: dict[str, list[str]] = {"--trust-remote-code": []} if kwargs.get("trust_remote_code") else {}
    if revision not in (None, "main"):
        flags |= {"--revision": [str(revision)], "--tokenizer-revision": [str(revision)]}
    named = {arg.split("=")[0] for arg in given}
    return [word for flag, value in flags.items() if flag not in named for word in (flag, *value)]


def managed_serve_args(given: list[str], config: AgentGRPOConfig, kwargs: dict[str, Any]) -> list[str]:
    """``aitlrt-serve``'s arguments for the server ``train.py`` manages: the ``given`` ones (``serve_args``), then
    each flag the run needs unless ``given`` names it (as ``--flag value`` or ``--flag=value``): a request timeout
    (a hung vLLM fails its calls, 504: unscorable, counted towards ``max_unscorable_steps``, well before the rollout's
    timeout, which is the policy's failure), the tool-call parser, the model's revision (``served_model_flags``) and
    the NCCL weight-transfer engine trl's client streams into."""
    named = {arg.split("=")[0] for arg in given}
    args = list(given)
    if "--request-timeout" not in named:
        args += ["--request-timeout", str(max(30.0, config.rollout_timeout_s / 2))]
    if config.tool_call_parser and "--tool-call-parser" not in named:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    args += served_model_flags(kwargs, given)
    if config.weight_sync == "nccl" and "--weight-transfer-config" not in named:
        args += ["--weight-transfer-config", '{"backend": "nccl"}']
    return args


@dataclass
class AgentGRPOConfig(RolloutArguments, ServerArguments, StepArguments, CurriculumArguments, GRPOConfig):
    """``GRPOConfig`` whose generation step is parallel agent rollouts through ``aitlrt-serve``.

    Parameters:
        > Parameters that control the agents' rollouts: ``aitlrt.rollout.arguments.RolloutArguments``

        > Parameters that control the link to the server, the step and the curriculum:
        ``aitlrt.training.arguments`` (``ServerArguments``, ``StepArguments``, ``CurriculumArguments``)

        > Parameters of trl's ``GRPOConfig`` that AITLRT reads its own way

        Sampling (``temperature``, ``top_p``, ``top_k``, ``max_completion_length`` per call) is forced by the proxy;
        with a managed server ``train.py`` passes these very values to it, so trainer and sampler agree.
        ``vllm_importance_sampling_*`` correct against the sampler logprobs of the record (although ``use_vllm`` is
        off: the proxy owns vLLM); a "sequence" of the sequence-level modes is a whole rollout (all its rows), as
        its reward is; ``mask_truncated_completions`` masks every row of a rollout with a trained call cut at
        ``max_completion_length``; ``log_completions`` logs one entry per rollout (prompt: task id and problem
        statement; completion: the final patch). What cannot be honoured is refused here with the reason
        (``_refuse_unsupported``).

    Every field's description is its ``help``; ``docs/training.md``'s tables are generated from them
    (``python -m aitlrt.training.config_docs``).
    """

    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        field(
            default="token_truncate",
            metadata={
                "help": "importance sampling against the recorded sampler logprobs (with "
                "vllm_importance_sampling_correction, computed as trl does): token_truncate, token_mask, "
                "sequence_truncate or sequence_mask (a sequence is a whole rollout, all its rows), bounded by "
                "vllm_importance_sampling_clip_min/max. Default token_truncate (trl's is sequence_mask): a rollout is "
                "thousands of sampled tokens over many calls, and a sequence ratio, the product of their per-token "
                "ratios, would mask or clip nearly every rollout for a small per-token trainer/sampler mismatch; "
                "truncated per-token weights min(exp(trainer - sampler), 3) keep every token's signal"
            },
        )
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = field(
        default="sum_then_normalize",
        metadata={
            "help": "sum_then_normalize (the weighted rewards summed, then normalised per group as scale_rewards "
            "says) or normalize_then_sum (each reward normalised per group first, then the weighted sum), as trl"
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "no loss on a rollout of which a trained call was cut at max_completion_length (finish reason "
            "length); it still counts in its group's baseline"
        },
    )

    def __post_init__(self) -> None:
        if self.use_vllm:
            raise ValueError(
                "use_vllm=True: AITLRT's generation is the agents', through aitlrt-serve, which runs vLLM; leave "
                "use_vllm off (vllm_importance_sampling_* still apply, against the recorded sampler logprobs)"
            )
        if self.rollout_concurrency is None:
            self.rollout_concurrency = rollout_concurrency()
        self.remove_unused_columns = False  # task columns must reach the rollouts and the rewards
        if not torch.cuda.is_available():
            self.use_cpu = True  # else transformers sees one process under torchrun on CPU (world_size 1)
            # trl's default, bf16, becomes bf16 autocast only where the CPU has native bf16 (else ~3x slower than fp32)
            self.bf16 = cpu_mixed_precision(self.bf16, "GRPO")
        super().__post_init__()
        check_choices(self)  # a YAML config's values reach here unchecked by argparse
        self.rollout_settings()  # refuses test feedback out of range now, not at a rollout
        if self.weight_sync == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                "weight_sync=nccl needs CUDA on the trainer (vLLM's NCCL weight-transfer engine); "
                "use weight_sync=reload on CPU or with a filesystem that the server sees"
            )
        self._refuse_unsupported()
        self._check_staleness()
        if self.min_informative_groups < 0 or self.max_sampling_rounds < 1:
            raise ValueError("min_informative_groups must be >= 0 and max_sampling_rounds >= 1")
        if self.max_unscorable_steps < 0:
            raise ValueError(f"max_unscorable_steps must be >= 0 (0: never stop), got {self.max_unscorable_steps}")
        if not 0.0 <= self.curriculum_failed_share <= 1.0:
            raise ValueError(f"curriculum_failed_share must be in [0, 1], got {self.curriculum_failed_share}")

    def _check_staleness(self) -> None:
        """Pipelined steps need one generation per optimizer step, and the importance-sampling correction: without
        it a row sampled by the previous weight version is trained as if on-policy (D8)."""
        if not self.max_staleness:
            return
        if self.steps_per_generation != self.gradient_accumulation_steps or self.num_iterations != 1:
            raise ValueError(
                "max_staleness=1 (pipelined steps) needs one generation per optimizer step: steps_per_generation "
                f"(got {self.steps_per_generation}) = gradient_accumulation_steps (got "
                f"{self.gradient_accumulation_steps}) and num_iterations 1 (got {self.num_iterations}); set "
                "max_staleness=0 for the synchronous loop"
            )
        if not self.vllm_importance_sampling_correction and self.weight_sync != "none":
            # weight_sync none: the server keeps its first weights, every row is off-policy whatever max_staleness
            raise ValueError(
                f"max_staleness={self.max_staleness} with vllm_importance_sampling_correction=False: pipelined steps "
                "train rows sampled by the previous weight version, and only the importance-sampling ratio against "
                "the recorded sampler logprobs corrects for that; without it they would be trained as on-policy. Set "
                "vllm_importance_sampling_correction=True, or max_staleness=0 for the synchronous loop"
            )

    def _refuse_unsupported(self) -> None:
        """Refuse the trl settings this trainer cannot honour, saying why and what to use instead."""
        defaults = {f.name: f.default for f in fields(GRPOConfig) if f.name in GENERATION_ENGINE_OPTIONS}
        for name, instead in GENERATION_ENGINE_OPTIONS.items():
            if getattr(self, name) != defaults[name]:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} configures trl's own generation, which AITLRT does not run: the "
                    f"agents generate through aitlrt-serve's vLLM. {instead[0].upper()}{instead[1:]}"
                )
        if self.task_difficulty_file is not None and not self.shuffle_dataset:
            raise ValueError(
                "shuffle_dataset=False asks for the dataset's order, but task_difficulty_file (the curriculum) draws "
                "the tasks at random by difficulty (seeded with seed): leave shuffle_dataset on, or unset "
                "task_difficulty_file to train on the tasks in the dataset's order"
            )
        for name, unset in (
            ("min_p", self.min_p is None),
            ("repetition_penalty", self.repetition_penalty == 1.0),
            ("generation_kwargs", not self.generation_kwargs),
        ):
            if not unset:
                raise ValueError(
                    f"{name} is set, but aitlrt-serve, not trl, samples: it forces only temperature, top_p, top_k "
                    "and max_completion_length from this config. Leave it unset here and give the server its own "
                    "flag (aitlrt-serve --min-p / --repetition-penalty; with serve: managed, through serve_args)"
                )
        if self.chat_template_kwargs:
            raise ValueError(
                f"chat_template_kwargs={self.chat_template_kwargs!r} is set, but trl renders no prompt here: the "
                "agents' requests are rendered by vLLM's chat template behind aitlrt-serve, which passes no template "
                "kwargs, and the rows are the token ids it recorded (the warm start's SFT renders without them too). "
                "Leave it unset; a template change (e.g. enable_thinking) needs a model whose default template does it"
            )
        if (
            self.loss_type == "vespo"
            and self.vllm_importance_sampling_correction
            and not self.vllm_importance_sampling_mode.startswith("token")
        ):
            raise ValueError(
                "loss_type=vespo folds per-token importance ratios into its own sequence weight (trl's rule): set "
                "vllm_importance_sampling_mode to token_truncate or token_mask, or "
                "vllm_importance_sampling_correction=False"
            )
        if self.beta != 0.0 and self.loss_type in ROW_NORMALISED_LOSSES:
            raise ValueError(
                f"beta={self.beta} with loss_type={self.loss_type}: trl averages this loss per row, and a rollout "
                "becomes a varying number of rows (plus zero-loss padding rows); the trainer reweights the policy "
                "term per rollout through the advantages, but the KL term carries no advantage, so a rollout's KL "
                "weight would depend on how its calls were split. Use beta with a token-normalised loss_type "
                "(dapo, bnpo, cispo or vespo), or beta=0"
            )


@dataclass
class AgentScriptArguments(TaskArguments, HeldoutArguments, WarmStartArguments):
    """The script arguments of ``aitlrt/train.py``: the tasks', the held-out evaluation's and the warm start's
    (``aitlrt.training.arguments``), and below, the parameters that control the rewards and the server."""

    rewards: list[str] = field(
        default_factory=lambda: ["tests_pass", "patch_similarity", "non_empty_patch", "tests_pass_fraction"],
        metadata={
            "help": "built-in reward names (aitlrt.rewards.builtin.REWARDS; any trl reward function in Python); "
            "their weights: reward_weights"
        },
    )
    allow_unisolated_tests: bool = field(
        default=False,
        metadata={
            "help": "run graded tests (the policy's code) even where no sandbox works (no bubblewrap, no unshare): "
            "they then reach the network and can write the host"
        },
    )
    serve: str = field(
        default="managed",
        metadata={
            "help": "'managed' (start vLLM + aitlrt-serve here, with the run's sampling: temperature, top_p, top_k, "
            "max_completion_length) or the URL of a running aitlrt-serve"
        },
    )
    serve_args: str = field(
        default="--enforce-eager", metadata={"help": "extra aitlrt-serve/vLLM flags in managed mode"}
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.warm_start_share <= 1.0:
            raise ValueError(f"warm_start_share must be in [0, 1], got {self.warm_start_share}")
        if self.warm_start_share == 0.0 and not self.warm_start_from:
            raise ValueError("warm_start_share 0 leaves the warm start no task: give it some with warm_start_from")
        for name in ("warm_start_from_tasks", "grpo_from_tasks", "heldout_from_tasks"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"{name} must be at least 1, got {getattr(self, name)} (an empty source list adds none)"
                )
        if self.heldout_reward_weights is not None and len(self.heldout_reward_weights) != len(self.rewards):
            raise ValueError(
                f"heldout_reward_weights has {len(self.heldout_reward_weights)} weights for "
                f"{len(self.rewards)} rewards {self.rewards}"
            )
        if trained := sorted(set(self.heldout_from) & (set(self.grpo_from) | set(self.warm_start_from))):
            raise ValueError(f"heldout_from {', '.join(trained)}: also in grpo_from or warm_start_from (trained on)")
        if self.warm_start_from and self.warm_start != "oracle":
            raise ValueError(f"warm_start_from adds tasks to warm_start 'oracle', not to {self.warm_start!r}")
        if self.warm_start_share < 1.0 and self.warm_start != "oracle":
            raise ValueError(
                f"warm_start_share {self.warm_start_share} splits the tasks for warm_start 'oracle'; "
                f"with warm_start {self.warm_start!r} set it to 1"
            )


def training_weights(script: AgentScriptArguments, config: AgentGRPOConfig) -> list[float]:
    """The weights of the training reward: ``reward_weights``, else 1 each (trl's default)."""
    return list(config.reward_weights or [1.0] * len(script.rewards))


def heldout_weights(script: AgentScriptArguments, config: AgentGRPOConfig) -> list[float]:
    """The weights of the held-out evaluation's weighted reward: ``heldout_reward_weights``, else the training's."""
    return list(script.heldout_reward_weights or training_weights(script, config))

"""Configuration of an agent-in-the-loop GRPO run: trl's ``GRPOConfig`` plus the agent and rollout knobs, and
the script arguments of ``aitlrt/train.py`` (tasks, serving, rewards)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from aitlrt.common.resources import cpu_mixed_precision, rollout_concurrency
from aitlrt.rollout.batch import RolloutSettings

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ROW_NORMALISED_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")
"""trl's loss types normalised per row (mean over the micro-batch's rows); the others count tokens."""


@dataclass
class AgentGRPOConfig(GRPOConfig):
    """``GRPOConfig`` whose generation step is parallel agent rollouts through ``aitlrt-serve``.

    Sampling (``temperature``, ``top_p``, ``top_k``, ``max_completion_length`` per call) is forced by the proxy;
    with a managed server ``train.py`` passes these very values to it, so trainer and sampler agree.

    trl's options are honoured on the rows of the recorded calls or refused here with the reason:
    ``vllm_importance_sampling_*`` correct against the sampler logprobs of the record (although ``use_vllm`` is
    off: the proxy owns vLLM); a "sequence" of the sequence-level modes is a whole rollout (all its rows), as its
    reward is; ``mask_truncated_completions`` masks every row of a rollout with a trained call cut at
    ``max_completion_length``; ``log_completions`` logs one entry per rollout (prompt: task id and problem
    statement; completion: the final patch).
    """

    proxy_url: str = field(default="", metadata={"help": "aitlrt-serve URL (set by train.py in managed mode)"})
    agent: str = field(default="aider-warm", metadata={"help": "aider-warm, aider or single-call"})
    edit_format: str = field(default="whole", metadata={"help": "Aider's edit format: whole (small models), diff"})
    aider_reminder: str = field(
        default="user",
        metadata={
            "help": "Aider's reminder model setting: user (Aider's default: each request's last user message repeats "
            "the edit format's rules, ~650 tokens in diff format), sys (as a final system message) or none (the "
            "system prompt alone carries them)"
        },
    )
    rollout_timeout_s: float = field(default=600.0, metadata={"help": "wall-clock limit per rollout"})
    rollout_max_calls: int | None = field(default=8, metadata={"help": "model calls per rollout (proxy-enforced)"})
    test_feedback_rounds: int = field(
        default=0,
        metadata={
            "help": "test feedback: after an edit, Aider runs the task's tests in the grader's sandbox "
            "(aitlrt.tasks.feedback) and sends the failures back to the model for another try, at most this many "
            "times per rollout (each one more call: rollout_max_calls must be at least 1 + this); 0: no test runs"
        },
    )
    test_feedback_max_chars: int = field(
        default=3000,
        metadata={"help": "test feedback: characters of test output sent back per round (the tracebacks first)"},
    )
    test_feedback_timeout_s: float = field(
        default=120.0, metadata={"help": "test feedback: wall-clock limit of one run of the tests"}
    )
    rollout_concurrency: int | None = field(
        default=None,
        metadata={"help": "agents at once per rank (default: aitlrt.common.resources.rollout_concurrency())"},
    )
    recycle_workspaces: bool = field(
        default=True,
        metadata={"help": "reuse a finished rollout's repository copy, reset and checked pristine, for the next one"},
    )
    context_window: int = field(default=8192, metadata={"help": "context window told to the agent"})
    max_row_tokens: int = field(default=8192, metadata={"help": "tokens per training row; longer rows become windows"})
    max_tokens_per_forward: int | None = field(
        default=16384,
        metadata={
            "help": "tokens per forward/backward pass of the update and of the old/ref logprob forwards: a step's "
            "rows are split into micro-batches, their gradients accumulated (the loss is the whole batch's for every "
            "loss_type); counted as distinct tokens (the common prefix once) with shared_prefix, else padded tokens "
            "(rows x (longest prompt + longest completion)); a row longer than this goes alone; None: one pass over "
            "all of a micro-step's rows"
        },
    )
    shared_prefix: bool = field(
        default=True,
        metadata={
            "help": "forward a micro-batch's common token prefix once (the rows of a group share their prompt): "
            "micro-batches of rows in token order, the prompt's keys and values reused by each row's rest; same "
            "logprobs and gradients, ~2.4x faster on CPU for 4 rows of a 2.6k-token prompt (bench/step.py). Off, "
            "with a log line, under gradient checkpointing, ZeRO-3 or FSDP"
        },
    )
    include_non_policy_calls: bool = field(
        default=False, metadata={"help": "also train on tagged calls (Aider's weak-model summaries)"}
    )
    weight_sync: str = field(
        default="reload",
        metadata={
            "help": "reload (safetensors + POST /weights/reload; CPU, shared FS), nccl (trl's VLLMClient straight to "
            'vLLM; GPU trainer, vLLM started with --weight-transfer-config \'{"backend":"nccl"}\') or none'
        },
    )
    vllm_url: str = field(
        default="",
        metadata={"help": "weight_sync=nccl: vLLM's URL as the trainer sees it (default: the proxy's upstream)"},
    )
    vllm_group_port: int = field(default=51216, metadata={"help": "with weight_sync=nccl: the NCCL group's port"})
    weight_sync_dir: str | None = field(
        default=None, metadata={"help": "folder for the synced weights, visible to vLLM (default OUTPUT/sync)"}
    )
    weight_version_check: str = field(
        default="error", metadata={"help": "error or warn when rows were sampled by an unexpected weight version"}
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "importance sampling against the recorded sampler logprobs (with "
            "vllm_importance_sampling_correction, computed as trl does): token_truncate, token_mask, "
            "sequence_truncate or sequence_mask, bounded by vllm_importance_sampling_clip_min/max. Default "
            "token_truncate (trl's is sequence_mask): a rollout is thousands of sampled tokens over many calls, and "
            "a sequence ratio, the product of their per-token ratios, would mask or clip nearly every rollout for "
            "a small per-token trainer/sampler mismatch; truncated per-token weights min(exp(trainer - sampler), "
            "3) keep every token's signal"
        },
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={
            "help": "no loss on a rollout of which a trained call was cut at max_completion_length (finish reason "
            "length); it still counts in its group's baseline"
        },
    )
    save_rollouts: bool = field(default=True, metadata={"help": "write OUTPUT/rollouts/step_XXXX.jsonl"})
    min_informative_groups: int = field(
        default=1,
        metadata={
            "help": "dynamic sampling: a group whose rewards have zero variance carries no gradient and is not "
            "trained on; a step keeps rolling out further task groups (new tasks from the dataset, as many per round "
            "as a step has) until this many groups (over all ranks) are informative or max_sampling_rounds is "
            "reached; with none informative the update is skipped (no forward/backward, no optimizer step)"
        },
    )
    max_sampling_rounds: int = field(
        default=3, metadata={"help": "dynamic sampling: rounds of rollouts per step at most (1: no extra rounds)"}
    )
    max_unscorable_steps: int = field(
        default=3,
        metadata={
            "help": "stop the run with UnscorableStepsError (naming the rollouts' last reasons and the server's "
            "/health) after this many consecutive training steps in which every rollout was unscorable (failed "
            "outside the policy: a dead or hung server, a failing grader or reward function); 0: never stop"
        },
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "pipelined steps: while the trainer updates on step k's rows, the agents already roll out step "
            "k+1's first round with the weights of version k, so trained rows are at most this many versions behind "
            "the trainer (the importance-sampling ratio corrects for it against the recorded sampler logprobs); 0: "
            "the synchronous loop (roll out, then update). 0 or 1; 1 needs one generation per optimizer step "
            "(steps_per_generation = gradient_accumulation_steps, num_iterations 1)"
        },
    )
    task_difficulty_file: str | None = field(
        default=None,
        metadata={
            "help": "curriculum: the sidecar of `aitlrt tasks probe` (each task's reward mean and solve rate p under "
            "the policy); tasks are drawn by difficulty (aitlrt.training.curriculum): always solved ones never, "
            "mixed and unprobed ones by p(1-p), curriculum_failed_share of the draws from never-solved ones"
        },
    )
    curriculum_failed_share: float = field(
        default=0.2,
        metadata={
            "help": "curriculum: share of task draws given to tasks the probe never solved (all of them when no "
            "task is mixed)"
        },
    )
    curriculum_update: bool = field(
        default=True,
        metadata={
            "help": "curriculum: update each task's difficulty from the rewards of its training rollouts (an online "
            "re-probe: a task whose every rollout is solved drops out)"
        },
    )
    weight_probe: bool = field(
        default=True,
        metadata={
            "help": "before the first generation and after every sync, check that the server scores a fixed "
            "probe as the policy does (aitlrt.training.probe); False: off"
        },
    )
    weight_probe_tolerance: float = field(
        default=0.25,
        metadata={
            "help": "largest mean |server - trainer| probe logprob gap, nats/token (bf16 vLLM CPU vs fp32 "
            "trainer: 0.03-0.09 measured; GPU unmeasured)"
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
        self.rollout_settings()  # refuses an unknown agent, aider_reminder or test feedback now, not at a rollout
        if self.weight_sync not in ("reload", "nccl", "none"):
            raise ValueError(f"weight_sync must be reload, nccl or none, got {self.weight_sync!r}")
        if self.weight_sync == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                "weight_sync=nccl needs CUDA on the trainer (vLLM's NCCL weight-transfer engine); "
                "use weight_sync=reload on CPU or with a filesystem that the server sees"
            )
        if self.weight_version_check not in ("error", "warn"):
            raise ValueError(f"weight_version_check must be error or warn, got {self.weight_version_check!r}")
        self._refuse_unsupported()
        if self.max_staleness not in (0, 1):
            raise ValueError(f"max_staleness must be 0 (synchronous) or 1 (pipelined), got {self.max_staleness}")
        if self.max_staleness and (
            self.steps_per_generation != self.gradient_accumulation_steps or self.num_iterations != 1
        ):
            raise ValueError(
                "max_staleness=1 (pipelined steps) needs one generation per optimizer step: steps_per_generation "
                f"(got {self.steps_per_generation}) = gradient_accumulation_steps (got "
                f"{self.gradient_accumulation_steps}) and num_iterations 1 (got {self.num_iterations}); set "
                "max_staleness=0 for the synchronous loop"
            )
        if self.min_informative_groups < 0 or self.max_sampling_rounds < 1:
            raise ValueError("min_informative_groups must be >= 0 and max_sampling_rounds >= 1")
        if self.max_unscorable_steps < 0:
            raise ValueError(f"max_unscorable_steps must be >= 0 (0: never stop), got {self.max_unscorable_steps}")
        if not 0.0 <= self.curriculum_failed_share <= 1.0:
            raise ValueError(f"curriculum_failed_share must be in [0, 1], got {self.curriculum_failed_share}")

    def rollout_settings(self, n: int = 1, seed: int | None = None) -> RolloutSettings:
        """The run's agent settings for rollouts outside training (warm start, held-out evaluation), ``n`` per task,
        sampled with ``seed`` (``RolloutSettings.seed``; None: unseeded)."""
        return RolloutSettings(
            n=n,
            agent=self.agent,
            edit_format=self.edit_format,
            aider_reminder=self.aider_reminder,
            concurrency=self.rollout_concurrency,
            timeout_s=self.rollout_timeout_s,
            max_calls=self.rollout_max_calls,
            context_window=self.context_window,
            recycle_workspaces=self.recycle_workspaces,
            seed=seed,
            test_feedback_rounds=self.test_feedback_rounds,
            test_feedback_max_chars=self.test_feedback_max_chars,
            test_feedback_timeout_s=self.test_feedback_timeout_s,
        )

    def _refuse_unsupported(self) -> None:
        """Refuse the trl settings this trainer cannot honour, saying why and what to use instead."""
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
        if self.vllm_importance_sampling_mode not in IMPORTANCE_SAMPLING_MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode must be one of {', '.join(IMPORTANCE_SAMPLING_MODES)}, "
                f"got {self.vllm_importance_sampling_mode!r}"
            )
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ValueError(
                "multi_objective_aggregation must be sum_then_normalize or normalize_then_sum, "
                f"got {self.multi_objective_aggregation!r}"
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
class AgentScriptArguments:
    tasks: str = field(
        default="generate",
        metadata={"help": "task file, Hub dataset name, or 'generate' (offline tasks from --generate_from)"},
    )
    task_split: str = field(default="test", metadata={"help": "split of a Hub dataset"})
    task_source: list[str] = field(default_factory=list, metadata={"help": "ID_OR_REPO=SOURCE overrides"})
    generate_from: str = field(default="pypi:cachetools==8.0.1", metadata={"help": "source for --tasks generate"})
    generate_max_file_lines: int | None = field(
        default=None, metadata={"help": "with --tasks generate: mutate only library files this short"}
    )
    num_tasks: int | None = field(default=None, metadata={"help": "use only the first N valid tasks"})
    rewards: list[str] = field(
        default_factory=lambda: ["tests_pass", "patch_similarity", "non_empty_patch", "tests_pass_fraction"],
        metadata={"help": "built-in reward names (aitlrt.rewards.builtin.REWARDS); weights: reward_weights"},
    )
    allow_unisolated_tests: bool = field(
        default=False,
        metadata={
            "help": "run graded tests (the policy's code) even where no sandbox works (no bubblewrap, no unshare): "
            "they then reach the network and can write the host"
        },
    )
    serve: str = field(
        default="managed", metadata={"help": "'managed' (start vLLM + aitlrt-serve here) or an aitlrt-serve URL"}
    )
    serve_args: str = field(
        default="--enforce-eager", metadata={"help": "extra aitlrt-serve/vLLM flags in managed mode"}
    )
    heldout_share: float = field(
        default=0.0,
        metadata={
            "help": "hold out about this share of the tasks (aitlrt.tasks.split: no mutated function in both parts, "
            "and the file with the fewest tasks, or heldout_files, held out whole) and evaluate the policy on them "
            "before and after training; 0: train on every task, no held-out evaluation"
        },
    )
    heldout_files: list[str] = field(
        default_factory=list, metadata={"help": "files whose tasks are all held out (default: the one with fewest)"}
    )
    heldout_seed: int = field(default=0, metadata={"help": "seed of the held-out split (fixed across training seeds)"})
    heldout_rollouts: int = field(default=2, metadata={"help": "rollouts per held-out task per evaluation"})
    warm_start: str = field(
        default="none",
        metadata={
            "help": "before RL: 'oracle' (the oracle teacher's trajectories of the real agent on the training tasks, "
            "then `aitlrt sft`; cached under $AITLRT_HOME/warmstart), a trajectories JSONL of `aitlrt trajectories` "
            "to fine-tune on, or 'none'"
        },
    )
    warm_start_args: str = field(
        default="", metadata={"help": "extra `aitlrt sft` flags for the warm start, e.g. '--num_train_epochs 3'"}
    )
    warm_start_share: float = field(
        default=1.0,
        metadata={
            "help": "with warm_start 'oracle': the share of the training tasks (whole mutated functions, drawn with "
            "heldout_seed) whose oracle trajectories make the warm start; below 1, GRPO trains on the other tasks "
            "only, code whose fix the warm start has not seen (on its own tasks RL mostly rewards recalling "
            "memorised fixes); 1: both use every training task; 0: the warm start is made from warm_start_from's "
            "tasks only and GRPO trains on every training task"
        },
    )
    warm_start_from: list[str] = field(
        default_factory=list,
        metadata={
            "help": "with warm_start 'oracle': more sources (pypi:NAME==VERSION, git:URL@SHA, a path) whose generated "
            "tasks (warm_start_from_tasks each, cached like --tasks generate) join the warm start's tasks only, never "
            "GRPO's or the held-out ones: the agent sees the oracle fix varied code, not only the training files"
        },
    )
    warm_start_from_tasks: int = field(default=24, metadata={"help": "tasks generated per warm_start_from source"})
    grpo_from: list[str] = field(
        default_factory=list,
        metadata={
            "help": "more sources (pypi:NAME==VERSION, git:URL@SHA, a path) whose generated tasks (grpo_from_tasks "
            "each, cached like --tasks generate) join GRPO's training tasks only, never the warm start's or the "
            "held-out ones: RL on varied code, not only the files of --tasks"
        },
    )
    grpo_from_tasks: int = field(default=12, metadata={"help": "tasks generated per grpo_from source"})
    heldout_from: list[str] = field(
        default_factory=list,
        metadata={
            "help": "more sources (pypi:NAME==VERSION, git:URL@SHA, a path) whose generated tasks (heldout_from_tasks "
            "each) join the held-out tasks only: a package that neither the warm start nor GRPO sees, so the held-out "
            "reading covers code of another kind than the training files (refused if also in grpo_from or "
            "warm_start_from)"
        },
    )
    heldout_from_tasks: int = field(default=12, metadata={"help": "tasks generated per heldout_from source"})
    heldout_reward_weights: list[float] | None = field(
        default=None,
        metadata={
            "help": "weights of the rewards in the held-out evaluation's weighted reward (default: reward_weights): "
            "a run that trains on a shaped reward keeps scoring held-out tasks with the reward it is judged by"
        },
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


def heldout_weights(script: AgentScriptArguments, config: AgentGRPOConfig) -> list[float]:
    """The weights of the held-out evaluation's weighted reward: ``heldout_reward_weights``, else the training's."""
    return list(script.heldout_reward_weights or config.reward_weights or [1.0] * len(script.rewards))

"""The training arguments by concern, as dataclass mixins: ``AgentScriptArguments`` inherits the tasks', the held-out
evaluation's and the warm start's, ``AgentGRPOConfig`` the server link's, the step's and the curriculum's (and the
rollouts', ``aitlrt.rollout.arguments``). Fields stay flat (trl's ``TrlParser`` and the YAML configs name them
directly); each mixin's docstring is its group's heading in the parameter docs and in ``docs/training.md``'s tables
(``aitlrt.training.config_docs``). A field's help is its one description: ``--help``, the docs and the tables read
it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class TaskArguments:
    """> Parameters that control the training tasks"""

    tasks: str = field(
        default="generate",
        metadata={
            "help": "task file, Hub dataset name (task_split), or 'generate': offline tasks generated from "
            "generate_from (cached; aitlrt/training/dataset.py)"
        },
    )
    task_split: str = field(default="test", metadata={"help": "split of a Hub dataset"})
    task_source: list[str] = field(
        default_factory=list,
        metadata={"help": "ID_OR_REPO=SOURCE overrides of a task's repository (e.g. PyPI sdists for SWE-bench rows)"},
    )
    generate_from: str = field(
        default="pypi:cachetools==8.0.1",
        metadata={"help": "source (pypi:NAME==VERSION, git:URL@SHA, a path) of --tasks generate"},
    )
    generate_max_file_lines: int | None = field(
        default=None, metadata={"help": "with --tasks generate: mutate only library files this short (None: any)"}
    )
    num_tasks: int | None = field(default=None, metadata={"help": "use only the first N valid tasks (None: all)"})
    grpo_from: list[str] = field(
        default_factory=list,
        metadata={
            "help": "more sources (pypi:NAME==VERSION, git:URL@SHA, a path) whose generated tasks (grpo_from_tasks "
            "each, cached like --tasks generate; generate_max_file_lines applies) join GRPO's training tasks only, "
            "never the warm start's or the held-out ones: RL on varied code, not only the files of --tasks"
        },
    )
    grpo_from_tasks: int = field(default=12, metadata={"help": "tasks generated per grpo_from source"})


@dataclass
class HeldoutArguments:
    """> Parameters that control the held-out evaluation before and after training"""

    heldout_share: float = field(
        default=0.0,
        metadata={
            "help": "hold out about this share of the tasks (aitlrt.tasks.split: no mutated function in both parts, "
            "and the file with the fewest tasks, or heldout_files, held out whole) and evaluate the served policy on "
            "them before and after training, seeded with the run's seed so that the rollouts pair up; 0: train on "
            "every task, no held-out evaluation"
        },
    )
    heldout_files: list[str] = field(
        default_factory=list, metadata={"help": "files whose tasks are all held out (default: the one with fewest)"}
    )
    heldout_seed: int = field(default=0, metadata={"help": "seed of the held-out split (fixed across training seeds)"})
    heldout_rollouts: int = field(default=2, metadata={"help": "rollouts per held-out task per evaluation"})
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
            "help": "weights of the rewards in the held-out evaluation's weighted reward (the before/after table, "
            "bench/learning.py, aitlrt eval --config; None: reward_weights): a run that trains on a shaped reward "
            "keeps scoring held-out tasks with the reward it is judged by"
        },
    )


@dataclass
class WarmStartArguments:
    """> Parameters that control the warm start (supervised fine-tuning before RL; docs/warm-start.md)"""

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


@dataclass
class ServerArguments:
    """> Parameters that control the link to the server: weight sync, version check and probe"""

    proxy_url: str = field(
        default="", metadata={"help": "aitlrt-serve's URL (train.py sets it: the managed server's, or --serve)"}
    )
    weight_sync: Literal["reload", "nccl", "none"] = field(
        default="reload",
        metadata={
            "help": "reload (the main process writes model.safetensors into weight_sync_dir and calls POST "
            "/weights/reload: CPU, a filesystem the server sees), nccl (trl's VLLMClient straight to vLLM: GPU "
            'trainer, vLLM started with --weight-transfer-config \'{"backend":"nccl"}\') or none (the server keeps '
            "its weights)"
        },
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "help": "the managed server's vLLM parses tool calls with this parser (--enable-auto-tool-choice "
            "--tool-call-parser NAME), for agents that send tools (mini-swe-agent-tools): hermes for Qwen2.5-Coder; "
            "the bundled SmolLM2's chat template has no tools; None: no tool calls"
        },
    )
    vllm_url: str = field(
        default="",
        metadata={"help": "weight_sync=nccl: vLLM's URL as the trainer sees it (default: the proxy's upstream)"},
    )
    vllm_group_port: int = field(default=51216, metadata={"help": "with weight_sync=nccl: the NCCL group's port"})
    weight_sync_dir: str | None = field(
        default=None, metadata={"help": "folder for the synced weights, visible to vLLM (None: OUTPUT/sync)"}
    )
    weight_version_check: Literal["error", "warn"] = field(
        default="error",
        metadata={"help": "error or warn when rows were sampled by another weight version than the one synced"},
    )
    weight_probe: bool = field(
        default=True,
        metadata={
            "help": "before the first generation and after every sync, check that the server scores a fixed "
            "probe as the policy does (aitlrt.training.probe); false: off"
        },
    )
    weight_probe_tolerance: float = field(
        default=0.25,
        metadata={
            "help": "largest mean |server - trainer| probe logprob gap, nats/token (bf16 vLLM CPU vs fp32 "
            "trainer: 0.03-0.09 measured; GPU unmeasured)"
        },
    )


@dataclass
class StepArguments:
    """> Parameters that control a training step: rows, passes, pipelining and dynamic sampling"""

    include_non_policy_calls: bool = field(
        default=False, metadata={"help": "also train on tagged calls (Aider's weak-model summaries)"}
    )
    max_row_tokens: int = field(
        default=8192,
        metadata={
            "help": "tokens per training row: a longer row becomes windows, each with up to half the budget of true "
            "preceding context (masked) and the next stretch of sampled tokens, so every sampled token is trained "
            "exactly once"
        },
    )
    max_tokens_per_forward: int | None = field(
        default=16384,
        metadata={
            "help": "tokens per forward/backward pass of the update and of the old/ref logprob forwards: a step's "
            "rows are split into micro-batches, their gradients accumulated (the loss is the whole batch's for every "
            "loss_type; every rank runs the same number of passes); counted as distinct tokens (the common prefix "
            "once) with shared_prefix, else padded tokens (rows x (longest prompt + longest completion)); a row "
            "longer than this goes alone; on CPU, with shared_prefix, only rows sharing half their tokens (one "
            "prompt's) share a pass, and without it every row has its own (padding costs more than a pass there: "
            "aitlrt.common.shared_prefix.CPU_MIN_SHARED); None: one pass over all of a micro-step's rows"
        },
    )
    shared_prefix: bool = field(
        default=True,
        metadata={
            "help": "forward a micro-batch's common token prefix once (the rows of a group share their prompt): "
            "micro-batches of rows in token order, the prompt's keys and values reused by each row's rest "
            "(aitlrt/common/shared_prefix.py); same logprobs and gradients, ~2.4x faster on CPU for 4 rows of a "
            "2.6k-token prompt (bench/step.py); also under gradient checkpointing (non-reentrant, transformers' "
            "default). Off, with a log line, under reentrant checkpointing, ZeRO-3 or FSDP"
        },
    )
    max_staleness: Literal[0, 1] = field(
        default=1,
        metadata={
            "help": "pipelined steps: while the trainer updates on step k's rows, the agents already roll out step "
            "k+1's first round with the weights of version k, so trained rows are at most this many versions behind "
            "the trainer (the importance-sampling ratio corrects for it against the recorded sampler logprobs: "
            "needs vllm_importance_sampling_correction); 0: the synchronous loop (roll out, then update). 1 needs "
            "one generation per optimizer step (steps_per_generation = gradient_accumulation_steps, num_iterations 1)"
        },
    )
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
    save_rollouts: bool = field(default=True, metadata={"help": "write OUTPUT/rollouts/step_XXXX.jsonl"})


@dataclass
class CurriculumArguments:
    """> Parameters that control the curriculum (which tasks a step draws; docs/tasks-and-rewards.md)"""

    task_difficulty_file: str | None = field(
        default=None,
        metadata={
            "help": "curriculum: the sidecar of `aitlrt tasks probe` (each task's reward mean and solve rate p under "
            "the policy); tasks are drawn by difficulty (aitlrt.training.curriculum): confidently solved ones "
            "(weighted reward, a smoothed estimate) never, "
            "mixed and unprobed ones by p(1-p), curriculum_failed_share of the draws from never-solved ones; None: "
            "the dataset's order"
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
            "help": "curriculum: update each task's difficulty estimate from the weighted rewards of its training "
            "rollouts (an online re-probe: a task drops out once confidently solved)"
        },
    )

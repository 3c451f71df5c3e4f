"""Configuration of an agent-in-the-loop GRPO run: trl's ``GRPOConfig`` plus the agent and rollout knobs, and
the script arguments of ``aitlrt/train.py`` (tasks, serving, rewards)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from aitlrt.common.resources import rollout_concurrency


@dataclass
class AgentGRPOConfig(GRPOConfig):
    """``GRPOConfig`` whose generation step is parallel agent rollouts through ``aitlrt-serve``.

    Sampling (``temperature``, ``top_p``, ``top_k``, ``max_completion_length`` per call) is forced by the proxy;
    with a managed server ``train.py`` passes these very values to it, so trainer and sampler agree.
    """

    proxy_url: str = field(default="", metadata={"help": "aitlrt-serve URL (set by train.py in managed mode)"})
    agent: str = field(default="aider-warm", metadata={"help": "aider-warm, aider or single-call"})
    edit_format: str = field(default="whole", metadata={"help": "Aider's edit format: whole (small models), diff"})
    rollout_timeout_s: float = field(default=600.0, metadata={"help": "wall-clock limit per rollout"})
    rollout_max_calls: int | None = field(default=8, metadata={"help": "model calls per rollout (proxy-enforced)"})
    rollout_concurrency: int | None = field(
        default=None,
        metadata={"help": "agents at once per rank (default: aitlrt.common.resources.rollout_concurrency())"},
    )
    recycle_workspaces: bool = field(
        default=True,
        metadata={"help": "reuse a finished rollout's repository copy, reset and checked pristine, for the next one"},
    )
    context_window: int = field(default=8192, metadata={"help": "context window told to the agent"})
    max_row_tokens: int = field(default=8192, metadata={"help": "tokens per training row; longer rows are cut"})
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
    importance_sampling_cap: float | None = field(
        default=3.0, metadata={"help": "truncated IS weight exp(trainer - sampler logprob) per token; None: off"}
    )
    save_rollouts: bool = field(default=True, metadata={"help": "write OUTPUT/rollouts/step_XXXX.jsonl"})

    def __post_init__(self) -> None:
        self.use_vllm = False  # generation is the agents'; the proxy owns vLLM
        if self.rollout_concurrency is None:
            self.rollout_concurrency = rollout_concurrency()
        self.remove_unused_columns = False  # task columns must reach the rollouts and the rewards
        if not torch.cuda.is_available():
            self.use_cpu = True  # else transformers sees one process under torchrun on CPU (world_size 1)
            if self.bf16 is None:
                self.bf16 = False  # trl defaults to bf16, which transformers refuses without a GPU
        super().__post_init__()
        if self.weight_sync not in ("reload", "nccl", "none"):
            raise ValueError(f"weight_sync must be reload, nccl or none, got {self.weight_sync!r}")
        if self.weight_sync == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                "weight_sync=nccl needs CUDA on the trainer (vLLM's NCCL weight-transfer engine); "
                "use weight_sync=reload on CPU or with a filesystem that the server sees"
            )
        if self.weight_version_check not in ("error", "warn"):
            raise ValueError(f"weight_version_check must be error or warn, got {self.weight_version_check!r}")


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
    serve: str = field(
        default="managed", metadata={"help": "'managed' (start vLLM + aitlrt-serve here) or an aitlrt-serve URL"}
    )
    serve_args: str = field(
        default="--enforce-eager", metadata={"help": "extra aitlrt-serve/vLLM flags in managed mode"}
    )

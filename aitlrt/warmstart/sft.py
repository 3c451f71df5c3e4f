"""Supervised fine-tuning on successful agent trajectories (``aitlrt sft``): trl's ``SFTTrainer`` on the model calls
that ``aitlrt trajectories`` wrote, one JSON line per call in trl's conversational prompt-completion form.

The loss covers the completion only (trl's ``completion_only_loss``, on by default for prompt-completion rows): the
applied answer and its end-of-turn token, never the prompt, nor the newline the chat template writes after that token
(``end_at_stop_token``: the sampler stops at the end-of-turn token and never emits it). The prompt is what the agent
sent, Aider's few-shot assistant turns and earlier answers included; ``assistant_only_loss`` would train on those too
(and needs a chat template with ``{% generation %}`` markers, which SmolLM2's lacks). LoRA adapters are merged, so the
output folder is always a full model (safetensors, base dtype) plus tokenizer, which vLLM serves and
``aitlrt/train.py`` starts from.
"""

from __future__ import annotations

import json
import logging
import math
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from accelerate.utils import is_peft_model
from trl import ModelConfig, SFTConfig, SFTTrainer, TrlParser

from aitlrt.common.lm_head import scored_positions_only
from aitlrt.common.memory import unmap_freed_tensors
from aitlrt.common.model import load_kwargs
from aitlrt.common.resources import cpu_mixed_precision
from aitlrt.common.shared_prefix import shared_prefix_forward, use_shared_prefix
from aitlrt.report import metric_names as names
from aitlrt.report.metrics_log import MetricsLog
from aitlrt.report.step_table import SFT_COLUMNS, use_step_table
from aitlrt.warmstart.sft_rows import ChatRow, SftDataError, load_sft_rows

if TYPE_CHECKING:
    from datasets import Dataset
    from peft import PeftConfig
    from transformers import BatchEncoding, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

METRICS_FILE = "sft_metrics.jsonl"
"""Every log entry (loss, learning rate, cumulative tokens, ...) with its step and elapsed seconds, as training goes
(``aitlrt.report.metrics_log.MetricsLog``, as a GRPO run's ``metrics.jsonl``)."""
RESULT_FILE = "sft_result.json"


@dataclass
class SftScriptArguments:
    data: str = field(
        metadata={"help": "JSONL of `aitlrt trajectories`: one model call per line, trl's prompt-completion form"}
    )


@dataclass
class WarmStartSFTConfig(SFTConfig):
    """trl's ``SFTConfig`` with defaults for fine-tuning a small model on long agent prompts, CPU included.

    Differences from trl: ``gradient_checkpointing`` off (it costs an extra forward; a small model needs no memory
    saving), ``max_length`` 4096 (Aider prompts of ~2k tokens plus whole-file answers; a longer row is dropped and
    counted, not truncated: trl keeps the start, so the completion would be cut), batches of 1 row with 8
    accumulation steps (rows differ a lot in length: no padding; with more rows per batch ``shared_prefix`` runs
    their common prefix once and skips the padding), loss logged every step, nothing saved but the final model.
    Without CUDA: ``use_cpu``, and with ``bf16`` unset bf16 autocast only where the CPU computes bf16 natively (AMX,
    AVX512-BF16: faster than fp32), fp32 elsewhere (there bf16 is emulated, ~3x slower).
    """

    output_dir: str | None = field(default="runs/sft", metadata={"help": "the fine-tuned full model goes here"})
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "recompute activations in the backward pass (off: a small model needs none)"}
    )
    max_length: int | None = field(
        default=4096,
        metadata={
            "help": "tokens per row (prompt + completion); with truncation_mode keep_start (default) longer rows are "
            "dropped and counted, as trl's truncation would cut their completion"
        },
    )
    per_device_train_batch_size: int = field(default=1, metadata={"help": "rows per forward pass"})
    gradient_accumulation_steps: int = field(default=8, metadata={"help": "forward passes per optimizer step"})
    logging_steps: float = field(default=1, metadata={"help": "log (loss, tokens, lr) every N optimizer steps"})
    save_strategy: str = field(default="no", metadata={"help": "intermediate checkpoints: no, steps or epoch"})
    shared_prefix: bool = field(
        default=True,
        metadata={
            "help": "a batch's rows run their common token prefix (Aider's system prompt and few-shot turns, ~1,600 "
            "tokens) once, and each row's rest against its keys and values, skipping the padding: same loss and "
            "gradients; with per_device_train_batch_size > 1 (CPU: 1.17x in fp32, no gain under bf16 autocast); off "
            "under gradient checkpointing"
        },
    )
    merge_rollout_calls: bool = field(
        default=False,
        metadata={
            "help": "train each rollout's calls as one row where its history only grows (mini-swe-agent's; Aider's "
            "test-feedback rounds): a call whose tokens are the first of its rollout's next call is folded into it, "
            "its answer trained there in the very same context, so a rollout's prompt runs once, not once per call "
            "(3.8x fewer tokens on mini-swe-agent's oracle trajectories); fewer rows also means fewer optimizer steps. "
            "Off: one row per call"
        },
    )
    freeze_layers: int = field(
        default=0,
        metadata={
            "help": "full fine-tuning of the upper layers only: the input embeddings (and an LM head tied to them) and "
            "the lowest N decoder layers keep their weights, and the backward pass stops above them (on CPU the "
            "attention backward is most of a step). 0: train every weight"
        },
    )

    def __post_init__(self) -> None:
        if not torch.cuda.is_available():
            self.use_cpu = True
            self.bf16 = cpu_mixed_precision(self.bf16, "aitlrt sft")  # unset: bf16 autocast where the CPU has it
        super().__post_init__()


@dataclass
class SftResult:
    """What one fine-tuning run did; also written to ``OUTPUT/sft_result.json``."""

    output_dir: Path
    rows: int  # rows trained (with merge_rollout_calls: a rollout's folded calls are one)
    dropped_too_long: int
    steps: int
    losses: list[float]
    train_loss: float
    tokens: int  # prompt + completion tokens through the model (trl's num_tokens)
    seconds: float
    tokens_per_s: float  # tokens / seconds
    lora: bool

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "output_dir": str(self.output_dir)}


def row_tokens(row: ChatRow, tokenizer: PreTrainedTokenizerBase) -> int:
    """Tokens of prompt + completion under the chat template, as ``SFTTrainer`` tokenizes the row."""
    encoded = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)
    return len(cast("BatchEncoding", encoded)["input_ids"])


def fitting_rows(rows: list[ChatRow], tokenizer: PreTrainedTokenizerBase, max_length: int) -> tuple[list[ChatRow], int]:
    """The rows of at most ``max_length`` tokens and how many were longer (logged): trl truncates the end of a row,
    which is its completion; ``SftDataError`` when none fits."""
    kept = [row for row in rows if row_tokens(row, tokenizer) <= max_length]
    dropped = len(rows) - len(kept)
    if not kept:
        raise SftDataError(f"every one of the {len(rows)} rows is longer than max_length {max_length} tokens")
    if dropped:
        log.warning(
            "%d of %d rows are longer than max_length %d tokens: dropped (truncation would cut their completion); "
            "--max_length N (a training run's warm_start_args) keeps them",
            dropped,
            len(rows),
            max_length,
        )
    return kept, dropped


class CompletionHeadSFTTrainer(SFTTrainer):
    """trl's ``SFTTrainer`` whose LM head sees only the positions from the one predicting the first labelled token
    on (``scored_positions_only``): loss, gradients, entropy and accuracy unchanged. An Aider row is ~97% prompt
    (~3,000 prompt tokens for a ~80-token answer), and on CPU trl's fused head projects every position. Left as
    trl's where its loss needs the full logits (``compute_loss_func``, label smoothing) or shards the sequence
    (sequence parallelism). With ``shared_prefix`` the backbone runs a batch's common prefix once
    (``shared_prefix_forward``)."""

    _sharing: bool | None = None  # decided at the first forward (_shares_prefix)

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.get("labels")
        first = 0  # the first labelled position of the batch
        parallel = getattr(self.accelerator, "parallelism_config", None)
        full_logits = self.compute_loss_func is not None or self.label_smoother is not None
        if (
            isinstance(labels, torch.Tensor)
            and labels.dim() == 2
            and not (return_outputs or full_logits or getattr(parallel, "sp_enabled", False))
        ):
            labelled = (labels != -100).any(dim=0).nonzero()
            first = int(labelled[0]) if len(labelled) else 0
        head = self.accelerator.unwrap_model(model)
        head = head.get_base_model() if is_peft_model(head) else head
        scoring = scored_positions_only(head, cast(torch.Tensor, labels).shape[1] - first) if first else nullcontext()
        sharing = shared_prefix_forward(head) if self._shares_prefix(head) else nullcontext()
        with scoring, sharing:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _shares_prefix(self, head: Any) -> bool:
        """Whether a batch's rows run their common prefix once (``shared_prefix``, where the model allows it: else
        off, logged once)."""
        if self._sharing is None:
            parallel = getattr(self.accelerator, "parallelism_config", None)
            sharded = "sequence parallelism shards the rows" if getattr(parallel, "sp_enabled", False) else None
            self._sharing = use_shared_prefix(bool(getattr(self.args, "shared_prefix", False)), head, sharded)
        return self._sharing


def sft_trainer(
    rows: list[ChatRow],
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: SFTConfig,
    peft_config: PeftConfig | None = None,
) -> SFTTrainer:
    """trl's ``SFTTrainer`` on prompt-completion ``rows``, with the completion-only loss (refusing settings that
    would train on the prompt) and the LM head on the completion only (``CompletionHeadSFTTrainer``)."""
    from datasets import Dataset

    if config.assistant_only_loss or config.completion_only_loss is False:
        raise ValueError(
            "aitlrt sft trains on the applied answer only (completion_only_loss): the prompt holds the agent's "
            "few-shot and earlier assistant turns, which assistant_only_loss or a full-sequence loss would train on"
        )
    merge = bool(getattr(config, "merge_rollout_calls", False))  # WarmStartSFTConfig's; a plain SFTConfig: off
    if merge and config.packing:
        raise ValueError(
            "merge_rollout_calls folds a rollout's calls into one row after trl tokenizes them, and packing has "
            "concatenated the rows by then: use one of them (merging runs a rollout's prompt once; packing does not)"
        )
    trainer = CompletionHeadSFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    unmap_freed_tensors(trainer.accelerator.device)  # on CPU the training's freed activations leave the process
    stops = stop_token_ids(tokenizer, model)
    dataset = cast("Dataset", trainer.train_dataset)
    dataset = dataset.map(lambda row: {"labels": end_at_stop_token(row["labels"], stops)})
    if merge:
        merged, folded = fold_rollout_calls(dataset.to_list())
        log.info("merge_rollout_calls: %d calls folded into their rollout's next call: %d rows", folded, len(merged))
        dataset = Dataset.from_list(merged)
    trainer.train_dataset = dataset.remove_columns(
        [c for c in ("rollout_id", "call_index") if c in dataset.column_names]
    )
    return trainer


def fold_rollout_calls(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Tokenized rows (``input_ids``, ``labels``) with each call folded into its rollout's next call (by
    ``call_index``) where its tokens are that call's first ones: its labelled tokens are labelled there, predicted
    from the same tokens before them, so loss and gradient per token are the row's own. A call whose history the
    next one rewrote, and a row without a ``rollout_id``, stays a row. Returns the rows, a rollout's in the place of
    its first, and how many calls were folded."""
    rollouts: dict[Any, list[dict[str, Any]]] = {}
    for i, row in enumerate(rows):
        rollouts.setdefault(row.get("rollout_id") or ("", i), []).append(row)
    out, folded = [], 0
    for calls in rollouts.values():
        calls = sorted(calls, key=lambda row: row.get("call_index") or 0)
        held = calls[0]
        for call in calls[1:]:
            n = len(held["input_ids"])
            if call["input_ids"][:n] == held["input_ids"]:
                labels = [a if a != -100 else b for a, b in zip(held["labels"], call["labels"][:n], strict=True)]
                held, folded = {**call, "labels": labels + call["labels"][n:]}, folded + 1
            else:
                out.append(held)
                held = call
        out.append(held)
    return out, folded


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> set[int]:
    """The tokens the sampler stops at: the tokenizer's end of sequence and the model's generation config's (vLLM
    stops at both): SmolLM2's and Qwen's ``<|im_end|>``."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids = configured if isinstance(configured, list) else [configured]
    return {int(i) for i in [tokenizer.eos_token_id, *ids] if i is not None}


def end_at_stop_token(labels: list[int], stops: set[int]) -> list[int]:
    """``labels`` with each run of trained tokens ending at its last stop token (``stop_token_ids``, included): the
    chat template writes a newline after ``<|im_end|>`` that the sampler never emits (it stops at ``<|im_end|>``),
    so training it would teach the policy a token it never samples (D12). A run without a stop token is kept."""
    out = list(labels)
    start = 0
    while start < len(out):
        if out[start] == -100:
            start += 1
            continue
        end = start
        while end < len(out) and out[end] != -100:
            end += 1
        last = max((k for k in range(start, end) if out[k] in stops), default=None)
        if last is not None:
            out[last + 1 : end] = [-100] * (end - last - 1)
        start = end
    return out


def train_sft(script: SftScriptArguments, config: WarmStartSFTConfig, model_args: ModelConfig) -> SftResult:
    """Fine-tune ``model_args.model_name_or_path`` (``bundled``: the bundled model) on ``script.data`` with
    ``config``; LoRA with ``model_args.use_peft`` (merged at the end); write the full model to ``config.output_dir``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import get_peft_config

    from aitlrt.common.model import resolve_model

    rows = load_sft_rows(script.data)
    model_path = resolve_model(model_args.model_name_or_path or "bundled")
    out_dir = Path(config.output_dir or "runs/sft")
    load = sft_model_kwargs(config, model_args)
    config.model_init_kwargs = None  # applied here: trl would warn that they are ignored for a loaded model
    source = {"revision": load["revision"], "trust_remote_code": load["trust_remote_code"]}
    tokenizer = AutoTokenizer.from_pretrained(model_path, **source)
    kept, dropped = rows, 0
    if config.max_length is not None and config.truncation_mode == "keep_start":
        kept, dropped = fitting_rows(rows, tokenizer, config.max_length)
    model = AutoModelForCausalLM.from_pretrained(model_path, **load)
    base_config = AutoConfig.from_pretrained(model_path, **source)
    peft_config = get_peft_config(model_args)
    if config.freeze_layers:
        if peft_config is not None:
            raise ValueError("freeze_layers is for full fine-tuning; with use_peft only the LoRA adapters train")
        freeze_lower_layers(model, config.freeze_layers)
    trainer = sft_trainer(kept, model, tokenizer, config, peft_config)
    _refuse_sharded(trainer)
    use_step_table(trainer, SFT_COLUMNS, key="loss")  # one progress display: the table apart from the bar
    trainer.add_callback(MetricsLog(out_dir / METRICS_FILE))
    lora = peft_config is not None
    trained_rows = len(cast("Dataset", trainer.train_dataset))
    log.info(
        "fine-tuning %s (%s) on %d rows of %s",
        model_path,
        f"LoRA r={model_args.lora_r}, merged at the end"
        if lora
        else f"the layers above the lowest {config.freeze_layers}"
        if config.freeze_layers
        else "all weights",
        trained_rows,
        script.data,
    )
    output = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    history = trainer.state.log_history
    losses = [entry[names.LOSS] for entry in history if names.LOSS in entry]
    tokens = next((int(entry[names.NUM_TOKENS]) for entry in reversed(history) if names.NUM_TOKENS in entry), 0)
    seconds = output.metrics["train_runtime"]
    if not all(math.isfinite(loss) for loss in losses):
        raise FloatingPointError(f"aitlrt sft: non-finite training loss {losses}; nothing saved")
    _save_full_model(trainer, tokenizer, out_dir, base_config)
    result = SftResult(
        output_dir=out_dir,
        rows=trained_rows,
        dropped_too_long=dropped,
        steps=trainer.state.global_step,
        losses=losses,
        train_loss=output.training_loss,
        tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        lora=lora,
    )
    if trainer.accelerator.is_main_process:
        (out_dir / RESULT_FILE).write_text(json.dumps(result.as_json(), indent=1) + "\n")
    return result


def sft_model_kwargs(config: SFTConfig, model_args: ModelConfig) -> dict[str, Any]:
    """The ``from_pretrained`` keyword arguments of the model to fine-tune (``load_kwargs``, as trl's ``sft.py``
    script makes them; a dtype name as ``torch``'s). ``ValueError`` for a quantised load (``load_in_4bit``/
    ``load_in_8bit``): the output is a full model with any LoRA merged into it."""
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise ValueError(
            "load_in_4bit/load_in_8bit: aitlrt sft writes a full model (LoRA merged) for vLLM and aitlrt train, "
            "which a bitsandbytes-quantised base cannot give; fine-tune in bf16/fp32 (use_peft for LoRA)"
        )
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else getattr(torch, model_args.dtype)
    given = cast(dict[str, Any] | None, config.model_init_kwargs)  # a JSON string is parsed by __post_init__
    return load_kwargs(model_args, config.trust_remote_code, given, dtype=dtype or "auto")


def freeze_lower_layers(model: PreTrainedModel, count: int) -> None:
    """Turn off the gradients of ``model``'s input embeddings and of its lowest ``count`` decoder layers (an output
    head tied to the embeddings freezes with them): no activation gradient is needed below the first trainable
    layer, so autograd's backward ends there. ``ValueError`` for a count outside 1..layers-1 or a model without a
    ``layers`` list in its decoder."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"freeze_layers: {type(model).__name__} has no list of decoder layers to freeze")
    if not 0 < count < len(layers):
        raise ValueError(f"freeze_layers must be between 1 and {len(layers) - 1} for {len(layers)} layers: {count}")
    model.get_input_embeddings().requires_grad_(False)
    for layer in layers[:count]:
        layer.requires_grad_(False)
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    log.info(
        "freeze_layers: embeddings%s and decoder layers 0-%d keep their weights; layers %d-%d train",
        " (and the tied LM head)" if tied else "",
        count - 1,
        count,
        len(layers) - 1,
    )


def _refuse_sharded(trainer: SFTTrainer) -> None:
    plugin = trainer.accelerator.state.deepspeed_plugin if trainer.is_deepspeed_enabled else None
    if trainer.is_fsdp_enabled or (plugin is not None and plugin.zero_stage == 3):
        raise ValueError(
            "aitlrt sft writes the merged full model from the main process's copy of the weights, which FSDP and "
            "ZeRO-3 shard: run it on one process, DDP or ZeRO-1/2"
        )


def _save_full_model(
    trainer: SFTTrainer, tokenizer: PreTrainedTokenizerBase, out_dir: Path, base_config: PretrainedConfig
) -> None:
    """The trained model, LoRA merged, in the base checkpoint's dtype and with its ``use_cache`` (the Trainer turns
    it off), plus tokenizer: a folder vLLM serves and transformers generates from."""
    from peft import PeftModel

    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    if isinstance(model, PeftModel):
        model = model.merge_and_unload()
    if base_config.dtype is not None:
        model.to(base_config.dtype)
    model.config.use_cache = base_config.use_cache
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log.info("full model written to %s", out_dir)


def sft_parser(**kwargs: Any) -> TrlParser:
    """trl's ``TrlParser`` of ``aitlrt sft``: ``SftScriptArguments``, ``WarmStartSFTConfig`` and ``ModelConfig``
    (``kwargs``: ``argparse.ArgumentParser``'s); ``.parse_args_and_config(argv)`` gives the three."""
    return TrlParser((SftScriptArguments, WarmStartSFTConfig, ModelConfig), **kwargs)  # type: ignore[arg-type]


def run_sft(data: str | Path, model: str, output_dir: str | Path, **overrides: Any) -> SftResult:
    """``aitlrt sft`` without the command line: ``overrides`` are any ``WarmStartSFTConfig`` or trl ``ModelConfig``
    field (``max_steps=4``, ``use_peft=True``, ``lora_r=8``, ``learning_rate=1e-4``, ...)."""
    model_fields = {f.name for f in fields(ModelConfig)}
    config_fields = {f.name for f in fields(WarmStartSFTConfig)}
    unknown = set(overrides) - model_fields - config_fields
    if unknown:
        raise TypeError(f"run_sft: unknown settings {sorted(unknown)}")
    model_args = ModelConfig(model_name_or_path=model, **{k: v for k, v in overrides.items() if k in model_fields})
    config = WarmStartSFTConfig(
        output_dir=str(output_dir), **{k: v for k, v in overrides.items() if k in config_fields}
    )
    return train_sft(SftScriptArguments(data=str(data)), config, model_args)

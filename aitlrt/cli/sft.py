"""``aitlrt sft``: supervised fine-tuning on successful agent trajectories (``aitlrt.warmstart.sft``).

Arguments follow trl's ``TrlParser``, as ``aitlrt train``: ``--data``, every ``SFTConfig`` field (with
``WarmStartSFTConfig``'s defaults) and trl's ``ModelConfig`` (``--use_peft``, ``--lora_r``, ...); ``--config YAML``
sets any of them and flags override it. The verb hands its arguments over unparsed (``main``)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Fine-tune a model on the JSONL of `aitlrt trajectories` (one model call per line, trl's conversational
prompt-completion form) with trl's SFTTrainer; the loss covers the assistant's answer only. The output_dir
receives a full model (LoRA merged) and its tokenizer in safetensors, which vLLM serves and
`aitlrt/train.py --model_name_or_path OUTPUT_DIR` starts from, plus sft_metrics.jsonl (every log entry: loss per
step, learning rate, tokens) and sft_result.json.

  aitlrt sft --data traj.jsonl --model_name_or_path bundled --output_dir runs/sft
  aitlrt sft --data traj.jsonl --model_name_or_path bundled --use_peft --lora_r 16 --learning_rate 1e-4
  aitlrt sft --config configs/sft_cpu.yaml --num_train_epochs 2

Defaults that differ from trl's: gradient_checkpointing false, max_length 4096 (longer rows are dropped and
counted: truncation would cut their completion), per_device_train_batch_size 1 with gradient_accumulation_steps 8,
logging_steps 1, save_strategy no (only the final model), output_dir runs/sft; without CUDA use_cpu, and with
--bf16 unset bf16 autocast where the CPU has native bf16 (AMX, AVX512-BF16: ~1.5x faster), fp32 elsewhere (emulated
bf16 is ~3x slower). --model_name_or_path bundled is the bundled
SmolLM2-135M-Instruct; weights load in float32 (trl's --dtype) and are saved in the base model's dtype."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown (as HfArgumentParser's), the description's lines kept."""


def add_parser(verbs: argparse._SubParsersAction) -> None:
    verbs.add_parser(
        "sft",
        help="fine-tune on `aitlrt trajectories` output (trl SFTTrainer, LoRA or full; `aitlrt sft --help`)",
        add_help=False,
    )


def main(argv: list[str]) -> int:
    """Parse ``argv`` with trl's ``TrlParser``, fine-tune, print where the model and metrics are."""
    from aitlrt.common.logs import setup_logging

    setup_logging()  # before trl is imported
    from aitlrt.warmstart.sft import METRICS_FILE, SftDataError, sft_parser, train_sft

    parser = sft_parser(prog="aitlrt sft", description=DESCRIPTION, formatter_class=_HelpFormatter)
    script, config, model_args = parser.parse_args_and_config(argv)
    try:
        result = train_sft(script, config, model_args)
    except SftDataError as exc:
        raise SystemExit(f"aitlrt sft: {exc}") from None
    losses = f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}" if result.losses else "not logged"
    print(
        f"[aitlrt] sft: {result.rows} rows ({result.dropped_too_long} dropped as too long), {result.steps} steps, "
        f"loss {losses}, {result.tokens} tokens in {result.seconds:.1f} s ({result.tokens_per_s:.0f} tokens/s)"
    )
    print(f"[aitlrt] full model: {result.output_dir} (metrics: {result.output_dir / METRICS_FILE})")
    return 0

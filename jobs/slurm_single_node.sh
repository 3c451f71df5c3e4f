#!/usr/bin/env bash
# One node with N GPUs: vLLM behind aitlrt-serve on the first AITLRT_SERVE_GPUS of them, the trainer
# (accelerate launch aitlrt/train.py) on the rest; the policy reaches vLLM as safetensors in --weight_sync_dir.
#
#   sbatch jobs/slurm_single_node.sh configs/qwen_coder_7b_zero3.yaml [train flags ...]
#   bash jobs/slurm_single_node.sh --dry-run configs/qwen_coder_7b_zero3.yaml   # print the commands only
#
# Submit from the repository root; it also runs outside SLURM (a workstation with GPUs). Knobs, besides those
# of jobs/lib.sh (README, "Running on GPUs and SLURM clusters"):
#   AITLRT_CONFIG              training config (or the first argument)                    required
#   AITLRT_SERVE_GPUS          GPUs for vLLM                                                1
#   AITLRT_SERVE_DEVICES       explicit CUDA_VISIBLE_DEVICES of the server (e.g. 0,1)      the first AITLRT_SERVE_GPUS
#   AITLRT_TRAIN_DEVICES       explicit CUDA_VISIBLE_DEVICES of the trainer (may share)    the others
#   AITLRT_VLLM_TP, AITLRT_VLLM_DP   vLLM tensor / data parallel sizes, TP x DP = serving GPUs   jobs/vllm_layout.py
#   AITLRT_GPU_MEMORY_GIB      one GPU's memory, to check the weights fit vLLM's layout   nvidia-smi
#   AITLRT_ACCELERATE_CONFIG   accelerate config file                                      configs/accelerate/zero3.yaml
#
#SBATCH --job-name=aitlrt
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=32
#SBATCH --mem=256G
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
ROOT=${AITLRT_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[ -f "$ROOT/jobs/lib.sh" ] || ROOT=${SLURM_SUBMIT_DIR:-$PWD}  # sbatch runs a spooled copy of this script
# shellcheck source=jobs/lib.sh
source "$ROOT/jobs/lib.sh"

parse_common_args "$@"
parse_train_args "${ARGS[@]}"
[ "${SLURM_NNODES:-1}" = 1 ] || die "this script uses one node, the job has $SLURM_NNODES: use jobs/slurm_multi_node.sh"
ACCELERATE_CONFIG=${AITLRT_ACCELERATE_CONFIG:-$ROOT/configs/accelerate/zero3.yaml}
[ -f "$ACCELERATE_CONFIG" ] || die "accelerate config not found: $ACCELERATE_CONFIG"

# The node's GPUs as the job sees them (SLURM sets CUDA_VISIBLE_DEVICES), split between server and trainer.
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -ra ALL <<<"$CUDA_VISIBLE_DEVICES"
else
  n=$(gpus_per_node)
  mapfile -t ALL < <(seq 0 $((n - 1)))
fi
if [ -n "${AITLRT_SERVE_DEVICES:-}" ]; then
  IFS=, read -ra SERVE <<<"$AITLRT_SERVE_DEVICES"
else
  serve_gpus=${AITLRT_SERVE_GPUS:-1}
  [[ $serve_gpus =~ ^[1-9][0-9]*$ ]] || die "AITLRT_SERVE_GPUS must be a positive integer, got '$serve_gpus'"
  ((serve_gpus < ${#ALL[@]})) || die "AITLRT_SERVE_GPUS=$serve_gpus leaves no GPU for training (the job has ${#ALL[@]}); to share one, set AITLRT_SERVE_DEVICES and AITLRT_TRAIN_DEVICES"
  SERVE=("${ALL[@]:0:serve_gpus}")
fi
if [ -n "${AITLRT_TRAIN_DEVICES:-}" ]; then
  IFS=, read -ra TRAIN <<<"$AITLRT_TRAIN_DEVICES"
else
  TRAIN=()
  for d in "${ALL[@]}"; do [[ " ${SERVE[*]} " == *" $d "* ]] || TRAIN+=("$d"); done
fi
((${#TRAIN[@]} > 0)) || die "no GPU left for training: set AITLRT_TRAIN_DEVICES"
SERVE_DEVICES=$(IFS=,; echo "${SERVE[*]}")
TRAIN_DEVICES=$(IFS=,; echo "${TRAIN[*]}")

setup_project_dir
maybe_setup
container_wrap
OUTPUT_DIR=$(config_value output_dir trainer_output)
SYNC_DIR=${AITLRT_WEIGHT_SYNC_DIR:-$AITLRT_PROJECT_DIR/sync/$JOB_ID}
MODEL=${AITLRT_MODEL:-$(config_value model_name_or_path bundled)}
PORT=$(serve_port)
URL=http://127.0.0.1:$PORT
bypass_proxy 127.0.0.1 localhost
CONCURRENCY=$(rollout_concurrency "${#TRAIN[@]}")
serve_sampling_args
vllm_layout "${#SERVE[@]}" "${#SERVE[@]}" "$MODEL" "${SERVE_EXTRA[@]}"
DP_ARGS=()
((VLLM_DP == 1)) || DP_ARGS=(--data-parallel-size "$VLLM_DP")
resume_args "$OUTPUT_DIR"
install_traps
use_api_key "$OUTPUT_DIR/serve/api_key"
dry_run || mkdir -p "$SYNC_DIR"
log "GPUs: vLLM on $SERVE_DEVICES (TP $VLLM_TP x DP $VLLM_DP), training on $TRAIN_DEVICES; $CONCURRENCY agents per rank"

spawn "${WRAP[@]}" env CUDA_VISIBLE_DEVICES="$SERVE_DEVICES" "$(bin aitlrt-serve)" --model "$MODEL" \
  --host 127.0.0.1 --port "$PORT" --run-dir "$OUTPUT_DIR/serve" "${SAMPLING_ARGS[@]}" \
  --tensor-parallel-size "$VLLM_TP" "${DP_ARGS[@]}" "${SERVE_EXTRA[@]}"
SERVE_PID=$LAST_PID
wait_healthy "$URL" "$SERVE_PID"

spawn "${WRAP[@]}" env CUDA_VISIBLE_DEVICES="$TRAIN_DEVICES" "$(bin accelerate)" launch \
  --config_file "$ACCELERATE_CONFIG" --num_processes "${#TRAIN[@]}" --num_machines 1 \
  --main_process_port "$(main_process_port)" "$(train_script)" --config "$CONFIG" --serve "$URL" \
  --weight_sync_dir "$SYNC_DIR" --rollout_concurrency "$CONCURRENCY" "${RESUME_ARGS[@]}" "${TRAIN_ARGS[@]}"
supervise training "$LAST_PID" "$SERVE_PID"
